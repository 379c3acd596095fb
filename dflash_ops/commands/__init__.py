"""The commands that act on a job, as plain Python over its nodes; their keyword defaults are the
CLI's. Steps are imported when a command runs, so `dflash-ops --help` stays light."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dflash_ops.job.model import Target
    from dflash_ops.act.nodes import Node, Nodes
    from dflash_ops.act.runner import OnProgress, Run, RunResult
    from dflash_ops.observe.job_check import JobChecked
    from dflash_ops.playbook.user import Playbook

# Options several commands share.
GRACE_S = 30.0  # between the polite stop signal (the trainer checkpoints) and the kill
GPU_FREE_S = 120.0  # the longest wait for the job's GPUs to be free


def default_of(command: Callable[..., Any], option: str) -> Any:
    """The default of `command`'s keyword argument `option`, for --help."""
    return inspect.signature(command).parameters[option].default


def relaunch_plan(nodes: int) -> list[str]:
    from dflash_ops.act import phases as ph

    free, checks = ph.free_gpus_plan(nodes), ph.checks_plan(nodes)
    return [*checks, "stop_session", *free, "purge_cache", "deploy", "launch", "wait_first_step"]


def stop_plan(nodes: int) -> list[str]:
    from dflash_ops.act import phases as ph

    return ["stop_session", "mark_stopped", *ph.free_gpus_plan(nodes)]


def relaunch(
    job: Nodes,
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
    """Check every node, stop, free GPUs, purge (`purge`), deploy (`deploy`), launch and wait `timeout`
    for the first step; `on_locked` runs once every lock is ours."""
    from dflash_ops.act import phases as ph, steps as s
    from dflash_ops.act.nodes import on_nodes

    _check_grace(job, grace)
    plan = relaunch_plan(len(job.node_targets()))
    with _running(job, "relaunch", plan, dry_run, on_progress, on_locked) as (run, nodes):
        # Before anything is stopped: a failed check leaves the running job untouched.
        ph.check_before_stop(
            run,
            job,
            nodes,
            deploy=deploy,
            min_free_gib=min_free_gib,
            allow_shared_gpus=allow_shared_gpus,
            import_torch=import_torch,
        )
        on_nodes(run, s.stop_session, nodes, grace_s=grace)
        ph.free_job_gpus(run, nodes, timeout_s=gpu_free_timeout)
        if purge:  # a cache dir without the launcher's marker is left alone, never deleted
            on_nodes(run, s.purge_cache, nodes, if_unmarked="skip")
        else:
            run.skip(s.purge_cache, "--no-purge")
        if deploy:
            run(ph.deploy)
        else:
            run.skip(ph.deploy, "--no-deploy")
        launched = run(ph.launch, job, resume=resume, grace_s=grace)
        run(ph.wait_first_step, launched, timeout_s=timeout, grace_s=grace)
    return run.result()


def stop(
    job: Nodes,
    *,
    grace: float = GRACE_S,
    gpu_free_timeout: float = GPU_FREE_S,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult | NothingToDo:
    """Record `stopping`, stop the session, record `stopped` (health never relaunches it), free its GPUs;
    a failing node does not hold up the others."""
    from dflash_ops.act import phases as ph, steps as s
    from dflash_ops.act.nodes import on_nodes

    _check_grace(job, grace)
    targets = job.node_targets()
    if not dry_run and all(t.transport == "pct" and not _container_running(t) for t in targets):
        why = f"stop: container {targets[0].ctid} is not running, so neither is the job; nothing to stop"
        return NothingToDo(job.name, why)
    with _running(job, "stop", stop_plan(len(targets)), dry_run, on_progress) as (run, nodes):
        ended = on_nodes(run, s.stop_session, nodes, grace_s=grace, record_stop=True, keep_going=True)
        recorded = on_nodes(run, s.mark_stopped, [n for n, _ in ended], keep_going=True)
        ph.free_job_gpus(run, [n for n, _ in recorded], timeout_s=gpu_free_timeout, keep_going=True)
    return run.result()


def _check_grace(job: Nodes, grace: float) -> None:
    """--grace checked against every node's trainer before anything connects."""
    from dflash_ops.act.grace import check_grace

    for target in job.node_targets():
        check_grace(target.job, grace)


def gpu_clean(
    job: Nodes,
    *,
    force: bool = False,
    gpu_free_timeout: float = GPU_FREE_S,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult:
    """End the job's processes on its GPUs (refused while it runs unless `force`); never foreign ones."""
    from dflash_ops.act import phases as ph, preflight as p
    from dflash_ops.act.nodes import on_nodes

    plan = ["require_job_stopped", *ph.free_gpus_plan(len(job.node_targets()))]
    with _running(job, "gpu-clean", plan, dry_run, on_progress) as (run, nodes):
        if force:
            run.skip(p.require_job_stopped, "--force")
        else:
            on_nodes(run, p.require_job_stopped, nodes)
        ph.free_job_gpus(run, nodes, timeout_s=gpu_free_timeout)
    return run.result()


def purge_cache(job: Nodes, *, dry_run: bool = False, on_progress: OnProgress | None = None) -> RunResult:
    """Remove the job's compile cache: only a dir with the launcher's marker, never while the job runs."""
    from dflash_ops.act import steps as s
    from dflash_ops.act.nodes import on_nodes

    with _running(job, "purge-cache", ["purge_cache"], dry_run, on_progress) as (run, nodes):
        on_nodes(run, s.purge_cache, nodes)
    return run.result()


def deploy(job: Nodes, *, dry_run: bool = False, on_progress: OnProgress | None = None) -> RunResult:
    """Deploy the trainer as a versioned release and switch `current` to it atomically."""
    from dflash_ops.act import phases as ph

    with _running(job, "deploy", ["deploy"], dry_run, on_progress) as (run, _):
        run(ph.deploy)
    return run.result()


def rollback(
    job: Nodes, *, release: str | None = None, dry_run: bool = False, on_progress: OnProgress | None = None
) -> RunResult:
    """Point `current` at a kept release, by default the one deployed before the current one."""
    from dflash_ops.act import steps as s
    from dflash_ops.act.nodes import on_nodes

    with _running(job, "rollback", ["rollback"], dry_run, on_progress) as (run, nodes):
        on_nodes(run, s.rollback, nodes, release=release)
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
    from dflash_ops.act.nodes import acting_on
    from dflash_ops.playbook.user import run_playbook

    with acting_on(target, book.name, dry_run) as ctx:
        return run_playbook(book, library.LIBRARY, ctx, options, on_progress)


def _running(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[tuple[Run, list[Node]]]:
    from dflash_ops.act.nodes import running

    return running(*args, **kwargs)


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


def auto_relaunch(job: Nodes, checked: JobChecked) -> HealthAction | None:
    """The auto-relaunch rule: relaunch a CRITICAL job within its hourly budget, never two at once;
    checks run on every node first, so a node that cannot take part relaunches nothing."""
    from dflash_ops.errors import DflashOpsError, JobBusy
    from dflash_ops.job.relaunch_guard import RelaunchGuard

    if checked.verdict.level != "CRITICAL":
        return None
    targets = job.node_targets()
    guard = RelaunchGuard(job.name, targets[0].job.health.max_relaunches_per_hour)
    with guard.hold() as allowed:
        if allowed is not True:
            return HealthAction(False, f"auto-relaunch skipped: {allowed}")
        try:
            result = relaunch(job, on_locked=guard.record)
        except JobBusy as exc:
            return HealthAction(False, f"auto-relaunch skipped: {exc.reason}")
        except DflashOpsError as exc:
            return HealthAction(True, f"auto-relaunch FAILED: {str(exc).splitlines()[0]}")
    done = "auto-relaunch" if len(targets) == 1 else "auto-relaunch of every node"
    outcome = "succeeded" if result.ok else "FAILED: " + result.summary()
    return HealthAction(True, f"{done} {outcome}", result)
