"""Planned steps run in order on one target; the first failure halts, the rest are reported not-run."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

from dflash_ops.errors import DflashOpsError
from dflash_ops.act.context import StepContext, StepOutcome

OK, FAILED, SKIPPED, DRY_RUN, NOT_RUN = "ok", "failed", "skipped", "dry-run", "not-run"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StepReport:
    number: int
    step: str
    status: str  # ok | failed | skipped | dry-run | not-run
    seconds: float = 0.0
    message: str = ""
    commands: tuple[str, ...] = ()
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class RunResult:
    name: str  # the command or playbook
    target: str
    dry_run: bool
    steps: tuple[StepReport, ...]
    seconds: float
    source: str = ""  # what ran: dflash_ops.commands.relaunch, or a playbook file

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def failed(self) -> StepReport | None:
        return next((s for s in self.steps if s.status == FAILED), None)

    @property
    def exit_code(self) -> int:
        """0, or the failed step's error's code (2: it refused its input; 130: interrupted), else 1."""
        bad = self.failed
        if bad is None:
            return 0
        return bad.error.exit_code if isinstance(bad.error, DflashOpsError) else 1

    def summary(self) -> str:
        total, mode, bad = len(self.steps), " (dry run)" if self.dry_run else "", self.failed
        if bad is None:
            done = sum(s.status in (OK, DRY_RUN) for s in self.steps)
            return (
                f"[{self.target}] {self.name}{mode}: ok, {done} of {total} steps run, "
                f"{total - done} skipped ({self.seconds:.1f}s)"
            )
        return (
            f"[{self.target}] {self.name}{mode}: FAILED at step {bad.number}/{total} {bad.step} "
            f"after {self.seconds:.1f}s: {bad.message}"
        )


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """What a running step reports: it starts, logs a line, shows a transient status, or ends."""

    event: str  # start | log | status | end
    number: int
    total: int
    step: str
    target: str = ""
    message: str = ""
    report: StepReport | None = None


OnProgress = Callable[[StepEvent], None]


class Halted(Exception):
    """A step failed: the rest of the plan does not run (leaving `with Run(...)` ends the block)."""


class Run:
    """One run of a plan on one target: `run(step, job)` records a step; a failure raises Halted."""

    def __init__(
        self,
        name: str,
        ctx: StepContext,
        plan: Sequence[str],
        on_progress: OnProgress | None = None,
        source: str = "",
    ):
        self.name, self.ctx, self.plan, self.source = name, ctx, tuple(plan), source
        self.emit = on_progress or (lambda _p: None)
        self.reports: list[StepReport] = []
        self.started = time.monotonic()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> bool:
        return kind is Halted

    def __call__(self, step: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        name = step.__name__
        number = self._next(name)
        self._progress("start", number, name)
        ctx = dataclasses.replace(
            self.ctx,
            step=name,
            number=number,
            commands=[],
            log=functools.partial(self._progress, "log", number, name),
            status=functools.partial(self._progress, "status", number, name),
        )
        started, returned = time.monotonic(), None
        error: BaseException | None = None
        try:
            returned = step(ctx, *args, **kwargs)
            outcome = _as_outcome(name, returned)
        except DflashOpsError as e:
            outcome, error = StepOutcome.failed(str(e)), e
        except Exception as e:  # a bug in a step: stop here and show it rather than run on blindly
            outcome, error = StepOutcome.failed(f"{type(e).__name__}: {e}"), e
        status = FAILED if not outcome.ok else DRY_RUN if ctx.dry_run else OK
        seconds = time.monotonic() - started
        data = outcome.report_data() if outcome.ok else {}
        self._end(
            StepReport(number, name, status, seconds, outcome.message, tuple(ctx.commands), data, error)
        )
        if status == FAILED:
            raise Halted(name)
        return returned  # type: ignore[return-value]  # what the step returned, checked above

    def skip(self, step: Callable[..., Any] | str, why: str) -> None:
        name = step if isinstance(step, str) else step.__name__
        self._end(StepReport(self._next(name), name, SKIPPED, message=why))

    def result(self) -> RunResult:
        for name in self.plan[len(self.reports) :]:
            self._end(StepReport(len(self.reports) + 1, name, NOT_RUN))
        seconds = time.monotonic() - self.started
        return RunResult(
            self.name, self.ctx.target_name, self.ctx.dry_run, tuple(self.reports), seconds, self.source
        )

    def _next(self, name: str) -> int:
        """The number of step `name`, which must be the plan's next one (else: a bug in the caller)."""
        index = len(self.reports)
        if index >= len(self.plan) or self.plan[index] != name:
            raise RuntimeError(f"{self.name}: step {name} is not step {index + 1} of its plan {self.plan}")
        return index + 1

    def _progress(self, event: str, number: int, name: str, message: str = "") -> None:
        self.emit(StepEvent(event, number, len(self.plan), name, self.ctx.target_name, message))

    def _end(self, report: StepReport) -> None:
        self.reports.append(report)
        total = len(self.plan)
        self.emit(StepEvent("end", report.number, total, report.step, self.ctx.target_name, report=report))


def _as_outcome(name: str, returned: object) -> StepOutcome:
    if returned is None or isinstance(returned, str):
        return StepOutcome(returned or "")
    if not isinstance(returned, StepOutcome):
        raise TypeError(f"step {name} returned {type(returned).__name__}; expected StepOutcome, text or None")
    return returned
