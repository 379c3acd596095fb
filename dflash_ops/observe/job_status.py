"""A multinode job's status: every node's TargetStatus with its ranks, and the job's one verdict."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe.health import Verdict
from dflash_ops.observe.status import JobProcess, TargetStatus, verdict_json

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


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    index: int
    status: TargetStatus
    ranks: Ranks

    def to_json(self) -> dict:
        return dict(self.status.to_json(), node=self.index, ranks=self.ranks.to_json())


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
