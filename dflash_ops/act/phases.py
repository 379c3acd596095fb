"""The phases of a job that are more than one step on every node; on one node each is that node's step.
A launch or first step that fails leaves the job on all its nodes or none (`_all_or_none`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import secrets
import time
from typing import Any, Callable, TypeVar, cast

from dflash_ops.act import multinode_checks as checks, preflight as p, steps
from dflash_ops.act.context import StepContext, StepOutcome
from dflash_ops.act.nodes import JobContext, Node, Nodes, each, first_lines, on_nodes, one, one_node, per_node
from dflash_ops.act.runner import Run
from dflash_ops.errors import DflashOpsError, StepFailed
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.job import tmux
from dflash_ops.job.model import Job
from dflash_ops.remote import bundle, python_command

F = TypeVar("F", bound=Callable[..., Any])
UNTOUCHED = "nothing was stopped on any node"
_CHOOSE_RUN = "choose_run.py"
CROSS_NODE_CHECKS = ("same_job", "shared_runs_dir", "rendezvous")


def checks_plan(nodes: int) -> tuple[str, ...]:
    return ("preflight", *(CROSS_NODE_CHECKS if nodes > 1 else ()))


def free_gpus_plan(nodes: int) -> tuple[str, ...]:
    return ("kill_gpu_processes", "wait_gpu_free") if nodes == 1 else ("free_gpus",)


def check_before_stop(
    run: Run, job: Nodes, nodes: list[Node], *, deploy: bool, **preflight_options: Any
) -> None:
    """Every check, on every node, before anything stops anywhere (a failure halts the run)."""
    on_nodes(run, p.preflight, nodes, deploy=deploy, **preflight_options, note=f"\n{UNTOUCHED}")
    if not one_node(run):
        several = cast(MultinodeJob, job)
        found = run(same_job, several, deploy=deploy)
        run(shared_runs_dir, several)
        run(rendezvous, several, found)


def free_job_gpus(run: Run, nodes: list[Node], *, timeout_s: float, keep_going: bool = False) -> None:
    """End the job's leftover processes and wait for its GPUs, on every node."""
    if one_node(run):
        for node in nodes:
            ended = run(steps.kill_gpu_processes, node.target.job)
            run(steps.wait_gpu_free, node.target.job, ended, timeout_s=timeout_s)
    else:
        on_nodes(run, free_gpus, nodes, timeout_s=timeout_s, keep_going=keep_going)


def free_gpus(ctx: StepContext, job: Job, *, timeout_s: float) -> StepOutcome:
    """End leftover job processes, then wait for the GPUs; foreign processes are left alone."""
    ended = steps.kill_gpu_processes(ctx, job)
    waited = steps.wait_gpu_free(ctx, job, ended, timeout_s=timeout_s)
    return StepOutcome(f"{ended.message}; {waited.message}")


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
    return StepOutcome(checks.prove_shared(ctx, job))


@_before_any_stop
def rendezvous(ctx: JobContext, job: MultinodeJob, found: Found) -> StepOutcome:
    return StepOutcome(checks.rendezvous(ctx, job, found.facts))


def deploy(ctx: JobContext) -> StepOutcome:
    """The same trainer release deployed to every node, and current on each."""
    if len(ctx.nodes) == 1:
        return steps.deploy(ctx, ctx.target.job)
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
    """What launch gives on several nodes: the run, its rendezvous id and each node's launch."""

    run: str
    rdzv_id: str
    nodes: list[steps.Launched]


def launch(ctx: JobContext, job: Nodes, *, resume: bool, grace_s: float) -> StepOutcome:
    """Start the trainer; on several nodes the run is chosen once and a partial launch is stopped again."""
    if len(ctx.nodes) == 1:
        return steps.launch(ctx, ctx.target.job, resume=resume)
    return _all_or_none(ctx, grace_s, lambda: _launch(ctx, cast(MultinodeJob, job), resume))


def _launch(ctx: JobContext, job: MultinodeJob, resume: bool) -> JobLaunched:
    first = ctx.nodes[0]
    mode = "resume" if resume else "fresh"
    choose = python_command(first.target.job.python, _CHOOSE_RUN, {"runs": job.runs_dir, "resume": resume})
    chosen = one(ctx, first, lambda _node, c: c.run(choose, timeout=30, stdin=bundle(_CHOOSE_RUN)))
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
    node_target = job.node_target(node.index, rdzv_id)
    return steps.start_run(dataclasses.replace(ctx, target=node_target), node_target.job, run=run)


def wait_first_step(
    ctx: JobContext, launched: StepOutcome, *, timeout_s: float, grace_s: float
) -> StepOutcome:
    """The first training step: node 0's (a node whose trainer exits ends the wait), then the others'."""
    if len(ctx.nodes) == 1:
        return steps.wait_first_step(ctx, ctx.target.job, cast(steps.Launched, launched), timeout_s=timeout_s)
    return _all_or_none(ctx, grace_s, lambda: _wait_first_step(ctx, cast(JobLaunched, launched), timeout_s))


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
                    raise one(ctx, node, functools.partial(gone, why=why))

    def gone(node: Node, c: StepContext, why: str) -> StepFailed:
        return steps.no_first_step(c, logs[node.index].log, f"{node.label}: {why}")

    def wait(node: Node, c: StepContext, seconds: float) -> StepOutcome:
        return steps.wait_first_step(c, node.target.job, logs[node.index], timeout_s=seconds)

    began = time.monotonic()
    outcome = one(ctx, first, lambda node, c: wait(node, dataclasses.replace(c, status=watching), timeout_s))
    left = max(30.0, timeout_s - (time.monotonic() - began))
    rest = each(ctx, others, lambda node, c: wait(node, c, left).message)
    return StepOutcome(f"{outcome.message} (node 0)\n" + per_node(ctx.nodes, [outcome.message, *rest]))


def _pane_problem(node: Node) -> str | None:
    """Why the node's trainer is not running (its pane gone or dead), or None."""
    script = tmux.pane_pids(node.target.job) + "; true"
    return tmux.pane_problem(node.transport.run(script, timeout=30, step="wait_first_step").stdout)


def _all_or_none(ctx: JobContext, grace_s: float, phase: Callable[[], StepOutcome]) -> StepOutcome:
    """`phase`; failing on some nodes only, the job is stopped there (it would wait at the rendezvous)."""
    try:
        return phase()
    except DflashOpsError as error:
        alive = []
        for node in ctx.nodes:
            with contextlib.suppress(DflashOpsError):
                if _pane_problem(node) is None:
                    alive.append(node)
        if not alive or len(alive) == len(ctx.nodes):
            raise StepFailed(str(error)) from None
        where = ", ".join(n.label for n in alive)
        try:
            each(ctx, alive, lambda node, c: steps.stop_session(c, node.target.job, grace_s=grace_s))
        except DflashOpsError as exc:
            note = f"the job still runs on {where}; stopping it failed: {first_lines(exc)}"
        else:
            note = (
                f"stopped the job again on {where}: a job runs on all its nodes or none "
                "(`dflash-ops status` shows each node)"
            )
        raise StepFailed(f"{error}\n{note}") from None
