"""A torchrun job across several targets (a `multinode:` job of the inventory), driven as ONE job.

relaunch: every node's job lock is taken, then every check runs on every node before anything
stops anywhere: the single-target preflight, the same python/torch/release/config on all nodes,
the runs dir proven shared, the rendezvous endpoint (and each node's address) reachable from
every node. Then, on every node: stop, free the GPUs, purge the compile cache; the same release is
deployed to all; the run is chosen once in the shared runs dir and every node launches it under
one rendezvous id; the first step is confirmed in node 0's metrics while the other nodes are
watched, then on every node. A launch that fails on some nodes stops the others again: the job
runs on all its nodes or on none.

stop: every node's job ends (SIGTERM; the ranks agree on the step to stop at and rank 0
checkpoints) and every node records the stop, so health treats the job as operator-stopped.

The steps are the single-target ones (steps.py, preflight.py) called per node; see
multinode_checks for the cross-node checks, multinode_phases for how phases run on every node
and multinode_status for status/health.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import shlex
import time
from typing import Callable

from . import jobpaths, launch as launch_lib, multinode_checks as checks, steps, tmux
from .errors import DflashOpsError, StepFailed
from .multinode_inventory import MultinodeJob
from .multinode_phases import Emit, Node, Phases, Stop, connected, each, first_lines, per_node
from .playbook import PlaybookResult
from .preflight import preflight
from .remote import shell_command


@dataclasses.dataclass(frozen=True)
class RelaunchOptions:
    purge: bool = True
    deploy: bool = True
    resume: bool = True  # False: --fresh
    timeout_s: float = 900.0  # for the first step
    grace_s: float = 30.0
    allow_shared_gpus: bool = False
    gpu_free_timeout_s: float = 120.0
    min_free_gib: float = 10.0


RELAUNCH_PHASES = [
    "preflight",
    "same_job",
    "shared_runs_dir",
    "rendezvous",
    "stop_session",
    "free_gpus",
    "purge_cache",
    "deploy",
    "launch",
    "wait_first_step",
]


def relaunch(
    job: MultinodeJob,
    options: RelaunchOptions = RelaunchOptions(),
    emit: Emit | None = None,
    dry_run: bool = False,
    on_locked: Callable[[], None] | None = None,
) -> PlaybookResult:
    """Relaunch the whole job; see the module doc. Checks fail before anything stops anywhere."""
    phases = Phases("relaunch", job.name, RELAUNCH_PHASES, emit, dry_run)
    if dry_run:
        return _dry_relaunch(job, options, phases)
    with connected(job, "relaunch") as nodes:
        if on_locked is not None:
            on_locked()
        for node in nodes:
            node.said = phases.say("wait_first_step")
        try:
            _relaunch(job, nodes, options, phases)
        except Stop:
            pass
    return phases.result()


def _relaunch(job: MultinodeJob, nodes: list[Node], options: RelaunchOptions, phases: Phases) -> None:
    untouched = "; nothing was stopped on any node"

    def checked(fn: Callable[[], str]) -> Callable[[], str]:
        def run() -> str:
            try:
                return fn()
            except DflashOpsError as exc:
                text = str(exc)
                raise StepFailed(text if "nothing was stopped" in text else text + untouched) from None

        return run

    facts: list[dict] = []

    def preflight_one(node: Node) -> str:
        return preflight(
            node.ctx("preflight"),
            gpus=list(node.target.job.gpus),
            deploy=options.deploy,
            min_free_gib=options.min_free_gib,
            allow_shared_gpus=options.allow_shared_gpus,
            import_torch=True,
        ).message

    def same_job() -> str:
        facts[:] = each(nodes, lambda node: checks.facts(node.ctx("same_job")))
        return checks.same_job(job, nodes, facts, options.deploy)

    phases.on_nodes("preflight", nodes, preflight_one, note="\nnothing was stopped on any node")
    phases.run("same_job", checked(same_job))
    phases.run("shared_runs_dir", checked(lambda: checks.prove_shared(job, nodes)))
    phases.run("rendezvous", checked(lambda: checks.rendezvous(job, nodes, facts)))
    # from here on the job is stopped everywhere, then launched everywhere
    _stop_everywhere(nodes, phases, options.grace_s, options.gpu_free_timeout_s, record=False)
    if options.purge:
        phases.on_nodes(
            "purge_cache",
            nodes,
            lambda n: (
                steps.purge_cache(
                    n.ctx("purge_cache"), paths=[n.target.job.cache_dir], if_unmarked="skip"
                ).message
            ),
        )
    else:
        phases.skip("purge_cache", "--no-purge")
    if options.deploy:
        phases.run("deploy", lambda: _deploy(nodes))
    else:
        phases.skip("deploy", "--no-deploy: the release every node has (checked the same in same_job)")
    try:
        phases.run("launch", lambda: _launch(job, nodes, options.resume))
        phases.run(
            "wait_first_step",
            lambda: _wait_first_step(nodes, options.timeout_s, phases.status("wait_first_step")),
        )
    except Stop:
        note = _no_half_job(nodes, options.grace_s)
        if note:
            last = phases.reports[-1]
            phases.reports[-1] = dataclasses.replace(last, message=f"{last.message}\n{note}")
        raise


def _stop_everywhere(
    nodes: list[Node], phases: Phases, grace_s: float, gpu_free_timeout_s: float, record: bool
) -> None:
    """stop_session (then mark_stopped when `record`) and free_gpus, each on every node at once.
    For `stop` (record) a node that fails does not hold up the others: they are stopped, recorded
    and freed all the same, and the command fails naming the node."""

    def stop(node: Node) -> str:
        outcome = steps.stop_session(
            node.ctx("stop_session"), session=node.target.job.session, grace_s=grace_s
        )
        node.data["foreign"] = list(outcome.data.get("foreign") or [])
        return outcome.message

    nodes = phases.on_nodes("stop_session", nodes, stop, keep_going=record)
    if record:
        nodes = phases.on_nodes(
            "mark_stopped",
            nodes,
            lambda n: steps.mark_stopped(n.ctx("mark_stopped")).message,
            keep_going=True,
        )

    def free(node: Node) -> str:
        gpus = list(node.target.job.gpus)
        killed = steps.kill_gpu_processes(node.ctx("free_gpus"), gpus=gpus, grace_s=10.0)
        waited = steps.wait_gpu_free(
            node.ctx("free_gpus"),
            gpus=gpus,
            timeout_s=gpu_free_timeout_s,
            max_used_mib=1024,
            poll_s=2.0,
            ignore=node.data.get("foreign", []) + list(killed.data.get("foreign") or []),
            processes_ended=True,
        )
        return f"{killed.message}; {waited.message}"

    phases.on_nodes("free_gpus", nodes, free, keep_going=record)


def _deploy(nodes: list[Node]) -> str:
    outcomes = each(nodes, lambda n: steps.deploy(n.ctx("deploy"), keep_releases=5))
    releases = {o.data.get("release") for o in outcomes}
    if len(releases) != 1:
        raise StepFailed(
            f"deploy: the nodes hold different releases after the deploy: {sorted(map(str, releases))}"
        )
    return f"release {releases.pop()} is current on every node"


def _launch(job: MultinodeJob, nodes: list[Node], resume: bool) -> str:
    """Choose the run once (node 0, in the shared runs dir), then start every node under one
    rendezvous id."""
    first = nodes[0]
    chosen = first.ctx("launch").run(
        shell_command("choose_run.sh", job.runs_dir, "resume" if resume else "fresh", jobpaths.RUN_FINISHED),
        timeout=30,
    )
    assert chosen is not None
    run = chosen.stdout.strip().splitlines()[-1] if chosen.stdout.strip() else ""
    if not run.isdigit():
        raise StepFailed(f"[{first.name}] launch: no run number from {job.runs_dir}: {chosen.stdout[:200]!r}")
    rdzv_id = f"{job.name}-{run}-{secrets.token_hex(4)}"

    def start(node: Node) -> str:
        node.target = job.node_target(node.index, rdzv_id)
        ctx = node.ctx("launch")
        node_job = node.target.job
        _, why = steps.resolve_cache(ctx, node_job.cache_dir)
        if why is not None:
            raise StepFailed(f"[{node.name}] launch: refusing to launch: {why}")
        result = ctx.run(launch_lib.launch_script(node_job, run=run), timeout=60)
        assert result is not None
        printed = result.stdout.strip().splitlines()
        if not printed or not printed[-1].startswith("/"):
            raise StepFailed(f"[{node.name}] launch: the launch printed no log path: {result.stdout[:200]!r}")
        node.data["log"] = printed[-1]
        return f"session {node_job.session!r} started, log {printed[-1]}"

    started = per_node(nodes, each(nodes, start))
    return f"run {run} on {len(nodes)} nodes, rendezvous {job.endpoint} id {rdzv_id}\n{started}"


def _wait_first_step(nodes: list[Node], timeout_s: float, status: Callable[[str], None]) -> str:
    """Node 0's metrics show the first step (rank 0's, or node 0's local rank 0: the same records);
    meanwhile a node whose trainer exits ends the wait at once. Then every other node's metrics."""
    first, others = nodes[0], nodes[1:]
    last_look = [time.monotonic()]

    def watching(message: str) -> None:
        status(message)
        if time.monotonic() - last_look[0] >= 3.0:
            last_look[0] = time.monotonic()
            for node in others:
                why = _pane_problem(node)
                if why is not None:
                    raise StepFailed(f"[{node.name}] wait_first_step: {node.label}: {why}{_log_tail(node)}")

    began = time.monotonic()
    outcome = steps.wait_first_step(
        first.ctx("wait_first_step", status=watching), log=first.data["log"], timeout_s=timeout_s, poll_s=1.0
    )
    left = max(30.0, timeout_s - (time.monotonic() - began))
    rest = each(
        others,
        lambda n: (
            steps.wait_first_step(
                n.ctx("wait_first_step"), log=n.data["log"], timeout_s=left, poll_s=1.0
            ).message
        ),
    )
    return f"{outcome.message} (node 0)\n" + per_node(nodes, [outcome.message] + rest)


def _pane_problem(node: Node) -> str | None:
    """Why the node's trainer is not running (its pane gone or dead), or None."""
    result = node.transport.run(
        tmux.pane_pids(node.target.job) + "; true", timeout=30, step="wait_first_step"
    )
    fields = result.stdout.split()
    if not fields:
        return "its tmux session is gone"
    if len(fields) >= 2 and fields[1] == "1":
        return "its trainer exited" + (f" with code {fields[2]}" if len(fields) >= 3 else "")
    return None


def _log_tail(node: Node, lines: int = 20) -> str:
    log = node.data.get("log")
    if not log:
        return ""
    read = node.transport.run(
        f"tail -n {int(lines)} {shlex.quote(log)} | tail -c 20000", timeout=30, step="wait_first_step"
    )
    text = "\n    ".join(read.stdout.rstrip().splitlines())
    return f"\n  last lines of {log}:\n    {text}" if text else ""


def _no_half_job(nodes: list[Node], grace_s: float) -> str:
    """After a failed launch or start: when the job runs on some nodes but not all, stop it on
    those too, since a partial job only waits at the rendezvous. Returns what was done."""
    alive = []
    for node in nodes:
        try:
            if _pane_problem(node) is None:
                alive.append(node)
        except DflashOpsError:
            continue
    if not alive or len(alive) == len(nodes):
        return ""
    try:
        each(
            alive,
            lambda n: steps.stop_session(
                n.ctx("stop_session"), session=n.target.job.session, grace_s=grace_s
            ),
        )
    except DflashOpsError as exc:
        where = ", ".join(n.label for n in alive)
        return f"the job still runs on {where}; stopping it failed: {first_lines(exc)}"
    return (
        f"stopped the job again on {', '.join(n.label for n in alive)}: a job runs on all its nodes or none "
        "(`dflash-ops status` shows each node)"
    )


def _dry_relaunch(job: MultinodeJob, options: RelaunchOptions, phases: Phases) -> PlaybookResult:
    nodes = [Node(i, t) for i, t in enumerate(job.node_targets("<rdzv-id>"))]
    mode = "resume" if options.resume else "fresh"
    would = {
        "preflight": "would run the single-target preflight on every node",
        "same_job": "would compare python, torch, trainer release and config across the nodes",
        "shared_runs_dir": f"would prove {job.runs_dir} shared (every node reads what the others write)",
        "rendezvous": f"would connect to {job.endpoint} (and to each node's address) from every node",
        "stop_session": "would stop the job on every node",
        "free_gpus": "would end leftover job processes and wait for the GPUs on every node",
        "purge_cache": "would purge each node's compile cache",
        "deploy": "would deploy the same trainer release to every node",
        "launch": f"would choose the run in {job.runs_dir} ({mode}) and start:\n"
        + per_node(nodes, [shlex.join(launch_lib.trainer_argv(n.target.job)) for n in nodes]),
        "wait_first_step": f"would wait up to {options.timeout_s:g}s for the first step (node 0 first)",
    }
    for name in RELAUNCH_PHASES:
        if (name == "purge_cache" and not options.purge) or (name == "deploy" and not options.deploy):
            phases.skip(name, "--no-purge" if name == "purge_cache" else "--no-deploy")
        else:
            phases.run(name, functools.partial(would.__getitem__, name))
    return phases.result()


STOP_PHASES = ["stop_session", "mark_stopped", "free_gpus"]


def stop(
    job: MultinodeJob, grace_s: float = 30.0, emit: Emit | None = None, dry_run: bool = False
) -> PlaybookResult:
    """End the job on every node at once and record the stop on every node."""
    phases = Phases("stop", job.name, STOP_PHASES, emit, dry_run)
    if dry_run:
        where = ", ".join(n.name for n in job.nodes)
        for name in STOP_PHASES:
            phases.run(name, functools.partial(str, f"would run {name} on every node ({where})"))
        return phases.result()
    with connected(job, "stop") as nodes:
        try:
            _stop_everywhere(nodes, phases, grace_s, 120.0, record=True)
        except Stop:
            pass
    return phases.result()
