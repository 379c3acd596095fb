"""The step library: `fn(ctx, job, ...)`, every remote command through `ctx.run`; under --dry-run a
step says what it would do. A parameter a command sets has no default here: the command's is the one."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import posixpath
import shlex
import time
from typing import Any

from dflash_ops.act import deploy as deploy_lib
from dflash_ops.job import jobpaths, jobstate, tmux
from dflash_ops.act import launch as launch_lib
from dflash_ops.errors import DflashOpsError, InputError, Interrupted, RemoteCommandError, StepFailed
from dflash_ops.observe.gpu import busy_gpus
from dflash_ops.job.model import Job
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.act.processes import (
    _fail,
    _gpu_snapshot,
    describe_foreign,
    job_processes,
    refuse_while_job_lives,
    resolve_cache,
    surely_foreign,
)
from dflash_ops.remote import bundle, facts, shell_command


@dataclasses.dataclass(kw_only=True)
class Ended(StepOutcome):
    """What the stop steps give: `foreign` are the processes on its GPUs surely not the job's, left alone."""

    foreign: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _end_job_processes(ctx: StepContext, job: Job, grace_s: float, include_session: bool) -> Ended:
    report = job_processes(ctx, job, list(job.gpus), grace_s, include_session, "kill")
    if ctx.dry_run:
        return Ended(
            message="would SIGTERM this job's processes, SIGKILL after "
            f"{grace_s:g}s; other processes are only reported"
        )
    if report["survivors"]:
        raise _fail(ctx, f"processes survived SIGKILL: {report['survivors']}")
    if report["job"]:
        message = (
            f"ended {len(report['job'])} process(es): {len(report['terminated'])} on SIGTERM, "
            f"{len(report['killed'])} needed SIGKILL"
        )
    elif report.get("exited_panes"):
        codes = ", ".join("?" if p["status"] is None else str(p["status"]) for p in report["exited_panes"])
        message = f"the trainer had already exited (status {codes}); nothing was running"
    else:
        message = "no job processes running"
    if report["unidentified"]:
        # inside LXC the driver reports HOST pids; on a plain host the process has exited since
        in_container = getattr(ctx.target, "transport", None) == "pct"
        invisible = "not visible here: a host pid?" if in_container else "exited, no longer in /proc"
        message += "; left alone (not this job's): " + describe_foreign(report["unidentified"], invisible)
    return Ended(message=message, data=report, foreign=surely_foreign(report["unidentified"]))


def stop_session(ctx: StepContext, job: Job, grace_s: float, record_stop: bool = False) -> Ended:
    """SIGTERM the session's tree, SIGKILL after grace_s, remove the session; `record_stop` records
    `stopping` before any signal, so an interrupt cannot leave the stop unrecorded."""
    from dflash_ops.act.grace import check_grace

    check_grace(job, grace_s, given_as="grace_s")  # here, so it holds for every way in
    if record_stop:
        # health answers UNKNOWN and relaunches nothing already; mark_stopped then fails loudly
        with contextlib.suppress(_StateUnusable):
            _record_stop(ctx, job, jobstate.STOPPING, grace_s)
    ended = _end_job_processes(ctx, job, grace_s, include_session=True)
    session = str((ended.data or {}).get("session") or job.session)  # an earlier version's job: its own
    if (ended.data or {}).get("others_session"):
        ended.message += (
            f"; tmux session {session!r} (socket {job.tmux_socket}) runs another job's trainer: left alone"
        )
        return ended
    ctx.run(tmux.kill_session(job, session) + " || true", timeout=30)
    still = ctx.run(tmux.has_session(job, session), timeout=30, check=False)
    if still.ok and not ctx.dry_run:
        raise _fail(ctx, f"session {session!r} is still there after kill-session")
    return ended


def kill_gpu_processes(ctx: StepContext, job: Job, grace_s: float = 10.0) -> Ended:
    """End leftovers of earlier launches (marked); foreign GPU processes are reported, never signalled."""
    return _end_job_processes(ctx, job, grace_s, include_session=False)


def wait_gpu_free(
    ctx: StepContext,
    job: Job,
    ended: Ended | None = None,
    *,
    timeout_s: float,
    max_used_mib: int = 1024,
    poll_s: float = 2.0,
) -> StepOutcome:
    """Wait until the job's processes have left its GPUs; after `ended`, foreign processes are not waited
    for and a failing GPU query cannot undo that the job's ended."""
    gpus = list(job.gpus)
    if not gpus:
        return StepOutcome("no GPUs assigned to this job")
    # (pid, owner) of each foreign process, as the GPU snapshot names them
    foreign = {(int(p["pid"]), p.get("owner") or "") for p in (ended.foreign if ended is not None else [])}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            snapshot = _gpu_snapshot(ctx)
        except StepFailed as exc:
            if ended is None:
                raise
            return StepOutcome(
                f"the job's processes are gone; GPUs not checked: {str(exc).split(': ', 1)[-1]}"
            )
        if ctx.dry_run:
            return StepOutcome(f"would wait up to {timeout_s:g}s for GPUs {gpus}")
        holders = [
            b.describe() for b in busy_gpus(without(snapshot, foreign), gpus, max_used_mib=max_used_mib)
        ]
        if not holders:
            shared = (
                f" of this job's processes (foreign processes left alone: {len(foreign)})" if foreign else ""
            )
            return StepOutcome(f"GPUs {','.join(map(str, gpus))} free{shared}")
        if time.monotonic() > deadline:
            raise _fail(ctx, f"still busy after {timeout_s:g}s: " + "; ".join(holders))
        ctx.commands.clear()  # one poll is enough to show
        time.sleep(poll_s)


def without(snapshot, foreign: set[tuple[int, str]]):
    """The snapshot without the foreign processes and their memory (not ours to wait for)."""
    if not foreign:
        return snapshot
    gpus = []
    for gpu in snapshot.gpus:
        theirs = [p for p in gpu.processes if (p.pid, p.owner) in foreign]
        ours = tuple(p for p in gpu.processes if (p.pid, p.owner) not in foreign)
        used = gpu.memory_used_mib
        if used is not None and theirs:
            sizes = [p.used_memory_mib for p in theirs]
            used = None if None in sizes else max(0, used - sum(sizes))
        gpus.append(dataclasses.replace(gpu, processes=ours, memory_used_mib=used))
    return dataclasses.replace(snapshot, gpus=tuple(gpus))


def _check_purgeable(ctx: StepContext, job: Job, path: str) -> None:
    norm = posixpath.normpath(path)
    protected = {posixpath.normpath(p) for p in (job.workdir, "/root", "/home", "/tmp", "/var", "/usr")}
    if not posixpath.isabs(norm) or norm.count("/") < 2 or norm in protected:
        raise _fail(
            ctx,
            f"refusing to purge {path!r}: give a dedicated cache dir "
            "(absolute, at least two levels deep, not the workdir)",
        )


def purge_cache(
    ctx: StepContext, job: Job, paths: list[str] | None = None, if_unmarked: str = "fail"
) -> StepOutcome:
    """Remove compile-cache dirs only if they hold the launcher's marker, never while the job lives."""
    if if_unmarked not in ("fail", "skip"):
        raise _fail(ctx, f"if_unmarked must be fail or skip, not {if_unmarked!r}")
    paths = [job.cache_dir] if paths is None else paths
    for path in paths:
        _check_purgeable(ctx, job, path)
        real, why = resolve_cache(ctx, job, path)  # what the path really is on the target
        if why is not None:
            raise _fail(ctx, f"refusing to purge: {why}")
        if real:
            _check_purgeable(ctx, job, real)  # /tmp through a symlink is /tmp
    refuse_while_job_lives(ctx, job, "stop it first (dflash-ops stop)")
    done, skipped = [], []
    for path in paths:
        marker = posixpath.join(path, jobpaths.CACHE_MARKER)
        result = ctx.run(shell_command("purge_cache.sh", path, marker), timeout=300)
        answer = "purged" if ctx.dry_run else result.stdout.strip()
        if answer == "unmarked":
            if if_unmarked == "fail":
                raise _fail(
                    ctx,
                    f"refusing to purge {path}: it has no {jobpaths.CACHE_MARKER} file, so "
                    "dflash-ops did not create it as a cache; check job.cache_dir",
                )
            skipped.append(path)
        elif answer == "purged":
            done.append(path)
    parts = [("would purge " if ctx.dry_run else "purged ") + ", ".join(done)] if done else []
    parts += [f"left {p} alone (no {jobpaths.CACHE_MARKER}: not created by dflash-ops)" for p in skipped]
    return StepOutcome("; ".join(parts) or "nothing to purge")


def deploy(ctx: StepContext, job: Job, keep_releases: int = deploy_lib.KEEP_RELEASES) -> StepOutcome:
    """Upload the bundled trainer as a versioned release and switch `current` to it."""
    bundle = deploy_lib.build_bundle()
    tarball = posixpath.join(jobpaths.releases_dir(job), bundle.release_id + ".tar.gz")
    ctx.run(shlex.join(["mkdir", "-p", jobpaths.releases_dir(job)]), timeout=30)
    ctx.put(bundle.data, tarball)
    _refusable(ctx, deploy_lib.install_script(job, bundle, tarball, keep_releases), StepFailed)
    return StepOutcome(f"release {bundle.release_id} is current", data={"release": bundle.release_id})


@dataclasses.dataclass(kw_only=True)
class Launched(StepOutcome):
    log: str


def launch(ctx: StepContext, job: Job, resume: bool) -> Launched:
    """Start the trainer in a detached tmux session: the newest unfinished run (resume) or a new one."""
    return start_run(ctx, job, resume=resume)


def start_run(ctx: StepContext, job: Job, *, resume: bool = True, run: str | None = None) -> Launched:
    """launch, or with `run` (NNNN) that run: a multinode job chooses it once for all its nodes."""
    _, why = resolve_cache(ctx, job, job.cache_dir)
    if why is not None:
        raise _fail(ctx, f"refusing to launch: {why}")
    script = launch_lib.launch_command(job, resume=resume, run=run)
    result = ctx.run(script, timeout=60, stdin=bundle(launch_lib.LAUNCHER))
    if ctx.dry_run:
        shown = run or "NNNN"
        return Launched(
            message=f"would start tmux session {job.session!r} running: "
            f"{shlex.join(launch_lib.trainer_argv(job, f'{jobpaths.runs_dir(job)}/{shown}'))}",
            log=posixpath.join(job.log_dir, f"{facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX}"),
        )
    printed = result.stdout.strip().splitlines()
    if not printed or not printed[-1].startswith("/"):
        raise _fail(ctx, f"the launch printed no log path: {result.stdout.strip()[:200]!r}")
    log = printed[-1]
    return Launched(message=f"session {job.session!r} started, log {log}", log=log)


def mark_stopped(ctx: StepContext, job: Job) -> StepOutcome:
    """Record the operator's stop, so health never relaunches the job; unrecorded, this step fails."""
    return _record_stop(ctx, job, jobstate.STOPPED)


class _StateUnusable(StepFailed):
    """The state path is no regular file: nothing can be recorded, and readers already won't relaunch."""


def _record_stop(ctx: StepContext, job: Job, state: str, grace_s: float | None = None) -> StepOutcome:
    """Record `state` and read it back: the stop counts only once the file says so; a finished run stays."""
    path = jobpaths.state_file(job)
    result = ctx.run(jobstate.read_script(job), timeout=30)
    if ctx.dry_run:
        return StepOutcome(f"would record `{state}` in {path}")
    try:
        clock, kind, previous = jobstate.parse_read(result.stdout)
    except ValueError as exc:
        raise _fail(ctx, f"the stop could not be recorded: {exc}") from None

    def unrecorded(why: str, error: type[StepFailed] = StepFailed) -> StepFailed:
        return error(
            f"[{ctx.target_name}] {ctx.step}: the stop could not be recorded: {why}; until it is, health "
            "cannot tell this stop from a crash: it answers UNKNOWN and --auto-relaunch relaunches nothing"
        )

    if kind != jobstate.FILE and kind != jobstate.ABSENT:
        raise unrecorded(f"{path} is not a regular file ({jobstate.NOT_A_FILE_FIX})", _StateUnusable)
    if previous is not None and previous.state == jobstate.FINISHED:
        # a completed run is not an interrupted one: status and health keep reporting it as finished
        return StepOutcome("job state kept: the run had finished")
    if previous is None:  # nothing recorded yet: the state names this job (never an earlier version's)
        previous = jobstate.JobState(state, job=jobpaths.marker_value(job))
    wanted = jobstate.encode(jobstate.stop_record(previous, state, clock, grace_s))
    ctx.run(shlex.join(["mkdir", "-p", job.workdir]), timeout=30)
    try:
        ctx.put(wanted, path)
    except DflashOpsError as exc:
        raise unrecorded(f"writing {path} failed ({str(exc).splitlines()[-1].strip()})") from None
    written = ctx.run(jobstate.read_command(job), timeout=30, check=False)
    if written.stdout.encode() != wanted:
        raise unrecorded(f"{path} does not hold what was written")
    return StepOutcome(f"job state: {state} by {jobstate.STOPPED_BY}")


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


_WATCH_BYTES = 1 << 20  # of the metrics tail per poll: 50 records are a few KiB
_START_RECORD = '"event":"start"'  # as trainer.metrics_format encodes it


def _watch_script(job: Job, log: str) -> str:
    from trainer.metrics_format import metrics_path_for_log

    metrics = shlex.quote(metrics_path_for_log(log))
    # the newest start record, wherever it is, then the tail: a trainer that is many records past its
    # start (a fast one, or a late first look) is still recognised as this launch's
    return (
        f"{tmux.pane_pids(job)} | head -c 4096; echo @@; "
        f"{{ grep -F {shlex.quote(_START_RECORD)} {metrics} | tail -n 1 | tail -c {_WATCH_BYTES}; "
        f"tail -n 50 {metrics} | tail -c {_WATCH_BYTES}; }} 2>/dev/null; echo @@; "
        f"tail -n 1 {shlex.quote(log)} 2>/dev/null | tail -c 2000; echo @@; "
        f"{jobstate.read_command(job)}; true"
    )


def wait_first_step(
    ctx: StepContext, job: Job, launched: Launched, timeout_s: float, poll_s: float = 1.0
) -> StepOutcome:
    """Wait for the first training step; on failure show the log's end, interrupted say the job trains on."""
    try:
        return _wait_first_step(ctx, job, launched, timeout_s, poll_s)
    except KeyboardInterrupt:
        raise Interrupted(
            f"[{ctx.target_name}] {ctx.step}: interrupted while waiting for the first step; the job was "
            f"launched (log {launched.log}) and trains on: `dflash-ops status -t {ctx.target_name}` "
            f"shows it, `dflash-ops stop -t {ctx.target_name}` stops it"
        ) from None


def _wait_first_step(
    ctx: StepContext, job: Job, launched: Launched, timeout_s: float, poll_s: float
) -> StepOutcome:
    from trainer.metrics_format import current_run, last_of, parse_lines

    started = time.monotonic()
    shown_line = ""
    while True:
        result = ctx.run(_watch_script(job, launched.log), timeout=60, check=False)
        if ctx.dry_run:
            return StepOutcome(f"would wait up to {timeout_s:g}s for the first step in the metrics file")
        panes, _, rest = result.stdout.partition("@@")
        metrics, _, rest = rest.partition("@@")
        last_line, _, state_text = rest.partition("@@")
        # only the new trainer's records: the file may hold an earlier one's (see current_run)
        state = jobstate.parse(state_text)
        records = current_run(parse_lines(metrics), state.since if state is not None else None)
        step = last_of(records, "step")
        if step is not None:
            loss, rate = _number(step.get("loss")), _number(step.get("tokens_per_s"))
            ktok = 0.0 if math.isnan(rate) else rate / 1000
            return StepOutcome(
                f"step {step.get('step')}: loss {loss:.4f}, {ktok:.1f} Ktok/s", data={"step": step}
            )
        why = _why_no_step(records, panes)
        if why is None and time.monotonic() > started + timeout_s:
            why = f"no training step after {timeout_s:g}s"
        if why is not None:
            raise no_first_step(ctx, launched.log, why)
        # each new last line of the log once, as a line that stays; the elapsed time as the status
        line = " ".join(last_line.split())[:160]
        if line and line != shown_line:
            ctx.log(f"log: {line}")
            shown_line = line
        ctx.status(f"waiting for the first step: {time.monotonic() - started:.0f} s of {timeout_s:g} s")
        ctx.commands.clear()
        time.sleep(poll_s)


def _why_no_step(records: list, panes: str) -> str | None:
    """Why no step will come (error, nothing to train, trainer gone), or None while one may."""
    from trainer.metrics_format import last_of

    error, done = last_of(records, "error"), last_of(records, "done")
    if error is not None:
        return f"the trainer reported {error.get('kind', 'an error')}: {error.get('message', '')}"
    if done is not None and done.get("reason") == "max_steps":
        return (
            f"the resumed run was already complete (step {done.get('step')}): nothing left to train; "
            "`dflash-ops relaunch --fresh` starts a new run"
        )
    return tmux.pane_problem(panes)


def no_first_step(ctx: StepContext, log: str, why: str) -> StepFailed:
    """The failure, with the last lines of the log and the failure signature found in them."""
    from dflash_ops.observe.logs import find_failures

    tail = f"{shlex.join(['tail', '-n', '400', log])} | tail -c {_WATCH_BYTES}"
    read = ctx.run(tail, timeout=30, check=False)
    failures = find_failures(read.stdout)
    signature = f" (signature: {failures[0].name})" if failures else ""
    last = "\n    ".join(read.stdout.rstrip().splitlines()[-30:])
    return _fail(ctx, f"{why}{signature}\n  last lines of {log}:\n    {last}")


def rollback(ctx: StepContext, job: Job, release: str | None = None) -> StepOutcome:
    """Point `current` at a kept release, or (none named) at the one deployed before it."""
    # not kept, incomplete, or no earlier one: what was asked for is not there (nothing changed)
    result = _refusable(ctx, deploy_lib.rollback_script(job, release), InputError)
    if ctx.dry_run:
        return StepOutcome(f"would switch `current` to {release or 'the previous release'}")
    return StepOutcome(result.stdout.strip())


def _refusable(ctx: StepContext, script: str, error: type[DflashOpsError]):
    """Run a deploy script; its refusal (deploy_lib.REFUSED) is raised as `error` with its stderr line."""
    result = ctx.run(script, timeout=120, check=False)
    if result.exit_code == deploy_lib.REFUSED:
        said = (result.stderr.strip().splitlines() or ["refused"])[-1]
        raise error(f"[{ctx.target_name}] {ctx.step}: {said}")
    if not result.ok:
        raise RemoteCommandError(ctx.target_name, ctx.step, result)
    return result
