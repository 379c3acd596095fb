"""How dflash-ops speaks torchrun: a `launcher: torchrun` job's launch line, and which rank died.

One host: `--standalone` (a private rendezvous, so two jobs never collide); several: c10d at
`rdzv_endpoint`. `rank_failure` reads torchrun's "Root Cause" summary, its "failed (exitcode: X)
local_rank: L" line while it shuts down, and the trainer's "dflash-train: rank R of W failed"."""

from __future__ import annotations

import re

from trainer.launchers import TORCHRUN

from dflash_ops.job.model import Job

RUN_MODULE = ("-m", "torch.distributed.run")  # == the `torchrun` script, from the job's own python
_TRAINER_LINE = re.compile(r"dflash-train: rank (?P<rank>\d+) of (?P<world>\d+) failed(?P<why>.*)")
_AGENT_LINE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\)"
)
_ROOT_CAUSE = "Root Cause (first observed failure)"
_RANK_FIELD = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)")
_EXIT_FIELD = re.compile(
    r"^\s*exitcode\s*:\s*(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)(?:\s*\((?P<sig>SIG\w+)\))?"
)
_TORCHRUN_OWN_ERRORS = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "torch.distributed.elastic.multiprocessing.api.SignalException",
)


def launcher_argv(job: Job) -> list[str]:
    """`python -m torch.distributed.run ...` up to (not including) `-m trainer`."""
    argv = [job.python, *RUN_MODULE]
    if job.nnodes == 1:
        argv += ["--standalone"]
    else:
        argv += ["--nnodes", str(job.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", job.rdzv_endpoint]
        rdzv_id = getattr(job, "rdzv_id", "")  # a multinode job's launch (multinode_inventory.NodeJob)
        if rdzv_id:
            argv += ["--rdzv-id", rdzv_id]
    return argv + ["--nproc-per-node", str(job.nproc_per_node)]


def launch_line(job: Job, trainer: list[str]) -> list[str]:
    """One rank's launch line under torchrun; each rank picks cuda:LOCAL_RANK of CUDA_VISIBLE_DEVICES."""
    module, rest = trainer[1:3], trainer[3:]  # [python] [-m trainer] [its arguments... train_args]
    kept = rest[: len(rest) - len(job.train_args)]
    for flag in ("--target-devices", "--drafter-devices"):
        if flag in kept:
            at = kept.index(flag)
            del kept[at : at + 2]
    devices = ["--target-devices", "cuda", "--drafter-devices", "cuda"] if job.drafter_gpus else []
    return launcher_argv(job) + module + kept + ["--launcher", TORCHRUN] + devices + list(job.train_args)


def env(job: Job) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, job.drafter_gpus))} if job.drafter_gpus else {}


def rank_failure(lines: list[str]) -> tuple[str | None, list[int]]:
    """(which rank died and how, or None; the 0-based line numbers this explains, tracebacks included)."""
    own = {}
    used = []
    for i, line in enumerate(lines):
        match = _TRAINER_LINE.search(line)
        if match:
            own[int(match["rank"])] = match["why"].lstrip(": ").strip()
            used.append(i)
        if line.startswith(_TORCHRUN_OWN_ERRORS):
            used.append(i)
    root = _root_cause(lines)
    if root is not None:
        rank, text, at = root
        why = own.get(rank)
        return text + (f"; it reported: {why}" if why else ""), used + at
    for i in range(len(lines) - 1, -1, -1):
        match = _AGENT_LINE.search(lines[i])
        if match:
            return (
                f"local rank {match['local']} (pid {match['pid']}) exited with code {match['code']}; "
                f"torchrun is ending the other ranks"
            ), used + [i]
    if own:
        rank = min(own)
        return f"rank {rank} failed: {own[rank]}", used
    return None, used


def _root_cause(lines: list[str]):
    starts = [i for i, line in enumerate(lines) if _ROOT_CAUSE in line]
    if not starts:
        return None
    rank = local = code = pid = sig = None
    at = [starts[-1]]
    for i in range(starts[-1] + 1, min(len(lines), starts[-1] + 12)):
        if rank is None and (m := _RANK_FIELD.match(lines[i])):
            rank, local = int(m["rank"]), m["local"]
            at.append(i)
        elif code is None and (m := _EXIT_FIELD.match(lines[i])):
            code, pid, sig = m["code"], m["pid"], m["sig"]
            at.append(i)
    if rank is None or code is None:
        return None
    signal = f" ({sig})" if sig else ""
    text = (
        f"rank {rank} (local rank {local}, pid {pid}) exited with code {code}{signal}, "
        "the first failure torchrun saw; it ended the other ranks"
    )
    return rank, text, at
