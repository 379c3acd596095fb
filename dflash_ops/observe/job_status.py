"""A multinode job's status: every node's TargetStatus with the torchrun ranks it runs, and the
job's one verdict; printed as text and as JSON like a single target's."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe.health import Verdict
from dflash_ops.observe.status import JobProcess, TargetStatus, verdict_json
from dflash_ops.observe.text_style import LEVEL_COLORS, paint

TORCHRUN_MODULE = "torch.distributed.run"
TRAINER_MODULE = "trainer"


@dataclasses.dataclass(frozen=True)
class Ranks:
    """A node's torchrun and the ranks it runs (its `-m trainer` children)."""

    torchrun_pid: int | None
    alive: tuple[int, ...]
    expected: int

    @classmethod
    def of(cls, processes: tuple[JobProcess, ...], expected: int) -> Ranks:
        """From the session's process tree."""
        agents = [p for p in processes if p.runs_module(TORCHRUN_MODULE)]
        agent = min(agents, key=lambda p: p.pid) if agents else None
        alive = sorted(
            p.pid
            for p in processes
            if agent is not None and p.ppid == agent.pid and p.runs_module(TRAINER_MODULE)
        )
        return cls(agent.pid if agent else None, tuple(alive), expected)

    @property
    def lost_some(self) -> bool:
        """torchrun runs, but fewer of its ranks than it should (and not none: still starting)."""
        return self.torchrun_pid is not None and 0 < len(self.alive) < self.expected

    def to_json(self) -> dict:
        return {"torchrun_pid": self.torchrun_pid, "alive": list(self.alive), "expected": self.expected}

    def line(self) -> str:
        if self.torchrun_pid is None:
            return "ranks: torchrun not running"
        pids = ", ".join(map(str, self.alive)) or "none"
        alive = f"{len(self.alive)} of {self.expected}"
        return f"ranks: torchrun pid {self.torchrun_pid}, local ranks alive {alive} ({pids})"


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    index: int
    status: TargetStatus
    ranks: Ranks

    def to_json(self) -> dict:
        return dict(self.status.to_json(), node=self.index, ranks=self.ranks.to_json())

    def text_lines(self, color: bool) -> list[str]:
        """The node's table, headed with its index, its ranks above its verdict."""
        lines = self.status.to_text(color).rstrip("\n").split("\n")
        lines[0] = f"node {self.index}: {lines[0]}"
        lines.insert(len(lines) - 1, self.ranks.line())
        return lines


@dataclasses.dataclass(frozen=True)
class JobStatus:
    job: str
    node_names: tuple[str, ...]
    rdzv_endpoint: str
    runs_dir: str
    world_size: int
    nproc_per_node: int
    nodes: tuple[NodeStatus, ...]
    verdict: Verdict

    @property
    def name(self) -> str:
        return self.job

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "multinode": {
                "nodes": list(self.node_names),
                "rdzv_endpoint": self.rdzv_endpoint,
                "runs_dir": self.runs_dir,
                "world_size": self.world_size,
            },
            "nodes": [n.to_json() for n in self.nodes],
            **verdict_json(self.verdict),
        }

    def to_text(self, color: bool = False) -> str:
        """The job's head line, each node's table (with its torchrun ranks), then the one verdict."""
        nproc = self.nproc_per_node
        out = [
            f"{self.job}: multinode job, {len(self.node_names)} nodes x {nproc} rank{'s' * (nproc != 1)} "
            f"(world size {self.world_size}), rendezvous {self.rdzv_endpoint}, runs {self.runs_dir}"
        ]
        for node in self.nodes:
            out += node.text_lines(color)
        level = self.verdict.level
        out.append(paint(f"{level}: {self.verdict.summary}", LEVEL_COLORS[level], color))
        return "\n".join(out) + "\n"
