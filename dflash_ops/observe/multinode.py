"""status and health of a multinode job: every node probed at once (each within the time budget),
then ONE verdict, the worst of the nodes plus what only the whole job shows: half of it stopped,
nodes in different runs, a node whose torchrun lost ranks. Every node is shown; a node that does
not answer is UNKNOWN by itself while the others are still reported."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe import health

from dflash_ops.act import jobstate

from dflash_ops import ops
from dflash_ops.errors import DflashOpsError, InputError, JobBusy
from dflash_ops.fanout import fan_out
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.act.relaunch_guard import RelaunchGuard
from dflash_ops.observe.status import render_table

TORCHRUN_MODULE = "torch.distributed.run"
TRAINER_MODULE = "trainer"


@dataclasses.dataclass
class JobChecked:
    job: MultinodeJob
    nodes: list[ops.Checked]
    verdict: health.Verdict
    status: dict


def check(job: MultinodeJob, timeout_s: float | None = None) -> JobChecked:
    targets = job.node_targets()
    checked = [ops.checked_outcome(o) for o in fan_out(targets, lambda t: ops.check(t, timeout_s=timeout_s))]
    return combine(job, checked)


def _runs_module(process: dict, module: str) -> bool:
    """`python -m MODULE ...` (not the pane's shell, whose arguments carry the same words)."""
    words = (process.get("cmdline") or "").split()
    return "-m" in words[1:3] and words[words.index("-m", 1) + 1 : words.index("-m", 1) + 2] == [module]


def ranks(status: dict, expected: int) -> dict:
    """The node's torchrun and the ranks it runs (its `-m trainer` children), from the session's
    process tree."""
    processes = status.get("processes") or []
    agents = [p for p in processes if _runs_module(p, TORCHRUN_MODULE)]
    agent = min(agents, key=lambda p: p["pid"]) if agents else None
    alive = sorted(
        p["pid"]
        for p in processes
        if agent is not None and p.get("ppid") == agent["pid"] and _runs_module(p, TRAINER_MODULE)
    )
    return {"torchrun_pid": agent["pid"] if agent else None, "alive": alive, "expected": expected}


def _label(job: MultinodeJob, index: int) -> str:
    return f"node {index} {job.nodes[index].name}"


def _parked(status: dict) -> bool:
    state = (status.get("job_state") or {}).get("state")
    return status["session"]["running"] is False and state in (jobstate.STOPPED, jobstate.FINISHED)


def combine(job: MultinodeJob, checked: list[ops.Checked]) -> JobChecked:
    nodes = []
    for i, c in enumerate(checked):
        nodes.append(dict(c.status, node=i, ranks=ranks(c.status, job.nodes[i].job.nproc_per_node)))
    whole: list[str] = []  # CRITICAL reasons only the whole job shows
    parked = [i for i, s in enumerate(nodes) if _parked(s)]
    answered = [i for i, c in enumerate(checked) if c.verdict.level != "UNKNOWN"]
    if parked and len(parked) < len(answered):
        rest = [i for i in answered if i not in parked]
        whole.append(
            f"half the job: {', '.join(_label(job, i) for i in parked)} stopped or finished while "
            f"{', '.join(_label(job, i) for i in rest)} did not; relaunch or stop all of it (-t {job.name})"
        )
    runs = {
        i: s["job_state"].get("run")
        for i, s in enumerate(nodes)
        if s["session"]["running"] and isinstance(s.get("job_state"), dict)
    }
    if len(set(runs.values())) > 1:
        listed = ", ".join(f"{_label(job, i)}: run {run}" for i, run in runs.items())
        whole.append(f"the nodes train different runs ({listed}); relaunch the whole job (-t {job.name})")
    for i, s in enumerate(nodes):
        r = s["ranks"]
        if s["session"]["running"] and r["torchrun_pid"] is not None and 0 < len(r["alive"]) < r["expected"]:
            whole.append(
                f"{_label(job, i)}: {len(r['alive'])} of {r['expected']} local ranks alive "
                f"(torchrun pid {r['torchrun_pid']}): a rank died"
            )
    levels = [c.verdict.level for c in checked] + ["CRITICAL"] * bool(whole)
    level = health.worst(levels)
    if level == "OK":
        world = f"{len(nodes)} nodes, world size {job.world_size}"
        reasons = [f"{checked[0].verdict.reasons[0]} ({world}{', on every node' if parked else ''})"]
    else:
        reasons = whole + [
            f"{_label(job, i)}: {reason}"
            for i, c in enumerate(checked)
            if c.verdict.level != "OK"
            for reason in c.verdict.reasons
        ]
    verdict = health.Verdict(level, tuple(reasons), checked[0].verdict.perfdata)
    status = {
        "job": job.name,
        "multinode": {
            "nodes": [n.name for n in job.nodes],
            "rdzv_endpoint": job.endpoint,
            "runs_dir": job.runs_dir,
            "world_size": job.world_size,
        },
        "nodes": nodes,
        "verdict": level,
        "reasons": list(reasons),
        "perfdata": verdict.to_dict()["perfdata"],
    }
    return JobChecked(job, checked, verdict, status)


def _ranks_line(r: dict) -> str:
    if r["torchrun_pid"] is None:
        return "ranks: torchrun not running"
    pids = ", ".join(map(str, r["alive"])) or "none"
    alive = f"{len(r['alive'])} of {r['expected']}"
    return f"ranks: torchrun pid {r['torchrun_pid']}, local ranks alive {alive} ({pids})"


def render(jc: JobChecked, color: bool = False) -> str:
    """The job's head line, each node's table (with its torchrun ranks), then the one verdict."""
    m = jc.status["multinode"]
    nproc = jc.job.nodes[0].job.nproc_per_node
    out = [
        f"{jc.job.name}: multinode job, {len(m['nodes'])} nodes x {nproc} rank{'s' * (nproc != 1)} "
        f"(world size {m['world_size']}), rendezvous {m['rdzv_endpoint']}, runs {m['runs_dir']}"
    ]
    for node in jc.status["nodes"]:
        lines = render_table(node, color=color).rstrip("\n").split("\n")
        lines[0] = f"node {node['node']}: {lines[0]}"
        lines.insert(len(lines) - 1, _ranks_line(node["ranks"]))
        out += lines
    level = jc.verdict.level
    text = f"{level}: " + "; ".join(jc.verdict.reasons)
    out.append(f"\033[{_COLORS[level]}m{text}\033[0m" if color else text)
    return "\n".join(out) + "\n"


_COLORS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}


def nagios_line(jc: JobChecked) -> str:
    return health.nagios_line(jc.job.name, jc.verdict)


def auto_relaunch(jc: JobChecked) -> ops.HealthAction | None:
    """Relaunch the WHOLE job when it is CRITICAL, at most max_relaunches_per_hour (node 0's);
    its checks run on every node first, so a node that cannot take part relaunches nothing."""
    from dflash_ops.act import multinode

    if jc.verdict.level != "CRITICAL":
        return None
    guard = RelaunchGuard(f"multinode-{jc.job.name}", jc.job.nodes[0].job.health.max_relaunches_per_hour)
    with guard.hold() as allowed:
        if allowed is not True:
            return ops.HealthAction(False, f"auto-relaunch skipped: {allowed}")
        try:
            result = multinode.relaunch(jc.job, on_locked=guard.record)
        except JobBusy as exc:
            return ops.HealthAction(False, f"auto-relaunch skipped: {exc.reason}")
        except DflashOpsError as exc:
            return ops.HealthAction(True, f"auto-relaunch FAILED: {str(exc).splitlines()[0]}")
    outcome = "succeeded" if result.ok else "FAILED: " + result.summary()
    return ops.HealthAction(True, f"auto-relaunch of every node {outcome}", result)


def node_target(job: MultinodeJob, node: str | None):
    """The node `--node NAME|INDEX` names (default node 0) as a target running its part of the job."""
    names = [n.name for n in job.nodes]
    if node is None:
        return job.node_target(0)
    if node in names:
        return job.node_target(names.index(node))
    if node.isdigit() and int(node) < len(names):
        return job.node_target(int(node))
    raise InputError(
        f"--node {node}: not a node of {job.name} (nodes: {', '.join(names)}, or 0-{len(names) - 1})"
    )
