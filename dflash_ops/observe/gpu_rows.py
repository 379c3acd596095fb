"""What status shows of each GPU: one row with its role in the job and the processes on it."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe.gpu import IDLE_USED_MIB
from dflash_ops.observe.text_style import BOLD, inert, paint


@dataclasses.dataclass(frozen=True)
class GpuProcessRow:
    """One process on a GPU (fields in the JSON's order)."""

    pid: int
    used_memory_mib: int | None
    name: str
    owner: str | None
    foreign: bool | None  # None: not a job GPU, or the probe could not tell

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GpuProcessRow:
        return cls(**data)

    def label(self) -> str:
        """`python3/1072(1278M)`, then `[owner]` and `[foreign]` when they apply."""
        text = f"{self.name or '?'}/{self.pid}"
        text += f"({self.used_memory_mib}M)" if self.used_memory_mib is not None else ""
        text += f"[{self.owner}]" if self.owner else ""
        return text + ("[foreign]" if self.foreign else "")


@dataclasses.dataclass(frozen=True)
class GpuRow:
    index: int
    name: str
    uuid: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None
    role: str | None  # "target", "drafter", or None for a GPU the job does not use
    ghost_memory_mib: int
    processes: tuple[GpuProcessRow, ...] = ()

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "memory_used_mib": self.memory_used_mib,
            "memory_total_mib": self.memory_total_mib,
            "utilization_pct": self.utilization_pct,
            "role": self.role,
            "ghost_memory_mib": self.ghost_memory_mib,
            "processes": [p.to_json() for p in self.processes],
        }

    @classmethod
    def from_json(cls, data: dict) -> GpuRow:
        rows = tuple(GpuProcessRow.from_json(p) for p in data["processes"])
        return cls(**{**data, "processes": rows})

    def line(self, name_width: int, color: bool) -> str:
        """`[0] NVIDIA H200 |  97 % |  70000 / 143771 MiB | target  | python3/4123(69000M)`"""
        used, total, util = self.memory_used_mib, self.memory_total_mib, self.utilization_pct
        util_text = "N/A" if util is None else f"{util:>3} %"
        mem = f"{'?' if used is None else used:>6} / {'?' if total is None else total:>6} MiB"
        pids = " ".join(p.label() for p in self.processes)
        # small differences between used and per-process memory are the driver's own; name big ones
        if (self.ghost_memory_mib or 0) > IDLE_USED_MIB:
            pids = (pids + " " if pids else "") + f"ghost({self.ghost_memory_mib}M)"
        index = paint(f"[{self.index}]", BOLD, color)
        role = self.role or "-"
        name, pids = inert(self.name), inert(pids)  # both as the target's driver named them
        return f"{index} {name:<{name_width}} | {util_text:>5} | {mem} | {role:<7} | {pids or '-'}"
