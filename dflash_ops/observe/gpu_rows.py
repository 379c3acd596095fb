"""What status shows of each GPU (observe.gpu's Gpu with its role in the job and, per process, whether
it is foreign): one table row for people, one JSON object for scripts, and back."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe import gpu_owners
from dflash_ops.observe.gpu import IDLE_USED_MIB, Gpu, GpuProcess
from dflash_ops.observe.text_style import BOLD, inert, paint


def with_roles(report, job) -> tuple[Gpu, ...]:
    """The probe's GPUs, each with its role in `job` and its processes told foreign or not."""
    roles = {i: "target" for i in job.target_gpus}
    roles.update({i: "drafter" for i in job.drafter_gpus})
    return tuple(
        dataclasses.replace(
            g,
            role=roles.get(g.index),
            processes=tuple(
                dataclasses.replace(p, foreign=gpu_owners.is_foreign(report, p) if g.index in roles else None)
                for p in g.processes
            ),
        )
        for g in report.gpu.gpus
    )


def to_json(g: Gpu) -> dict:
    return {
        "index": g.index,
        "name": g.name,
        "uuid": g.uuid,
        "memory_used_mib": g.memory_used_mib,
        "memory_total_mib": g.memory_total_mib,
        "utilization_pct": g.utilization_pct,
        "role": g.role,
        "ghost_memory_mib": g.ghost_memory_mib,
        "processes": [
            {
                "pid": p.pid,
                "used_memory_mib": p.used_memory_mib,
                "name": p.name,
                "owner": p.owner or None,
                "foreign": p.foreign,
            }
            for p in g.processes
        ],
    }


def from_json(data: dict) -> Gpu:
    """to_json's object as the Gpu it was made from (the ghost memory follows from the rest)."""
    processes = tuple(
        GpuProcess(p["pid"], data["index"], p["used_memory_mib"], p["name"], p["owner"] or "", p["foreign"])
        for p in data["processes"]
    )
    fields = ("index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "role")
    return Gpu(**{k: data[k] for k in fields}, processes=processes)


def label(p: GpuProcess) -> str:
    """`python3/1072(1278M)`, then `[owner]` and `[foreign]` when they apply."""
    text = f"{p.name or '?'}/{p.pid}"
    text += f"({p.used_memory_mib}M)" if p.used_memory_mib is not None else ""
    text += f"[{p.owner}]" if p.owner else ""
    return text + ("[foreign]" if p.foreign else "")


def line(g: Gpu, name_width: int, color: bool) -> str:
    """`[0] NVIDIA H200 |  97 % |  70000 / 143771 MiB | target  | python3/4123(69000M)`"""
    used, total, util = g.memory_used_mib, g.memory_total_mib, g.utilization_pct
    util_text = "N/A" if util is None else f"{util:>3} %"
    mem = f"{'?' if used is None else used:>6} / {'?' if total is None else total:>6} MiB"
    pids = " ".join(label(p) for p in g.processes)
    # small differences between used and per-process memory are the driver's own; name big ones
    if g.ghost_memory_mib > IDLE_USED_MIB:
        pids = (pids + " " if pids else "") + f"ghost({g.ghost_memory_mib}M)"
    index = paint(f"[{g.index}]", BOLD, color)
    role = g.role or "-"
    name, pids = inert(g.name), inert(pids)  # both as the target's driver named them
    return f"{index} {name:<{name_width}} | {util_text:>5} | {mem} | {role:<7} | {pids or '-'}"
