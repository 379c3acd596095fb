"""What steps and preflight both read on the target: job processes, GPUs, the cache; how a step fails."""

from __future__ import annotations

import json
import shlex

from dflash_ops.act.context import StepContext
from dflash_ops.errors import StepFailed
from dflash_ops.job import cache_guard, jobpaths
from dflash_ops.job.model import Job
from dflash_ops.observe.gpu import HOST_GPU_QUERY, parse_host_gpu_query, parse_nvidia_smi
from dflash_ops.observe.gpu_owners import ownership
from dflash_ops.remote import bundle, facts, python_command

_JOBPROCS = "jobprocs.py"
_JOBPROCS_LISTS = ("job", "unidentified", "exited_panes", "terminated", "killed", "survivors")

GPU_QUERY = f"{shlex.join(facts.gpu_query_argv())} && echo @@ && {shlex.join(facts.apps_query_argv())}"


def _fail(ctx: StepContext, why: str) -> StepFailed:
    return StepFailed(f"[{ctx.target_name}] {ctx.step}: {why}")


def _gpu_snapshot(ctx: StepContext):
    """The GPUs as nvidia-smi sees them, on the Proxmox host when the inventory says so; none in dry-run."""
    ctid = ctx.target.gpu_host_ctid
    if ctid is not None:
        result = ctx.run_on_host(HOST_GPU_QUERY, timeout=60, check=False)
    else:
        result = ctx.run(GPU_QUERY, timeout=60, check=False)
    if not result.ok:
        raise _fail(ctx, "nvidia-smi failed: " + (result.stdout + result.stderr).strip()[-500:])
    if ctid is not None:
        return parse_host_gpu_query(result.stdout, ctid)
    gpu_csv, _, apps_csv = result.stdout.partition("@@")
    return parse_nvidia_smi(gpu_csv, apps_csv)


def job_processes(
    ctx: StepContext, job: Job, gpus: list[int], grace_s: float, include_session: bool, action: str
) -> dict:
    """Run remote/jobprocs.py: the job's processes and foreign ones on its GPUs, ended for "kill"."""
    args = {
        **jobpaths.identity_args(job),
        "gpus": list(gpus),
        "action": action,
        "grace_s": grace_s,
        "include_session": include_session,
    }
    if gpus and ctx.target.gpu_host_ctid is not None:
        # Inside LXC nvidia-smi shows host pids; hand the script the host's mapped view instead.
        args["gpu_apps"] = [
            [p.pid, g.index, p.used_memory_mib, p.owner, p.name]
            for g in _gpu_snapshot(ctx).gpus
            if g.index in gpus
            for p in g.processes
        ]
    script = python_command(job.python, _JOBPROCS, args)
    result = ctx.run(script, timeout=grace_s + 60, stdin=bundle(_JOBPROCS))
    if ctx.dry_run:
        return {key: [] for key in _JOBPROCS_LISTS}
    try:
        report = json.loads(result.stdout)
    except (ValueError, RecursionError):
        report = None
    if not isinstance(report, dict) or not all(isinstance(report.get(k), list) for k in _JOBPROCS_LISTS):
        raise _fail(ctx, f"the process listing gave no readable answer: {result.stdout.strip()[:200]!r}")
    return report


def describe_foreign(others: list[dict], invisible: str = "not visible here") -> str:
    """`pid 812 sleep on GPU 1 (7000 MiB, ct 201, host pid)` per foreign process, never signalled."""
    names = [o.get("name") or (o.get("cmd") or "").split(" ")[0] for o in others]
    return "; ".join(
        f"pid {o['pid']}{' ' + name if name else ''} on GPU {o['gpu']} "
        f"({o.get('used_memory_mib')} MiB, "
        + (o["owner"] + ", host pid" if o.get("owner") else "here" if o.get("visible") else invisible)
        + ")"
        for o, name in zip(others, names, strict=True)
    )


def surely_foreign(others: list[dict]) -> list[dict]:
    """The unidentified processes that gpu_owners.ownership() calls foreign."""
    return [o for o in others if ownership(str(o.get("owner") or ""), bool(o.get("visible")), False)]


def resolve_cache(ctx: StepContext, job: Job, path: str) -> tuple[str | None, str | None]:
    """(the cache path resolved ON THE TARGET, why it may not be a cache or None); symlinks there count."""
    owned = cache_guard.owned_paths(job.workdir, job.log_dir, job.python)
    paths = [path] + [p for p, _, _ in owned]
    result = ctx.run(shlex.join(["realpath", "-m", "-z", "--", *paths]), timeout=30)
    if ctx.dry_run:
        return None, None
    parts = result.stdout.split("\0")
    if len(parts) != len(paths) + 1 or not all(p.startswith("/") for p in parts[:-1]):
        return None, f"realpath on the target gave no answer for {path} ({result.stdout[:100]!r})"
    resolved = parts[0]
    why = cache_guard.problem(
        resolved, [(parts[i + 1], what, inside) for i, (_, what, inside) in enumerate(owned)]
    )
    if why is None:
        return resolved, None
    field = "job.cache_dir" if path == job.cache_dir else "purge_cache path"
    shown = path if resolved == path else f"{path} (on the target: {resolved})"
    return resolved, f"{field} {shown} {why}; give the cache a directory of its own"


def refuse_while_job_lives(ctx: StepContext, job: Job, what: str) -> None:
    """Fail, naming pids, while any process of the job lives (its tree or the launcher's marker)."""
    report = job_processes(ctx, job, [], 0.0, True, "list")
    if report["job"]:
        pids = ", ".join(f"{p['pid']} ({p['cmd'][:40]})" for p in report["job"][:5])
        raise _fail(ctx, f"the job is running (pids {pids}); {what}")
