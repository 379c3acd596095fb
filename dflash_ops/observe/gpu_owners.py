"""Whose is each process on the job's GPUs: the job's, foreign (reported, never signalled), or unknown."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuUse:
    pid: int
    gpu: int
    name: str
    used_memory_mib: int | None
    owner: str  # "" (where the job runs), "ct 201", "host"

    def describe(self) -> str:
        where = self.owner or "this container/machine"
        size = "?" if self.used_memory_mib is None else self.used_memory_mib
        return f"pid {self.pid} {self.name or '?'} on GPU {self.gpu} ({size} MiB, {where})"


def job_pids(report) -> set[int]:
    return {p.pid for p in report.processes} | set(report.marked_pids)


def ownership(owner: str, visible: bool, is_job: bool) -> bool | None:
    """The one rule: foreign (True) when another owner or visible and not the job's; the job's (False);
    None when it cannot be told (an invisible host pid may be the job's trainer)."""
    if owner == "gone":
        return None
    if owner:
        return True
    return (not is_job) if visible else None


def is_foreign(report, process) -> bool | None:
    mapped_by_host = (report.gpu.source or "").endswith("Proxmox host")
    visible = mapped_by_host or process.pid in report.gpu_pids_visible
    return ownership(process.owner, visible, process.pid in job_pids(report))


def foreign_on_job_gpus(report, job) -> list[GpuUse]:
    gpus = set(job.gpus)
    return [
        GpuUse(p.pid, g.index, p.name, p.used_memory_mib, p.owner)
        for g in report.gpu.gpus
        if g.index in gpus
        for p in g.processes
        if is_foreign(report, p)
    ]
