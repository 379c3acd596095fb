"""Running a playbook: plan every step (all input problems surface before anything runs), then
run the steps in order, stopping at the first failure, reporting progress as it goes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Any, Callable, Mapping

from ..errors import DflashOpsError, RemoteCommandError, StepFailed
from ..transport.base import Result, Transport
from .binding import bind_options, validate_playbook
from .document import Playbook, StepEntry
from .dry_run import DryRunTransport
from .registry import StepRegistry, StepSpec
from .templates import Unresolved, refs_in, render
from .typecheck import Mismatch, Problems, conform, describe

OK, FAILED, SKIPPED, DRY_RUN, NOT_RUN = "ok", "failed", "skipped", "dry-run", "not-run"


@dataclasses.dataclass
class StepOutcome:
    """What a step returns: a one-line message, the commands it ran (or would run), data for the
    report (the outputs the step declares among it, which later steps read as `{steps.NAME.KEY}`),
    and ok=False to fail without raising."""

    message: str = ""
    commands: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    ok: bool = True

    @classmethod
    def failed(cls, message: str, **kwargs: Any) -> "StepOutcome":
        return cls(message, ok=False, **kwargs)


def _ignore(_message: str) -> None:
    pass


@dataclasses.dataclass
class StepContext:
    """Where a step acts: the target, its job and the transport to it. The caller builds one per
    target; the engine hands each step a copy with `dry_run` set, `step`/`number` filled and a fresh
    `commands` list. What a step is told comes only through its parameters."""

    target: Any = None  # model.Target
    transport: Transport | None = None
    job: Any = None  # model.Job; defaults to target.job
    dry_run: bool = False
    log: Callable[[str], None] = _ignore
    status: Callable[[str], None] = _ignore  # a transient progress line; each replaces the last
    step: str = ""
    number: int = 0
    commands: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.job is None and self.target is not None:
            self.job = getattr(self.target, "job", None)

    @property
    def target_name(self) -> str:
        name = getattr(self.target, "name", None) or getattr(self.transport, "name", None)
        return name or "?"

    def run(
        self, script: str, *, timeout: float = 60.0, check: bool = True, stdin: bytes | None = None
    ) -> Result | None:
        """Run `script` on the target and record its exact command line. Under dry-run: only
        record it and return None (a step must not depend on output it cannot have)."""
        transport = self._transport()
        self.commands.append(transport.command_line(script, timeout))
        if self.dry_run:
            return None
        runner = transport.check if check else transport.run
        return runner(script, timeout=timeout, step=self.step or "run", stdin=stdin)

    def run_on_host(self, script: str, *, timeout: float = 60.0, check: bool = True) -> Result | None:
        """Like run, but on the Proxmox host of a pct target (real pids, the host's nvidia-smi)."""
        transport = self._transport()
        self.commands.append(transport.host_command_line(script, timeout))
        if self.dry_run:
            return None
        result = transport.run_on_host(script, timeout=timeout, step=self.step or "run")
        if check and not result.ok:
            raise RemoteCommandError(self.target_name, self.step or "run", result)
        return result

    def put(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        """Write `data` to `remote_path` on the target (atomically); under dry-run only record it."""
        transport = self._transport()
        self.commands.append(f"# put {len(data)} bytes -> {remote_path} (mode {mode:04o})")
        if not self.dry_run:
            transport.put(data, remote_path, mode=mode, step=self.step or "put")

    def _transport(self) -> Transport:
        if self.transport is None:
            raise StepFailed(f"[{self.target_name}] {self.step}: no transport to reach the target")
        return self.transport


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
class PlaybookResult:
    playbook: str
    target: str
    dry_run: bool
    steps: tuple[StepReport, ...]
    seconds: float
    source: str = ""  # the playbook file that ran

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def failed(self) -> StepReport | None:
        return next((s for s in self.steps if s.status == FAILED), None)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def summary(self) -> str:
        total, mode = len(self.steps), " (dry run)" if self.dry_run else ""
        bad = self.failed
        if bad is None:
            done = sum(s.status in (OK, DRY_RUN) for s in self.steps)
            return (
                f"[{self.target}] {self.playbook}{mode}: ok, {done} of {total} steps run, "
                f"{total - done} skipped ({self.seconds:.1f}s)"
            )
        return (
            f"[{self.target}] {self.playbook}{mode}: FAILED at step {bad.number}/{total} {bad.step} "
            f"after {self.seconds:.1f}s: {bad.message}"
        )


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress event: a step starts, logs a line, or ends (with its report)."""

    event: str  # start | log | status (transient) | end
    number: int
    total: int
    step: str
    target: str = ""
    message: str = ""
    report: StepReport | None = None


def format_progress(p: Progress, with_target: bool = False, show_commands: bool = True) -> str:
    """`[3/7] wait_gpu_free ... ok (4.2s) GPUs 1,2,3 free`; dry-run lists the commands below."""
    head = (f"[{p.target}] " if with_target else "") + f"[{p.number}/{p.total}] {p.step} ..."
    if p.event == "start":
        return head
    if p.event in ("log", "status"):
        return (f"[{p.target}] " if with_target else "") + f"      {p.message}"
    r = p.report
    assert r is not None
    line = f"{head} {r.status}"
    if r.status in (OK, FAILED, DRY_RUN):
        line += f" ({r.seconds:.1f}s)"
    if r.status == SKIPPED:
        return f"{line} ({r.message})"
    if r.message:
        first, *rest = r.message.splitlines()
        line += f" {first}" + "".join(f"\n      {x}" for x in rest)
    if show_commands and r.status == DRY_RUN:
        for command in r.commands:
            line += "\n      $ " + command.replace("\n", "\n        ")
    return line


@dataclasses.dataclass(frozen=True)
class _Planned:
    entry: StepEntry
    spec: StepSpec
    params: Mapping[str, Any]  # filled in before anything runs
    # as written: they read earlier steps' outputs, so they are filled in when the step starts
    from_steps: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    skip_reason: str = ""


def _roots(ctx: StepContext, options: Mapping[str, Any]) -> dict[str, Any]:
    return {"target": ctx.target, "job": ctx.job, "options": options}


def plan_playbook(
    playbook: Playbook, registry: StepRegistry, ctx: StepContext, options: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[_Planned]]:
    """Validate, bind `options` (the caller's, by name), decide `when`, and fill in every
    parameter of every step that will run: all input problems surface here, before the first step
    touches anything. A parameter that reads `{steps.NAME.KEY}` waits for that step's outputs."""
    validate_playbook(playbook, registry)
    bound = bind_options(playbook, options)
    roots = _roots(ctx, bound)
    problems = Problems(playbook.source)
    planned: list[_Planned] = []
    latest: dict[str, _Planned] = {}  # the last entry of each step name so far: what {steps.NAME...} reads
    for entry in playbook.steps:
        spec = registry.get(entry.step)
        assert spec is not None
        if entry.when is not None and not entry.when.holds(roots):
            item = _Planned(entry, spec, {}, skip_reason=entry.when.why_not())
        else:
            item = _plan_step(entry, spec, roots, latest, ctx.target_name, problems)
        latest[entry.step] = item
        planned.append(item)
    problems.raise_if_any()
    return bound, planned


def _plan_step(
    entry: StepEntry,
    spec: StepSpec,
    roots: Mapping[str, Any],
    latest: Mapping[str, _Planned],
    target_name: str,
    problems: Problems,
) -> _Planned:
    params, from_steps = {}, {}
    for key, param in spec.params.items():
        where = f"{entry.where()}: params.{key}"
        if key not in entry.params:
            params[key] = copy.deepcopy(param.default)
            continue
        value = entry.params[key]
        reads = [ref for ref in refs_in(value) if ref.path[0] == "steps"]
        for ref in reads:
            source = latest.get(ref.path[1])  # validate_playbook checked that it comes earlier
            if source is not None and source.skip_reason:
                problems.add(
                    where,
                    f"{{{ref}}} reads {source.entry.where()}, which is skipped "
                    f"({source.skip_reason}); give both steps the same `when:` or drop the reference",
                )
        if reads:
            from_steps[key] = value
            continue
        try:
            params[key] = conform(render(value, roots, target_name), param.type)
        except Unresolved as e:
            problems.add(where, str(e))
        except Mismatch as e:
            problems.add(where + e.where, f"after filling in templates: {e}")
    return _Planned(entry, spec, params, from_steps)


def run_playbook(
    playbook: Playbook,
    registry: StepRegistry,
    ctx: StepContext,
    dry_run: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    options: Mapping[str, Any] | None = None,
) -> PlaybookResult:
    """Run the steps in order and stop at the first failure; later steps are reported `not-run`.
    `options` are the run options by name (text is converted to the declared type).

    Raises InputError (nothing has run) for any problem in the playbook, options or templates.
    Step failures do not raise: they are in the result (`result.ok`, `result.failed`).
    """
    bound, planned = plan_playbook(playbook, registry, ctx, options)
    dry_run = dry_run or ctx.dry_run
    emit = on_progress or (lambda _p: None)
    transport = DryRunTransport(ctx.transport) if dry_run and ctx.transport is not None else ctx.transport
    base = dataclasses.replace(ctx, dry_run=dry_run, transport=transport)
    outputs: dict[str, Mapping[str, Any]] = {}
    roots = {**_roots(ctx, bound), "steps": outputs}
    total, target, reports = len(planned), ctx.target_name, []
    started = time.monotonic()
    failed = False
    for item in planned:
        number, name = item.entry.number, item.entry.step

        def progress(
            event: str,
            message: str = "",
            report: StepReport | None = None,
            _number: int = number,
            _name: str = name,
        ) -> None:
            emit(Progress(event, _number, total, _name, target, message, report))

        if failed or item.skip_reason:
            report = StepReport(number, name, NOT_RUN if failed else SKIPPED, message=item.skip_reason)
            reports.append(report)
            progress("end", report=report)
            continue
        progress("start")
        step_ctx = dataclasses.replace(
            base,
            step=name,
            number=number,
            commands=[],
            log=functools.partial(progress, "log"),
            status=functools.partial(progress, "status"),
        )
        report, given = _call_step(item, step_ctx, dry_run, roots)
        outputs[name] = given
        reports.append(report)
        progress("end", report=report)
        failed = report.status == FAILED
    return PlaybookResult(
        playbook.name, target, dry_run, tuple(reports), time.monotonic() - started, playbook.source
    )


def _fill_in(item: _Planned, ctx: StepContext, roots: Mapping[str, Any]) -> dict[str, Any]:
    """The step's parameters, those reading earlier steps' outputs filled in now."""
    params = dict(item.params)
    for key, value in item.from_steps.items():
        try:
            params[key] = conform(render(value, roots, ctx.target_name), item.spec.params[key].type)
        except (Unresolved, Mismatch) as e:
            raise StepFailed(f"[{ctx.target_name}] {ctx.step}: params.{key}: {e}") from None
    return params


def _declared_outputs(spec: StepSpec, data: Mapping[str, Any]) -> dict[str, Any]:
    """The outputs `spec` declares, taken from a successful run's data; a missing or mistyped one
    is a bug in the step (a later step would read nothing, or the wrong thing)."""
    given = {}
    for key, typ in spec.outputs.items():
        if key not in data:
            raise TypeError(f"step {spec.name} returned no {key!r}, an output it declares")
        try:
            given[key] = conform(data[key], typ)
        except Mismatch as e:
            raise TypeError(f"step {spec.name} output {key!r}{e.where}: {e}") from None
    return given


def _call_step(
    item: _Planned, ctx: StepContext, dry_run: bool, roots: Mapping[str, Any]
) -> tuple[StepReport, dict[str, Any]]:
    """The step's report, and its declared outputs when it succeeded."""
    started = time.monotonic()
    error: BaseException | None = None
    given: dict[str, Any] = {}
    try:
        outcome = item.spec.fn(ctx, **copy.deepcopy(_fill_in(item, ctx, roots)))
        if outcome is None or isinstance(outcome, str):
            outcome = StepOutcome(outcome or "")
        elif not isinstance(outcome, StepOutcome):
            raise TypeError(f"step {item.spec.name} returned {describe(outcome)}; expected StepOutcome")
        if outcome.ok:
            given = _declared_outputs(item.spec, outcome.data)
        status = (DRY_RUN if dry_run else OK) if outcome.ok else FAILED
        message, data, extra = outcome.message, dict(outcome.data), list(outcome.commands)
    except DflashOpsError as e:
        status, message, data, extra, error = FAILED, str(e), {}, [], e
    except Exception as e:  # a bug in a step: stop here and show it rather than run on blindly
        status, message, data, extra, error = FAILED, f"{type(e).__name__}: {e}", {}, [], e
    report = StepReport(
        item.entry.number,
        item.entry.step,
        status,
        time.monotonic() - started,
        message,
        tuple(ctx.commands + extra),
        data,
        error,
    )
    return report, given
