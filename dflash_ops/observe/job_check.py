"""A job's check over its nodes, then ONE verdict: the worst node's plus what only the whole job
shows; a node that does not answer is UNKNOWN by itself."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe import check as check_lib, health
from dflash_ops.job import jobstate
from dflash_ops.observe.check import Checked
from dflash_ops.job.model import Target
from dflash_ops.transport.fanout import fan_out
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.observe.job_status import JobStatus, NodeStatus, Ranks
from dflash_ops.observe.status import TargetStatus

Job = Target | MultinodeJob  # a target is the one-node job


@dataclasses.dataclass
class JobChecked:
    job: Job
    nodes: list[Checked]
    verdict: health.Verdict
    status: TargetStatus | JobStatus

    def as_one_target(self) -> Checked:
        """The job as one checked target with its one verdict; node 0 tells its phase and launch."""
        first = self.nodes[0]
        named = dataclasses.replace(first.target, name=self.job.name)
        return Checked(named, self.verdict, first.status, first.report)


def check_all(jobs: list[Job], timeout_s: float | None = None) -> list[JobChecked]:
    outcomes = fan_out(jobs, lambda job: check(job, timeout_s))  # type: ignore[arg-type]  # any named
    for outcome in outcomes:
        if outcome.error is not None:  # a node's failed check is its UNKNOWN already: this is a bug
            raise outcome.error
    return [outcome.value for outcome in outcomes]


def check(job: Job, timeout_s: float | None = None) -> JobChecked:
    checked = [
        check_lib.checked_outcome(o)
        for o in fan_out(job.node_targets(), lambda t: check_lib.check(t, timeout_s=timeout_s))
    ]
    return combine(job, checked)


def combine(job: Job, checked: list[Checked]) -> JobChecked:
    if isinstance(job, Target):  # one node: its verdict and status are the job's
        return JobChecked(job, checked, checked[0].verdict, checked[0].status)
    nodes = tuple(
        NodeStatus(i, c.status, Ranks.of(c.status.processes, job.nodes[i].job.nproc_per_node))
        for i, c in enumerate(checked)
    )
    verdict = _verdict(job, checked, nodes)
    status = JobStatus(
        job=job.name,
        node_names=tuple(n.name for n in job.nodes),
        rdzv_endpoint=job.endpoint,
        runs_dir=job.runs_dir,
        world_size=job.world_size,
        nproc_per_node=job.nodes[0].job.nproc_per_node,
        nodes=nodes,
        verdict=verdict,
    )
    return JobChecked(job, checked, verdict, status)


def _label(job: MultinodeJob, index: int) -> str:
    return f"node {index} {job.nodes[index].name}"


def _parked(node: NodeStatus) -> bool:
    state = (node.status.job_state or {}).get("state")
    return node.status.session.running is False and state in jobstate.NOT_TO_RESTART


def _verdict(job: MultinodeJob, checked: list[Checked], nodes: tuple[NodeStatus, ...]) -> health.Verdict:
    """The worst node's level, CRITICAL for what only the whole job shows; perfdata is node 0's."""
    whole = _whole_job_problems(job, checked, nodes)
    level = health.worst([c.verdict.level for c in checked] + ["CRITICAL"] * bool(whole))
    if level == "OK":
        world = f"{len(nodes)} nodes, world size {job.world_size}"
        every = ", on every node" if any(_parked(n) for n in nodes) else ""
        reasons = [f"{checked[0].verdict.reasons[0]} ({world}{every})"]
    else:
        reasons = whole + [
            f"{_label(job, i)}: {reason}"
            for i, c in enumerate(checked)
            if c.verdict.level != "OK"
            for reason in c.verdict.reasons
        ]
    return health.Verdict(level, tuple(reasons), checked[0].verdict.perfdata)


def _whole_job_problems(
    job: MultinodeJob, checked: list[Checked], nodes: tuple[NodeStatus, ...]
) -> list[str]:
    problems = []
    parked = [n.index for n in nodes if _parked(n)]
    answered = [i for i, c in enumerate(checked) if c.verdict.level != "UNKNOWN"]
    if parked and len(parked) < len(answered):
        rest = [i for i in answered if i not in parked]
        problems.append(
            f"half the job: {', '.join(_label(job, i) for i in parked)} stopped or finished while "
            f"{', '.join(_label(job, i) for i in rest)} did not; relaunch or stop all of it (-t {job.name})"
        )
    running = [n for n in nodes if n.status.session.running]
    runs = {n.index: n.status.job_state.get("run") for n in running if isinstance(n.status.job_state, dict)}
    if len(set(runs.values())) > 1:
        listed = ", ".join(f"{_label(job, i)}: run {run}" for i, run in runs.items())
        problems.append(f"the nodes train different runs ({listed}); relaunch the whole job (-t {job.name})")
    for n in running:
        if n.ranks.lost_some:
            problems.append(
                f"{_label(job, n.index)}: {len(n.ranks.alive)} of {n.ranks.expected} local ranks alive "
                f"(torchrun pid {n.ranks.torchrun_pid}): a rank died"
            )
    return problems
