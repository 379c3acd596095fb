"""How a multinode job's commands run: a Node (a target running its part of the job, with its open
transport), fn on every node at once (`each`), and numbered phases printed as playbook progress
lines, each phase one line per node (`Phases.on_nodes`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator

from . import joblock
from .errors import DflashOpsError, StepFailed
from .model import Target
from .multinode_inventory import MultinodeJob
from .playbook import DRY_RUN, FAILED, NOT_RUN, OK, SKIPPED, PlaybookResult, Progress, StepContext, StepReport
from .transport.factory import make_transport

Emit = Callable[[Progress], None]


@dataclasses.dataclass
class Node:
    """One node of the job: its target (whose job is its part of the job) and the open transport."""

    index: int
    target: Target
    transport: Any = None
    said: Callable[[str], None] = lambda _m: None  # a line of progress (wait_first_step's log)
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def label(self) -> str:
        return f"node {self.index} {self.name}"

    def ctx(self, step: str, status: Callable[[str], None] | None = None) -> StepContext:
        ctx = StepContext(target=self.target, transport=self.transport, job=self.target.job, step=step)
        ctx.log = self.said
        if status is not None:
            ctx.status = status
        return ctx


def each_outcome(nodes: list[Node], fn: Callable[[Node], Any]) -> list[tuple[Any, BaseException | None]]:
    """fn on every node at once: (value, None) or (None, the error) per node, in node order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = [pool.submit(fn, node) for node in nodes]
        concurrent.futures.wait(futures)
    return [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]


def each(nodes: list[Node], fn: Callable[[Node], Any]) -> list[Any]:
    """fn on every node at once; every node's failure is named (one line each), in node order."""
    outcomes = each_outcome(nodes, fn)
    errors = [error for _, error in outcomes if error is not None]
    if errors:
        raise StepFailed("; ".join(first_lines(error) for error in errors))
    return [value for value, _ in outcomes]


def first_lines(error: BaseException, most: int = 1200) -> str:
    text = str(error).strip() or type(error).__name__
    return text if len(text) <= most else text[: most - 3] + "..."


def per_node(nodes: list[Node], messages: list[str]) -> str:
    return "\n".join(f"{node.label}: {message}" for node, message in zip(nodes, messages, strict=True))


class Phases:
    """Numbered phases with the playbook progress lines: `[3/10] shared_runs_dir ... ok (0.4s) ...`."""

    def __init__(self, command: str, job: str, names: list[str], emit: Emit | None, dry_run: bool = False):
        self.command, self.job, self.names, self.emit, self.dry_run = command, job, names, emit, dry_run
        self.reports: list[StepReport] = []
        self.started = time.monotonic()

    def _send(self, event: str, number: int, name: str, message: str = "", report=None) -> None:
        if self.emit is not None:
            self.emit(Progress(event, number, len(self.names), name, self.job, message, report))

    def say(self, name: str) -> Callable[[str], None]:
        number = self.names.index(name) + 1
        return lambda message: self._send("log", number, name, message)

    def status(self, name: str) -> Callable[[str], None]:
        number = self.names.index(name) + 1
        return lambda message: self._send("status", number, name, message)

    def run(self, name: str, fn: Callable[[], str]) -> None:
        number = self.names.index(name) + 1
        self._send("start", number, name)
        began = time.monotonic()
        try:
            message, status, error = fn(), DRY_RUN if self.dry_run else OK, None
        except DflashOpsError as exc:
            message, status, error = first_lines(exc, 4000), FAILED, exc
        report = StepReport(number, name, status, time.monotonic() - began, message, error=error)
        self.reports.append(report)
        self._send("end", number, name, report=report)
        if error is not None:
            raise Stop()

    def on_nodes(
        self,
        name: str,
        nodes: list[Node],
        fn: Callable[[Node], str],
        keep_going: bool = False,
        note: str = "",
    ) -> list[Node]:
        """Phase `name` as fn on every node at once, one line per node. Returns the nodes it
        succeeded on; a failure on any node fails the phase (and ends the command unless
        `keep_going`: the others still go on), with `note` added."""
        done: list[Node] = []

        def run() -> str:
            lines = []
            for node, (message, error) in zip(nodes, each_outcome(nodes, fn), strict=True):
                lines.append(
                    f"{node.label}: " + (message if error is None else f"FAILED: {first_lines(error)}")
                )
                if error is None:
                    done.append(node)
            if len(done) < len(nodes):
                raise StepFailed("\n".join(lines) + note)
            return "\n".join(lines)

        try:
            self.run(name, run)
        except Stop:
            if not keep_going:
                raise
        return done

    def skip(self, name: str, why: str) -> None:
        number = self.names.index(name) + 1
        report = StepReport(number, name, SKIPPED, message=why)
        self.reports.append(report)
        self._send("end", number, name, report=report)

    def result(self) -> PlaybookResult:
        done = {r.step for r in self.reports}
        rest = [StepReport(i + 1, name, NOT_RUN) for i, name in enumerate(self.names) if name not in done]
        return PlaybookResult(
            self.command,
            self.job,
            self.dry_run,
            tuple(self.reports + rest),
            time.monotonic() - self.started,
            source="multinode job",
        )


class Stop(Exception):
    """A phase failed (its report says why): the command ends there."""


@contextlib.contextmanager
def connected(job: MultinodeJob, command: str, rdzv_id: str = "", lock: bool = True) -> Iterator[list[Node]]:
    """Every node connected and, unless `lock` is false, its job lock held (taken in node order,
    so two commands on one job never wait on each other's halves). JobBusy when one is held."""
    nodes = [Node(i, target) for i, target in enumerate(job.node_targets(rdzv_id))]
    with contextlib.ExitStack() as stack:
        for node in nodes:
            node.transport = make_transport(node.target)
            stack.callback(node.transport.close)
        for node in nodes:
            if lock:
                stack.enter_context(joblock.held(node.transport, node.target, command))
        yield nodes
