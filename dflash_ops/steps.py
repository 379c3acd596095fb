"""The step library behind playbooks/: stop, clean GPUs, wait, purge, deploy, launch, confirm.

Each step is a small function of a StepContext; every remote command goes through `ctx.run`, which
records its exact command line (that is what --dry-run prints) and runs nothing under dry-run.
"""
from __future__ import annotations

import dataclasses
import json
import posixpath
import shlex
import time

from . import deploy as deploy_lib
from . import jobpaths, launch as launch_lib, tmux
from .errors import StepFailed
from .gpu import HOST_GPU_QUERY, busy_gpus, parse_host_gpu_query, parse_nvidia_smi
from .model import Job
from .playbook import StepContext, StepOutcome, StepRegistry
from .remote import python_stdin_command, script_source

registry = StepRegistry()

_JOBPROCS = "jobprocs.py"
_JOBPROCS_SOURCE = script_source(_JOBPROCS).encode()
GPU_QUERY = ("nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu "
             "--format=csv,noheader,nounits && echo @@ && "
             "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader,nounits")


def _fail(ctx: StepContext, why: str) -> StepFailed:
    return StepFailed(f"[{ctx.target_name}] {ctx.step}: {why}")


def _host_ctid(ctx: StepContext) -> int | None:
    return ctx.target.gpu_host_ctid if ctx.target is not None else None


def _gpu_snapshot(ctx: StepContext):
    """The GPUs as nvidia-smi sees them: on the Proxmox host (pids mapped to this container, others
    labelled) when the inventory says so, else where the job runs. None under dry-run."""
    ctid = _host_ctid(ctx)
    if ctid is not None:
        result = ctx.run_on_host(HOST_GPU_QUERY, timeout=60, check=False)
    else:
        result = ctx.run(GPU_QUERY, timeout=60, check=False)
    if result is None:
        return None
    if not result.ok:
        raise _fail(ctx, "nvidia-smi failed: " + (result.stdout + result.stderr).strip()[-500:])
    return parse_host_gpu_query(result.stdout, ctid) if ctid is not None else parse_gpu_query(result.stdout)


# ------------------------------------------------------------------ the job's processes

def _end_job_processes(ctx: StepContext, job: Job, gpus: list[int], grace_s: float,
                       include_session: bool) -> StepOutcome:
    args = {"marker_env": jobpaths.JOB_MARKER_ENV, "marker": jobpaths.marker_value(job),
            "socket": job.tmux_socket, "session": job.session, "gpus": list(gpus),
            "action": "kill", "grace_s": grace_s, "include_session": include_session}
    if gpus and _host_ctid(ctx) is not None:
        # Inside LXC nvidia-smi shows host pids; hand the script the host's mapped view instead.
        snapshot = _gpu_snapshot(ctx)
        if snapshot is not None:
            args["gpu_apps"] = [[p.pid, g.index, p.used_memory_mib, p.owner] for g in snapshot.gpus
                                if g.index in gpus for p in g.processes]
    result = ctx.run(python_stdin_command(job.python, _JOBPROCS, args), timeout=grace_s + 60, stdin=_JOBPROCS_SOURCE)
    if result is None:
        return StepOutcome("would SIGTERM this job's processes, SIGKILL after "
                           f"{grace_s:g}s; other processes are only reported")
    report = json.loads(result.stdout)
    if report["survivors"]:
        raise _fail(ctx, f"processes survived SIGKILL: {report['survivors']}")
    if report["job"]:
        message = (f"ended {len(report['job'])} process(es): {len(report['terminated'])} on SIGTERM, "
                   f"{len(report['killed'])} needed SIGKILL")
    else:
        message = "no job processes running"
    others = [f"pid {o['pid']} on GPU {o['gpu']} ({o.get('used_memory_mib')} MiB, "
              + (f"{o['owner']}, host pid" if o.get("owner") else
                 o["cmd"][:60] if o.get("cmd") else _invisible_pid(ctx)) + ")"
              for o in report["unidentified"]]
    if others:
        message += "; left alone (not this job's): " + "; ".join(others)
    return StepOutcome(message, data=report)


def _invisible_pid(ctx: StepContext) -> str:
    """What a GPU pid without a /proc entry means: inside LXC the driver reports HOST pids; on a
    plain host the process has exited since nvidia-smi listed it."""
    in_container = getattr(ctx.target, "transport", None) == "pct"
    return "not visible here: a host pid?" if in_container else "exited, no longer in /proc"


@registry.step("stop_session", params={"session": str, "grace_s": (float, 30.0)})
def stop_session(ctx: StepContext, session: str, grace_s: float) -> StepOutcome:
    """SIGTERM the session's process tree (the trainer checkpoints and exits), SIGKILL after
    grace_s, then remove the tmux session."""
    job = dataclasses.replace(ctx.job, session=session)
    outcome = _end_job_processes(ctx, job, list(job.gpus), grace_s, include_session=True)
    ctx.run(tmux.kill_session(job) + " || true", timeout=30)
    still = ctx.run(tmux.has_session(job), timeout=30, check=False)
    if still is not None and still.ok:
        raise _fail(ctx, f"session {session!r} is still there after kill-session")
    return outcome


@registry.step("kill_gpu_processes", params={"gpus": list[int], "grace_s": (float, 10.0)})
def kill_gpu_processes(ctx: StepContext, gpus: list[int], grace_s: float) -> StepOutcome:
    """End leftovers of earlier launches (they carry the launcher's marker). GPU processes that are
    not this job's are reported, never signalled."""
    return _end_job_processes(ctx, ctx.job, gpus, grace_s, include_session=False)


# ------------------------------------------------------------------ GPUs

def parse_gpu_query(stdout: str):
    gpu_csv, _, apps_csv = stdout.partition("@@")
    return parse_nvidia_smi(gpu_csv, apps_csv)


@registry.step("wait_gpu_free", params={"gpus": list[int], "timeout_s": (float, 120.0),
                                         "max_used_mib": (int, 1024), "poll_s": (float, 2.0)})
def wait_gpu_free(ctx: StepContext, gpus: list[int], timeout_s: float, max_used_mib: int,
                  poll_s: float) -> StepOutcome:
    """Wait until the GPUs hold no process and at most max_used_mib; name what still holds them."""
    if not gpus:
        return StepOutcome("no GPUs assigned to this job")
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = _gpu_snapshot(ctx)
        if snapshot is None:
            return StepOutcome(f"would wait up to {timeout_s:g}s for GPUs {gpus}")
        holders = [b.describe() for b in busy_gpus(snapshot, gpus, max_used_mib=max_used_mib)]
        if not holders:
            return StepOutcome(f"GPUs {','.join(map(str, gpus))} free")
        if time.monotonic() > deadline:
            raise _fail(ctx, f"still busy after {timeout_s:g}s: " + "; ".join(holders))
        ctx.commands.clear()  # one poll is enough to show
        time.sleep(poll_s)


# ------------------------------------------------------------------ cache, deploy, launch

def _check_purgeable(ctx: StepContext, path: str) -> None:
    norm = posixpath.normpath(path)
    protected = {posixpath.normpath(p) for p in (ctx.job.workdir, "/root", "/home", "/tmp", "/var", "/usr")}
    if not posixpath.isabs(norm) or norm.count("/") < 2 or norm in protected:
        raise _fail(ctx, f"refusing to purge {path!r}: give a dedicated cache dir "
                         "(absolute, at least two levels deep, not the workdir)")


@registry.step("purge_cache", params={"paths": list[str]})
def purge_cache(ctx: StepContext, paths: list[str]) -> StepOutcome:
    """Remove exactly these compile-cache dirs; refuses while the job's session runs."""
    for path in paths:
        _check_purgeable(ctx, path)
    running = ctx.run(tmux.has_session(ctx.job), timeout=30, check=False)
    if running is not None and running.ok:
        raise _fail(ctx, f"session {ctx.job.session!r} is running; stop the job first (dflash-ops stop)")
    ctx.run("rm -rf -- " + " ".join(shlex.quote(p) for p in paths), timeout=300)
    return StepOutcome(("would purge " if ctx.dry_run else "purged ") + ", ".join(paths))


@registry.step("deploy", params={"keep_releases": (int, 5)})
def deploy(ctx: StepContext, keep_releases: int) -> StepOutcome:
    """Upload the bundled trainer as a versioned release and switch `current` to it."""
    bundle = deploy_lib.build_bundle()
    tarball = posixpath.join(jobpaths.releases_dir(ctx.job), bundle.release_id + ".tar.gz")
    ctx.run(f"mkdir -p {shlex.quote(jobpaths.releases_dir(ctx.job))}", timeout=30)
    ctx.put(bundle.data, tarball)
    ctx.run(deploy_lib.install_script(ctx.job, bundle, tarball, keep_releases), timeout=120)
    return StepOutcome(f"release {bundle.release_id} is current", data={"release": bundle.release_id})


@registry.step("launch", params={"session": str, "cache_dir": str})
def launch(ctx: StepContext, session: str, cache_dir: str) -> StepOutcome:
    """Start the trainer in a detached tmux session writing the next numbered log."""
    job = dataclasses.replace(ctx.job, session=session, cache_dir=cache_dir)
    result = ctx.run(launch_lib.launch_script(job, resume=bool(ctx.options.get("resume", True))), timeout=60)
    if result is None:
        return StepOutcome(f"would start tmux session {session!r} running: "
                           f"{shlex.join(launch_lib.trainer_argv(job))}")
    log = result.stdout.strip().splitlines()[-1]
    return StepOutcome(f"session {session!r} started, log {log}", data={"log": log})


# ------------------------------------------------------------------ confirmation

def _watch_script(job: Job, log: str) -> str:
    from trainer.metrics_format import metrics_path_for_log

    return (f"{tmux.pane_pids(job)}; echo @@; tail -n 50 {shlex.quote(metrics_path_for_log(log))} 2>/dev/null; "
            f"echo @@; tail -n 1 {shlex.quote(log)} 2>/dev/null; true")


@registry.step("wait_first_step", params={"timeout_s": (float, 900.0), "poll_s": (float, 1.0)})
def wait_first_step(ctx: StepContext, timeout_s: float, poll_s: float) -> StepOutcome:
    """Wait until the metrics file shows a training step; on failure print the last log lines and
    the failure signature."""
    from trainer.metrics_format import last_of, parse_lines

    from .logs import find_failures

    log = ctx.results.get("launch", {}).get("log") or "<log of the launch step>"
    started = time.monotonic()
    deadline = started + timeout_s
    why = f"no training step after {timeout_s:g}s"
    while True:
        result = ctx.run(_watch_script(ctx.job, log), timeout=60, check=False)
        if result is None:
            return StepOutcome(f"would wait up to {timeout_s:g}s for the first step in the metrics file")
        panes, _, rest = result.stdout.partition("@@")
        metrics, _, last_line = rest.partition("@@")
        records = parse_lines(metrics)
        step = last_of(records, "step")
        if step is not None:
            rate = (step.get("tokens_per_s") or 0) / 1000
            return StepOutcome(f"step {step['step']}: loss {step.get('loss', float('nan')):.4f}, "
                               f"{rate:.1f} Ktok/s", data={"step": step})
        error = last_of(records, "error")
        pane = panes.split()
        if error is not None:
            why = f"the trainer reported {error.get('kind', 'an error')}: {error.get('message', '')}"
            break
        if not pane:
            why = "the tmux session is gone"
            break
        if len(pane) >= 2 and pane[1] == "1":
            why = "the trainer exited" + (f" with code {pane[2]}" if len(pane) >= 3 else "")
            break
        if time.monotonic() > deadline:
            break
        ctx.status(f"waiting for the first step: {time.monotonic() - started:.0f} s of {timeout_s:g} s; "
                   f"log: {' '.join(last_line.split())[:160] or '(empty)'}")
        ctx.commands.clear()
        time.sleep(poll_s)
    tail = ctx.run(f"tail -n 400 {shlex.quote(log)}", timeout=30, check=False).stdout
    failures = find_failures(tail)
    signature = f" (signature: {failures[0].name})" if failures else ""
    last = "\n    ".join(tail.rstrip().splitlines()[-30:])
    raise _fail(ctx, f"{why}{signature}\n  last lines of {log}:\n    {last}")


@registry.step("rollback", params={"release": (str, deploy_lib.PREVIOUS)})
def rollback(ctx: StepContext, release: str) -> StepOutcome:
    """Point `current` at a kept release, or (`previous`) at the one deployed before it."""
    named = None if release == deploy_lib.PREVIOUS else release
    result = ctx.run(deploy_lib.rollback_script(ctx.job, named), timeout=60)
    return StepOutcome(result.stdout.strip() if result else
                       f"would switch `current` to {named or 'the previous release'}")
