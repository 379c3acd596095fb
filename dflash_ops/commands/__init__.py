"""The commands that act on a job: each is the steps it runs, in order, as plain Python, with its
options as keyword arguments whose defaults are stated here once (the CLI's --help reads them
with `default_of`). Each holds the job's lock on the target while it runs; a dry run takes none.

This module imports its steps when a command runs, so `dflash-ops --help` stays light."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from dflash_ops.job.model import Target
    from dflash_ops.act.context import StepContext
    from dflash_ops.act.runner import OnProgress, Run, RunResult
    from dflash_ops.observe.check import Checked
    from dflash_ops.playbook.user import Playbook

# Options several commands share.
GRACE_S = 30.0  # between the polite stop signal (the trainer checkpoints) and the kill
GPU_FREE_S = 120.0  # the longest wait for the job's GPUs to be free


def default_of(command: Callable[..., Any], option: str) -> Any:
    """The default of `command`'s keyword argument `option`, for --help."""
    return inspect.signature(command).parameters[option].default


def relaunch(
    target: Target,
    *,
    purge: bool = True,
    deploy: bool = True,
    resume: bool = True,
    timeout: float = 900.0,
    grace: float = GRACE_S,
    gpu_free_timeout: float = GPU_FREE_S,
    allow_shared_gpus: bool = False,
    min_free_gib: float = 10.0,
    import_torch: bool = True,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
    on_locked: Callable[[], None] | None = None,
) -> RunResult:
    """Check first, then stop the job, free its GPUs, purge its compile cache (`purge`), deploy the
    trainer (`deploy`), launch it (resuming the newest unfinished run unless not `resume`) and wait
    `timeout` seconds at most for its first training step. `on_locked` runs once the lock is ours."""
    from dflash_ops.act import preflight as p, steps as s
    from dflash_ops.act.grace import check_grace

    job = target.job
    check_grace(job, grace)  # the step checks it too; here it is refused before anything connects
    plan = (
        p.preflight,
        s.stop_session,
        s.kill_gpu_processes,
        s.wait_gpu_free,
        s.purge_cache,
        s.deploy,
        s.launch,
        s.wait_first_step,
    )
    with _running(target, "relaunch", plan, dry_run, on_progress, on_locked) as run:
        # Before anything is stopped: a failed check leaves the running job untouched.
        run(
            p.preflight,
            job,
            deploy=deploy,
            min_free_gib=min_free_gib,
            allow_shared_gpus=allow_shared_gpus,
            import_torch=import_torch,
        )
        run(s.stop_session, job, grace_s=grace)
        ended = run(s.kill_gpu_processes, job)
        run(s.wait_gpu_free, job, ended, timeout_s=gpu_free_timeout)
        if purge:  # a cache dir without the launcher's marker is left alone, never deleted
            run(s.purge_cache, job, if_unmarked="skip")
        else:
            run.skip(s.purge_cache, "--no-purge")
        if deploy:
            run(s.deploy, job)
        else:
            run.skip(s.deploy, "--no-deploy")
        launched = run(s.launch, job, resume=resume)
        run(s.wait_first_step, job, launched, timeout_s=timeout)
    return run.result()


def stop(
    target: Target,
    *,
    grace: float = GRACE_S,
    gpu_free_timeout: float = GPU_FREE_S,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult | NothingToDo:
    """Record the operator's stop (`stopping`, before any signal), stop the job's tmux session,
    record it `stopped` (health then reports the job as OK and never relaunches it; only a relaunch
    clears it), end its leftover GPU processes and wait for them to leave its GPUs."""
    from dflash_ops.act import steps as s
    from dflash_ops.act.grace import check_grace

    check_grace(target.job, grace)  # the step checks it too; here it is refused before anything connects
    if target.transport == "pct" and not dry_run and not _container_running(target):
        why = f"stop: container {target.ctid} is not running, so neither is the job; nothing to stop"
        return NothingToDo(target.name, why)
    job = target.job
    plan = (s.stop_session, s.mark_stopped, s.kill_gpu_processes, s.wait_gpu_free)
    with _running(target, "stop", plan, dry_run, on_progress) as run:
        run(s.stop_session, job, grace_s=grace, record_stop=True)
        run(s.mark_stopped, job)
        ended = run(s.kill_gpu_processes, job)
        run(s.wait_gpu_free, job, ended, timeout_s=gpu_free_timeout)
    return run.result()


def gpu_clean(
    target: Target,
    *,
    force: bool = False,
    gpu_free_timeout: float = GPU_FREE_S,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult:
    """End every process of the job on its GPUs and wait for them to leave; refuses while the job
    runs unless `force`. Processes that are not the job's are reported, never signalled."""
    from dflash_ops.act import preflight as p, steps as s

    job = target.job
    plan = (p.require_job_stopped, s.kill_gpu_processes, s.wait_gpu_free)
    with _running(target, "gpu-clean", plan, dry_run, on_progress) as run:
        if force:
            run.skip(p.require_job_stopped, "--force")
        else:
            run(p.require_job_stopped, job)
        ended = run(s.kill_gpu_processes, job)
        run(s.wait_gpu_free, job, ended, timeout_s=gpu_free_timeout)
    return run.result()


def purge_cache(target: Target, *, dry_run: bool = False, on_progress: OnProgress | None = None) -> RunResult:
    """Remove the job's compile cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR under it): only a
    dir holding the launcher's marker, and never while the job runs."""
    from dflash_ops.act import steps as s

    with _running(target, "purge-cache", (s.purge_cache,), dry_run, on_progress) as run:
        run(s.purge_cache, target.job)
    return run.result()


def deploy(target: Target, *, dry_run: bool = False, on_progress: OnProgress | None = None) -> RunResult:
    """Deploy the trainer as a versioned release and switch `current` to it atomically."""
    from dflash_ops.act import steps as s

    with _running(target, "deploy", (s.deploy,), dry_run, on_progress) as run:
        run(s.deploy, target.job)
    return run.result()


def rollback(
    target: Target,
    *,
    release: str | None = None,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult:
    """Point `current` at a kept release, by default the one deployed before the current one."""
    from dflash_ops.act import steps as s

    with _running(target, "rollback", (s.rollback,), dry_run, on_progress) as run:
        run(s.rollback, target.job, release=release)
    return run.result()


def run_playbook(
    target: Target,
    book: Playbook,
    options: dict[str, Any],
    *,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult:
    """Run a user's playbook (playbook.user.load) with its bound options (bind_options)."""
    from dflash_ops.act import library
    from dflash_ops.playbook.user import run_playbook

    with acting_on(target, book.name, dry_run) as ctx:
        return run_playbook(book, library.LIBRARY, ctx, options, on_progress)


@contextlib.contextmanager
def acting_on(
    target: Target, command: str, dry_run: bool, on_locked: Callable[[], None] | None = None
) -> Iterator[StepContext]:
    """Where steps act on `target`: connected, holding the job's lock (JobBusy when another
    command holds it); under dry-run through a transport that reaches nothing, without a lock."""
    from dflash_ops.job import joblock
    from dflash_ops.transport.factory import connect
    from dflash_ops.act.context import StepContext
    from dflash_ops.transport.dry_run import DryRunTransport

    with connect(target) as transport:
        with contextlib.nullcontext() if dry_run else joblock.held(transport, target, command):
            if on_locked is not None:
                on_locked()
            yield StepContext(target, DryRunTransport(transport) if dry_run else transport)


@contextlib.contextmanager
def _running(
    target: Target,
    command: str,
    plan: Sequence[Callable[..., Any]],
    dry_run: bool,
    on_progress: OnProgress | None,
    on_locked: Callable[[], None] | None = None,
) -> Iterator[Run]:
    """A Run of `plan` (the steps `command` calls, in order) on `target`."""
    from dflash_ops.act.runner import Run

    with acting_on(target, command, dry_run, on_locked) as ctx:
        source = f"{__name__}.{command.replace('-', '_')}"
        with Run(command, ctx, [step.__name__ for step in plan], on_progress, source) as run:
            yield run


@dataclasses.dataclass(frozen=True)
class NothingToDo:
    """A command with nothing to act on (reads like a RunResult for the CLI)."""

    target: str
    message: str
    ok = True
    exit_code = 0

    def summary(self) -> str:
        return f"[{self.target}] {self.message}"


def _container_running(target: Target) -> bool:
    """Whether the pct container runs (a container that does not exist is a mistake: raised)."""
    from dflash_ops.errors import ContainerNotRunning
    from dflash_ops.transport.factory import connect

    with connect(target) as transport:
        try:
            transport.run("true", timeout=30, step="stop")
        except ContainerNotRunning as exc:
            if "is not running" not in exc.reason:
                raise
            return False
    return True


@dataclasses.dataclass
class HealthAction:
    attempted: bool
    message: str
    result: RunResult | None = None


def auto_relaunch(target: Target, checked: Checked) -> HealthAction | None:
    """Relaunch a CRITICAL target, at most max_relaunches_per_hour, never twice at once."""
    return relaunch_when_critical(
        checked.verdict.level,
        target.name,
        target.job.health.max_relaunches_per_hour,
        lambda on_locked: relaunch(target, on_locked=on_locked),
    )


def relaunch_when_critical(
    level: str,
    guard_name: str,
    per_hour: int,
    relaunch_job: Callable[[Callable[[], None]], RunResult],
    done: str = "auto-relaunch",
) -> HealthAction | None:
    """The auto-relaunch rule, one for every job (a target, a multinode job): only a CRITICAL verdict,
    at most `per_hour` attempts an hour under the guard named `guard_name`, never two at once; an
    attempt counts once it holds the job's lock (`relaunch_job(on_locked)` calls it then)."""
    from dflash_ops.errors import DflashOpsError, JobBusy
    from dflash_ops.job.relaunch_guard import RelaunchGuard

    if level != "CRITICAL":
        return None
    guard = RelaunchGuard(guard_name, per_hour)
    with guard.hold() as allowed:
        if allowed is not True:
            return HealthAction(False, f"auto-relaunch skipped: {allowed}")
        try:
            result = relaunch_job(guard.record)
        except JobBusy as exc:
            return HealthAction(False, f"auto-relaunch skipped: {exc.reason}")
        except DflashOpsError as exc:
            return HealthAction(True, f"auto-relaunch FAILED: {str(exc).splitlines()[0]}")
    outcome = "succeeded" if result.ok else "FAILED: " + result.summary()
    return HealthAction(True, f"{done} {outcome}", result)
