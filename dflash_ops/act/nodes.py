"""How a command runs on a job of N nodes (a target is the one-node job): one Run whose steps are
phases, every node connected and locked first, so every rule in the steps holds for every N."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from dflash_ops.job import joblock
from dflash_ops.errors import StepFailed
from dflash_ops.job.model import Target
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.transport.dry_run import DryRunTransport
from dflash_ops.act.runner import Halted, OnProgress, Run
from dflash_ops.transport.base import Transport
from dflash_ops.transport.factory import make_transport

T = TypeVar("T")


class Nodes(Protocol):
    """A job as the commands take it: a target (one node) or a multinode job (several)."""

    @property
    def name(self) -> str: ...

    def node_targets(self) -> list[Target]: ...


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the job: its target (whose job is its part of the job) and its transport."""

    index: int
    target: Target
    transport: Transport

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def label(self) -> str:
        return f"node {self.index} {self.name}"

    def ctx(self, phase: StepContext) -> StepContext:
        return StepContext(self.target, self.transport, phase.log, phase.status, phase.step, phase.number)


@dataclasses.dataclass
class JobContext(StepContext):
    """A phase's context for the whole job; it acts on a node through `each` or `one`."""

    job_name: str = ""
    nodes: tuple[Node, ...] = ()

    @property
    def target_name(self) -> str:
        return self.job_name


def _recorded(phase: StepContext, node: Node, ctx: StepContext) -> None:
    if ctx.commands:
        phase.commands.extend([f"# {node.label}", *ctx.commands])


def one(phase: StepContext, node: Node, fn: Callable[[Node, StepContext], T]) -> T:
    """fn on one node, in its own context; what it raises is raised as it is."""
    ctx = node.ctx(phase)
    try:
        return fn(node, ctx)
    finally:
        _recorded(phase, node, ctx)


def each_outcome(
    phase: StepContext, nodes: Sequence[Node], fn: Callable[[Node, StepContext], T]
) -> list[tuple[T | None, BaseException | None]]:
    """fn on every node at once: (value, None) or (None, the error) per node, in node order."""
    contexts = [node.ctx(phase) for node in nodes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = [pool.submit(fn, node, ctx) for node, ctx in zip(nodes, contexts, strict=True)]
        concurrent.futures.wait(futures)
    for node, ctx in zip(nodes, contexts, strict=True):
        _recorded(phase, node, ctx)
    return [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]


def each(phase: StepContext, nodes: Sequence[Node], fn: Callable[[Node, StepContext], T]) -> list[T]:
    """fn on every node at once; every node's failure is named (one line each), in node order."""
    outcomes = each_outcome(phase, nodes, fn)
    errors = [error for _, error in outcomes if error is not None]
    if errors:
        raise StepFailed("; ".join(first_lines(error) for error in errors))
    return [value for value, _ in outcomes]  # type: ignore[misc]  # no error: every value is there


def first_lines(error: BaseException, most: int = 1200) -> str:
    text = str(error).strip() or type(error).__name__
    return text if len(text) <= most else text[: most - 3] + "..."


def per_node(nodes: Sequence[Node], messages: Sequence[str]) -> str:
    return "\n".join(f"{node.label}: {message}" for node, message in zip(nodes, messages, strict=True))


def one_node(run: Run) -> bool:
    """Whether `run` acts on a one-node job (a target): its phases are then the steps themselves."""
    return isinstance(run.ctx, JobContext) and len(run.ctx.nodes) == 1


def on_nodes(
    run: Run,
    step: Callable[..., T],
    nodes: Sequence[Node],
    *args: Any,
    keep_going: bool = False,
    note: str = "",
    **kwargs: Any,
) -> list[tuple[Node, T]]:
    """`step` on every node at once; (node, result) where it succeeded. A failure ends the command
    (Halted) unless `keep_going` leaves the next phases the nodes it succeeded on."""
    if one_node(run):
        return [(node, run(step, node.target.job, *args, **kwargs)) for node in nodes]
    done: list[tuple[Node, T]] = []

    def phase(ctx: StepContext) -> StepOutcome:
        lines = []
        outcomes = each_outcome(ctx, nodes, lambda node, c: step(c, node.target.job, *args, **kwargs))
        for node, (value, error) in zip(nodes, outcomes, strict=True):
            if error is None:
                done.append((node, value))  # type: ignore[arg-type]  # no error: the step's value
                said = value.message if isinstance(value, StepOutcome) else str(value or "")
                lines.append(f"{node.label}: {said}")
            else:
                lines.append(f"{node.label}: FAILED: {first_lines(error)}")
        if len(done) < len(nodes):  # failed as the one node's step would: a refusal exits 2
            failed = StepFailed("\n".join(lines) + note)
            failed.exit_code = max(getattr(e, "exit_code", 1) for _, e in outcomes if e is not None)
            raise failed
        return StepOutcome("\n".join(lines))

    phase.__name__ = step.__name__
    try:
        run(phase)
    except Halted:
        if not (keep_going and done):
            raise
    return done


@contextlib.contextmanager
def acting_on(
    job: Nodes, command: str, dry_run: bool, on_locked: Callable[[], None] | None = None
) -> Iterator[JobContext]:
    """Where `command` acts on `job`: every node connected and locked in node order, so two commands never
    wait on each other's halves; `on_locked` runs once all are ours."""
    with contextlib.ExitStack() as stack:
        nodes = []
        for i, target in enumerate(job.node_targets()):
            transport = make_transport(target)
            stack.callback(transport.close)
            nodes.append(Node(i, target, DryRunTransport(transport) if dry_run else transport))
        if not dry_run:
            for node in nodes:
                stack.enter_context(joblock.held(node.transport, node.target, command))
        if on_locked is not None:
            on_locked()
        yield JobContext(nodes[0].target, nodes[0].transport, job_name=job.name, nodes=tuple(nodes))


@contextlib.contextmanager
def running(
    job: Nodes,
    command: str,
    plan: Sequence[str],
    dry_run: bool,
    on_progress: OnProgress | None,
    on_locked: Callable[[], None] | None = None,
) -> Iterator[tuple[Run, list[Node]]]:
    """A Run of `plan` (the phase names, in order) on the whole job, and its nodes."""
    with acting_on(job, command, dry_run, on_locked) as ctx:
        source = f"dflash_ops.commands.{command.replace('-', '_')}"
        with Run(command, ctx, plan, on_progress, source) as run:
            yield run, list(ctx.nodes)
