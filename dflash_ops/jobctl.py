"""What a relaunch is made of: stop, clean GPUs, wait, purge, launch, confirm. One function each.

Every function takes a transport and a Job, returns a StepReport (message + the exact remote
commands), and with dry_run=True only reports those commands. Failures raise dflash_ops errors.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import posixpath
import shlex
import time

from . import jobpaths, launch, tmux
from .errors import DflashOpsError, RemoteCommandError
from .model import Job
from .remote_python import python_command

_JOBPROCS_SOURCE = (pathlib.Path(__file__).parent / "remote_jobprocs.py").read_text()
GPU_QUERY = ("nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu "
             "--format=csv,noheader,nounits && echo @@ && "
             "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits")


@dataclasses.dataclass
class StepReport:
    message: str
    commands: list[str] = dataclasses.field(default_factory=list)
    data: dict = dataclasses.field(default_factory=dict)


class StepFailed(DflashOpsError):
    """A step ran and found the job in a state it cannot proceed from (message says why)."""


def _jobprocs_command(job: Job, action: str, include_session: bool, grace_s: float) -> str:
    args = {"marker_env": jobpaths.JOB_MARKER_ENV, "marker": jobpaths.marker_value(job),
            "socket": job.tmux_socket, "session": job.session, "gpus": list(job.gpus),
            "action": action, "grace_s": grace_s, "include_session": include_session}
    return python_command(job, _JOBPROCS_SOURCE, args)


def _describe_procs(procs: list[dict]) -> str:
    return ", ".join(f"{p['pid']} ({p['cmd'][:60] or '?'})" for p in procs)


def _unidentified_note(report: dict) -> str:
    others = report.get("unidentified", [])
    if not others:
        return ""
    parts = [f"pid {o['pid']} on GPU {o['gpu']} ({o.get('used_memory_mib')} MiB"
             + (f", {o['cmd'][:60]}" if o.get("cmd") else ", not visible here: a host pid?") + ")" for o in others]
    return "; left alone (not this job's): " + "; ".join(parts)


def end_job_processes(transport, job: Job, grace_s: float, include_session: bool, step: str,
                      dry_run: bool = False) -> StepReport:
    cmd = _jobprocs_command(job, "kill", include_session, grace_s)
    if dry_run:
        return StepReport("would end this job's processes", [cmd])
    result = transport.check(cmd, timeout=grace_s + 60, step=step)
    report = json.loads(result.stdout)
    if report["survivors"]:
        raise StepFailed(f"[{transport.name}] {step}: processes survived SIGKILL: {report['survivors']}")
    if not report["job"]:
        msg = "no job processes running"
    else:
        msg = (f"ended {len(report['job'])} process(es): {len(report['terminated'])} on SIGTERM, "
               f"{len(report['killed'])} needed SIGKILL")
    return StepReport(msg + _unidentified_note(report), [cmd], report)


def stop_session(transport, job: Job, grace_s: float = 60, dry_run: bool = False) -> StepReport:
    """SIGTERM the session's process tree (the trainer checkpoints and exits), SIGKILL after the
    grace period, then remove the session."""
    report = end_job_processes(transport, job, grace_s, True, "stop_session", dry_run)
    kill = tmux.kill_session(job) + " || true"
    report.commands.append(kill)
    if not dry_run:
        transport.check(kill, timeout=30, step="stop_session")
        if transport.run(tmux.has_session(job), timeout=30, step="stop_session").ok:
            raise StepFailed(f"[{transport.name}] stop_session: session {job.session!r} is still there after kill-session")
    return report


def kill_gpu_processes(transport, job: Job, grace_s: float = 10, dry_run: bool = False) -> StepReport:
    """Leftovers of earlier launches (they carry the launcher's marker); others are only reported."""
    return end_job_processes(transport, job, grace_s, False, "kill_gpu_processes", dry_run)


def parse_gpu_query(stdout: str):
    from .gpu import parse_nvidia_smi

    gpu_csv, _, apps_csv = stdout.partition("@@")
    return parse_nvidia_smi(gpu_csv, apps_csv)


def gpu_holders(snapshot, gpus, max_used_mib: float) -> list[str]:
    """Why each of `gpus` is not free yet: its processes, or memory held with no process (ghost)."""
    holders = []
    by_index = {g.index: g for g in snapshot.gpus}
    for index in gpus:
        gpu = by_index.get(index)
        if gpu is None:
            holders.append(f"GPU {index}: not present (nvidia-smi shows {sorted(by_index)})")
        elif gpu.processes:
            holders.append(f"GPU {index}: " + ", ".join(f"pid {p.pid} ({p.used_memory_mib} MiB)" for p in gpu.processes))
        elif gpu.memory_used_mib is not None and gpu.memory_used_mib > max_used_mib:
            holders.append(f"GPU {index}: {gpu.memory_used_mib} MiB used with no process listed (ghost memory: "
                           "a process in another container, or a dying context)")
    return holders


def wait_gpu_free(transport, job: Job, timeout_s: float = 120, max_used_mib: float = 1024,
                  poll_s: float = 2.0, dry_run: bool = False) -> StepReport:
    if not job.gpus:
        return StepReport("no GPUs assigned to this job")
    if dry_run:
        return StepReport(f"would wait up to {timeout_s:g}s for GPUs {list(job.gpus)}", [GPU_QUERY])
    deadline = time.monotonic() + timeout_s
    while True:
        result = transport.run(GPU_QUERY, timeout=60, step="wait_gpu_free")
        if not result.ok:
            raise RemoteCommandError(transport.name, "wait_gpu_free: nvidia-smi", result)
        holders = gpu_holders(parse_gpu_query(result.stdout), job.gpus, max_used_mib)
        if not holders:
            return StepReport(f"GPUs {','.join(map(str, job.gpus))} free", [GPU_QUERY])
        if time.monotonic() > deadline:
            raise StepFailed(f"[{transport.name}] wait_gpu_free: still busy after {timeout_s:g}s: " + "; ".join(holders))
        time.sleep(poll_s)


def _safe_cache_paths(job: Job) -> list[str]:
    paths = [jobpaths.inductor_cache(job), jobpaths.triton_cache(job)]
    for p in paths:
        norm = posixpath.normpath(p)
        if not posixpath.isabs(norm) or norm.count("/") < 2:
            raise StepFailed(f"refusing to purge {p!r}: cache paths must be absolute and at least two levels deep")
    return paths


def purge_cache(transport, job: Job, dry_run: bool = False) -> StepReport:
    """Remove exactly the job's inductor and triton cache dirs; refuses while the job runs."""
    paths = _safe_cache_paths(job)
    rm = "rm -rf -- " + " ".join(shlex.quote(p) for p in paths)
    if dry_run:
        return StepReport("would purge " + ", ".join(paths), [tmux.has_session(job), rm])
    if transport.run(tmux.has_session(job), timeout=30, step="purge_cache").ok:
        raise StepFailed(f"[{transport.name}] purge_cache: session {job.session!r} is running; "
                         "stop the job first (dflash-ops stop)")
    transport.check(rm, timeout=300, step="purge_cache")
    return StepReport("purged " + ", ".join(paths), [rm])


def launch_job(transport, job: Job, resume: bool = True, dry_run: bool = False) -> StepReport:
    script = launch.launch_script(job, resume)
    if dry_run:
        return StepReport(f"would start tmux session {job.session!r}", [script])
    log = transport.check(script, timeout=60, step="launch").stdout.strip().splitlines()[-1]
    return StepReport(f"session {job.session!r} started, log {log}", [script], {"log": log})


def _watch_script(job: Job, log: str) -> str:
    metrics = log[:-4] + ".metrics.jsonl" if log.endswith(".log") else log + ".metrics.jsonl"
    return (tmux.pane_pids(job) + "; echo @@; tail -n 50 " + shlex.quote(metrics) + " 2>/dev/null; true")


def log_tail(transport, log: str, lines: int = 30) -> str:
    result = transport.run(f"tail -n {int(lines)} {shlex.quote(log)}", timeout=30, step="read log")
    return result.stdout


def wait_first_step(transport, job: Job, log: str = "", timeout_s: float = 600, poll_s: float = 2.0,
                    dry_run: bool = False) -> StepReport:
    """Until the metrics file shows a training step; on failure: last log lines + the signature."""
    from trainer.metrics_format import last_of, parse_lines

    from .logs import find_failures

    if dry_run:
        return StepReport(f"would wait up to {timeout_s:g}s for the first training step",
                          [_watch_script(job, log or "<new log>")])
    deadline = time.monotonic() + timeout_s
    why = f"no training step after {timeout_s:g}s"
    while True:
        out = transport.run(_watch_script(job, log), timeout=60, step="wait_first_step").stdout
        panes, _, metrics = out.partition("@@")
        records = parse_lines(metrics)
        step = last_of(records, "step")
        if step is not None:
            return StepReport(f"step {step['step']} loss {step.get('loss', float('nan')):.4f} "
                              f"({step.get('tokens_per_s', 0) / 1000:.1f} Ktok/s)", [], {"step": step})
        error = last_of(records, "error")
        pane = panes.split()
        if error is not None:
            why = f"trainer reported {error.get('kind', 'an error')}: {error.get('message', '')}"
            break
        if not pane:
            why = "the tmux session is gone"
            break
        if len(pane) >= 3 and pane[1] == "1":
            why = f"the trainer exited with code {pane[2]}"
            break
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    tail = log_tail(transport, log, 400)  # enough to hold the whole traceback
    failures = find_failures(tail)
    sig = f"; signature: {failures[0].name}" if failures else ""
    raise StepFailed(f"[{transport.name}] wait_first_step: {why}{sig}\n  last lines of {log}:\n    "
                     + "\n    ".join(tail.rstrip().splitlines()[-30:]))
