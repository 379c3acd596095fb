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

Each command is one playbook Run over the job whose steps are phases: a single-target step
(steps.py, preflight.py) run on every node at once, or a step of the whole job defined here. See
multinode_checks for the cross-node checks, multinode_phases for how phases run on the nodes and
multinode_status for status/health. The options and their defaults are dflash_ops.commands'.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import shlex
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar, cast

from dflash_ops import commands

from dflash_ops.act import multinode_checks as checks, steps
from dflash_ops.job import tmux
from dflash_ops.commands import GPU_FREE_S, GRACE_S
from dflash_ops.errors import DflashOpsError, StepFailed
from dflash_ops.job.model import Job
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.act.multinode_phases import (
    JobContext,
    Node,
    each,
    first_lines,
    on_nodes,
    one,
    per_node,
    running,
)
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.act.runner import OnProgress, Run, RunResult
from dflash_ops.act.preflight import preflight
from dflash_ops.remote import bundle, python_command

if TYPE_CHECKING:
    from dflash_ops.observe.multinode import JobChecked

F = TypeVar("F", bound=Callable[..., Any])
_default = functools.partial(commands.default_of, commands.relaunch)
UNTOUCHED = "nothing was stopped on any node"
_CHOOSE_RUN = "choose_run.py"

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
STOP_PHASES = ["stop_session", "mark_stopped", "free_gpus"]


@dataclasses.dataclass(frozen=True)
class _Options:
    """A relaunch's options (commands.relaunch's)."""

    purge: bool
    deploy: bool
    resume: bool
    timeout: float
    grace: float
    gpu_free_timeout: float
    allow_shared_gpus: bool
    min_free_gib: float


def relaunch(
    job: MultinodeJob,
    *,
    purge: bool = True,
    deploy: bool = True,
    resume: bool = True,
    timeout: float = _default("timeout"),
    grace: float = GRACE_S,
    gpu_free_timeout: float = GPU_FREE_S,
    allow_shared_gpus: bool = False,
    min_free_gib: float = _default("min_free_gib"),
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
    on_locked: Callable[[], None] | None = None,
) -> RunResult:
    """Relaunch the whole job (commands.relaunch's options, for every node); see the module doc.
    Checks fail before anything stops anywhere. `on_locked` runs once every node's lock is ours."""
    options = _Options(
        purge, deploy, resume, timeout, grace, gpu_free_timeout, allow_shared_gpus, min_free_gib
    )
    _check_grace(job, grace)
    with running(job, "relaunch", RELAUNCH_PHASES, dry_run, on_progress, on_locked) as (run, nodes):
        _relaunch(run, job, nodes, options)
    return run.result()


def _relaunch(run: Run, job: MultinodeJob, nodes: list[Node], o: _Options) -> None:
    on_nodes(
        run,
        preflight,
        nodes,
        deploy=o.deploy,
        min_free_gib=o.min_free_gib,
        allow_shared_gpus=o.allow_shared_gpus,
        import_torch=True,
        note=f"\n{UNTOUCHED}",
    )
    found = run(same_job, job, deploy=o.deploy)
    run(shared_runs_dir, job)
    run(rendezvous, job, found)
    # from here on the job is stopped everywhere, then launched everywhere
    on_nodes(run, steps.stop_session, nodes, grace_s=o.grace)
    on_nodes(run, free_gpus, nodes, timeout_s=o.gpu_free_timeout)
    if o.purge:  # a cache dir without the launcher's marker is left alone, never deleted
        on_nodes(run, steps.purge_cache, nodes, if_unmarked="skip")
    else:
        run.skip(steps.purge_cache, "--no-purge")
    if o.deploy:
        run(deploy)
    else:
        run.skip(deploy, "--no-deploy: the release every node has (checked the same in same_job)")
    launched = run(launch, job, resume=o.resume, grace_s=o.grace)
    run(wait_first_step, job, launched, timeout_s=o.timeout, grace_s=o.grace)


def stop(
    job: MultinodeJob,
    *,
    grace: float = GRACE_S,
    gpu_free_timeout: float = GPU_FREE_S,
    dry_run: bool = False,
    on_progress: OnProgress | None = None,
) -> RunResult:
    """End the job on every node at once and record the stop on every node. A node that fails does
    not hold up the others: they are stopped, recorded and freed all the same, and the command
    fails naming the node."""
    _check_grace(job, grace)
    with running(job, "stop", STOP_PHASES, dry_run, on_progress) as (run, nodes):
        ended = on_nodes(run, steps.stop_session, nodes, grace_s=grace, record_stop=True, keep_going=True)
        recorded = on_nodes(run, steps.mark_stopped, [n for n, _ in ended], keep_going=True)
        on_nodes(run, free_gpus, [n for n, _ in recorded], timeout_s=gpu_free_timeout, keep_going=True)
    return run.result()


def _check_grace(job: MultinodeJob, grace: float) -> None:
    """--grace against every node's trainer, before anything connects (stop_session checks it too)."""
    from dflash_ops.act.grace import check_grace

    for node in job.nodes:
        check_grace(node.job, grace)


# ------------------------------------------------------------------ the phases of the whole job


def _before_any_stop(phase: F) -> F:
    """A check before anything stops: its failure says that nothing was stopped."""

    @functools.wraps(phase)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return phase(*args, **kwargs)
        except DflashOpsError as exc:
            text = str(exc)
            raise StepFailed(text if UNTOUCHED in text else f"{text}; {UNTOUCHED}") from None

    return cast(F, checked)


@dataclasses.dataclass(kw_only=True)
class Found(StepOutcome):
    """What same_job gives: each node's facts (remote/multinode_facts.py), in node order."""

    facts: list[dict]


@_before_any_stop
def same_job(ctx: JobContext, job: MultinodeJob, *, deploy: bool) -> Found:
    """The same python, torch and config on every node (and the same release without a deploy)."""
    found = each(ctx, ctx.nodes, lambda node, c: checks.facts(c, node.target.job))
    if ctx.dry_run:
        return Found("would compare python, torch, trainer release and config across the nodes", facts=found)
    return Found(checks.same_job(job, ctx.nodes, found, deploy), facts=found)


@_before_any_stop
def shared_runs_dir(ctx: JobContext, job: MultinodeJob) -> StepOutcome:
    """The runs dir is one filesystem on every node (multinode_checks.prove_shared)."""
    return StepOutcome(checks.prove_shared(ctx, job))


@_before_any_stop
def rendezvous(ctx: JobContext, job: MultinodeJob, found: Found) -> StepOutcome:
    """Every node reaches the rendezvous and the other nodes (multinode_checks.rendezvous)."""
    return StepOutcome(checks.rendezvous(ctx, job, found.facts))


def free_gpus(ctx: StepContext, job: Job, *, timeout_s: float) -> StepOutcome:
    """On one node: end leftover job processes, then wait for its GPUs (the processes that are
    not the job's are left alone, and not waited for)."""
    ended = steps.kill_gpu_processes(ctx, job)
    waited = steps.wait_gpu_free(ctx, job, ended, timeout_s=timeout_s)
    return StepOutcome(f"{ended.message}; {waited.message}")


def deploy(ctx: JobContext) -> StepOutcome:
    """The same trainer release deployed to every node, and current on each."""
    outcomes = each(ctx, ctx.nodes, lambda node, c: steps.deploy(c, node.target.job))
    releases = {o.data.get("release") for o in outcomes}
    if len(releases) != 1:
        raise StepFailed(
            f"deploy: the nodes hold different releases after the deploy: {sorted(map(str, releases))}"
        )
    release = releases.pop()
    if ctx.dry_run:
        return StepOutcome(f"would make release {release} current on every node")
    return StepOutcome(f"release {release} is current on every node", data={"release": release})


@dataclasses.dataclass(kw_only=True)
class JobLaunched(StepOutcome):
    """What launch gives: the run every node launched, its rendezvous id, and each node's launch
    (the log it started), in node order."""

    run: str
    rdzv_id: str
    nodes: list[steps.Launched]


def launch(ctx: JobContext, job: MultinodeJob, *, resume: bool, grace_s: float) -> JobLaunched:
    """Choose the run once (node 0, in the shared runs dir), then start every node under one
    rendezvous id. A launch that leaves the job on some nodes only stops it there again."""
    try:
        return _launch(ctx, job, resume)
    except DflashOpsError as exc:
        raise _all_or_none(ctx, exc, grace_s) from None


def _launch(ctx: JobContext, job: MultinodeJob, resume: bool) -> JobLaunched:
    first = ctx.nodes[0]
    mode = "resume" if resume else "fresh"
    chosen = one(
        ctx,
        first,
        lambda node, c: c.run(
            python_command(node.target.job.python, _CHOOSE_RUN, {"runs": job.runs_dir, "resume": resume}),
            timeout=30,
            stdin=bundle(_CHOOSE_RUN),
        ),
    )
    printed = chosen.stdout.split()
    run = "NNNN" if ctx.dry_run else printed[-1] if printed else ""
    if not (run.isdigit() or ctx.dry_run):
        raise StepFailed(f"[{first.name}] launch: no run number from {job.runs_dir}: {chosen.stdout[:200]!r}")
    rdzv_id = f"{job.name}-{run}-{secrets.token_hex(4)}"
    started = each(ctx, ctx.nodes, lambda node, c: _start(c, job, node, run, rdzv_id))
    which = f"the run chosen in {job.runs_dir} ({mode})" if ctx.dry_run else f"run {run}"
    return JobLaunched(
        f"{which} on {len(ctx.nodes)} nodes, rendezvous {job.endpoint} id {rdzv_id}\n"
        + per_node(ctx.nodes, [s.message for s in started]),
        run=run,
        rdzv_id=rdzv_id,
        nodes=started,
    )


def _start(ctx: StepContext, job: MultinodeJob, node: Node, run: str, rdzv_id: str) -> steps.Launched:
    """Start run `run` on `node` under the rendezvous id."""
    node_target = job.node_target(node.index, rdzv_id)
    return steps.start_run(dataclasses.replace(ctx, target=node_target), node_target.job, run=run)


def wait_first_step(
    ctx: JobContext, job: MultinodeJob, launched: JobLaunched, *, timeout_s: float, grace_s: float
) -> StepOutcome:
    """Node 0's metrics show the first step (rank 0's, or node 0's local rank 0: the same records);
    meanwhile a node whose trainer exits ends the wait at once. Then every other node's metrics.
    A job that runs on some nodes only after a failure is stopped there again."""
    try:
        return _wait_first_step(ctx, launched, timeout_s)
    except DflashOpsError as exc:
        raise _all_or_none(ctx, exc, grace_s) from None


def _wait_first_step(ctx: JobContext, launched: JobLaunched, timeout_s: float) -> StepOutcome:
    first, others = ctx.nodes[0], ctx.nodes[1:]
    logs = launched.nodes
    last_look = [time.monotonic()]

    def watching(message: str) -> None:
        ctx.status(message)
        if time.monotonic() - last_look[0] >= 3.0:
            last_look[0] = time.monotonic()
            for node in others:
                why = _pane_problem(node)
                if why is not None:
                    tail = _log_tail(node, logs[node.index].log)
                    raise StepFailed(f"[{node.name}] wait_first_step: {node.label}: {why}{tail}")

    def wait(node: Node, c: StepContext, seconds: float) -> StepOutcome:
        return steps.wait_first_step(c, node.target.job, logs[node.index], timeout_s=seconds)

    began = time.monotonic()
    outcome = one(ctx, first, lambda node, c: wait(node, dataclasses.replace(c, status=watching), timeout_s))
    left = max(30.0, timeout_s - (time.monotonic() - began))
    rest = each(ctx, others, lambda node, c: wait(node, c, left).message)
    return StepOutcome(f"{outcome.message} (node 0)\n" + per_node(ctx.nodes, [outcome.message, *rest]))


def _pane_problem(node: Node) -> str | None:
    """Why the node's trainer is not running (its pane gone or dead), or None."""
    result = node.transport.run(
        tmux.pane_pids(node.target.job) + "; true", timeout=30, step="wait_first_step"
    )
    return tmux.pane_problem(result.stdout)


def _log_tail(node: Node, log: str, lines: int = 20) -> str:
    if not log:
        return ""
    read = node.transport.run(
        f"tail -n {int(lines)} {shlex.quote(log)} | tail -c 20000", timeout=30, step="wait_first_step"
    )
    text = "\n    ".join(read.stdout.rstrip().splitlines())
    return f"\n  last lines of {log}:\n    {text}" if text else ""


def _all_or_none(ctx: JobContext, error: DflashOpsError, grace_s: float) -> StepFailed:
    """The failure of a launch or of its first step, after the job was stopped again on the nodes
    where it runs when it does not run on all: a partial job only waits at the rendezvous."""
    note = _no_half_job(ctx, ctx.nodes, grace_s)
    return StepFailed(f"{error}\n{note}" if note else str(error))


def _no_half_job(ctx: StepContext, nodes: Sequence[Node], grace_s: float) -> str:
    """When the job runs on some nodes but not all, stop it on those; what was done."""
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
        each(ctx, alive, lambda node, c: steps.stop_session(c, node.target.job, grace_s=grace_s))
    except DflashOpsError as exc:
        where = ", ".join(n.label for n in alive)
        return f"the job still runs on {where}; stopping it failed: {first_lines(exc)}"
    return (
        f"stopped the job again on {', '.join(n.label for n in alive)}: a job runs on all its nodes or none "
        "(`dflash-ops status` shows each node)"
    )


def auto_relaunch(jc: JobChecked) -> commands.HealthAction | None:
    """Relaunch the WHOLE job when it is CRITICAL, at most max_relaunches_per_hour (node 0's);
    its checks run on every node first, so a node that cannot take part relaunches nothing."""
    return commands.relaunch_when_critical(
        jc.verdict.level,
        f"multinode-{jc.job.name}",
        jc.job.nodes[0].job.health.max_relaunches_per_hour,
        lambda on_locked: relaunch(jc.job, on_locked=on_locked),
        "auto-relaunch of every node",
    )
