"""Cross-node checks a multinode relaunch runs before anything stops: same software and config, one
shared runs dir, every address reachable. Each failure names the node, the check and the fix."""

from __future__ import annotations

import functools
import json
import secrets
from typing import Sequence

from dflash_ops.job import jobpaths
from dflash_ops.errors import StepFailed
from dflash_ops.job.model import Job
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.act.nodes import JobContext, Node, each, each_outcome, one, per_node
from dflash_ops.act.context import StepContext
from dflash_ops.remote import bundle, python_command, shell_command

FACTS = "multinode_facts.py"
CONNECT_TIMEOUT_S = 5.0
REACHABLE = ("open", "refused")  # a connection, or the host's own refusal, proves it reachable
SHARED_PREFIX = ".dflash-ops-shared-"
LISTENING = " (something listens there now: this job's torchrun, which the stop ends, or another program)"


def facts(ctx: StepContext, job: Job, connect: Sequence[tuple[str, int]] = ()) -> dict:
    """What the node would run, and its TCP connects to `connect` (dry-run: nothing is known)."""
    args: dict[str, object] = {
        "current": jobpaths.current_release(job),
        "config": job.config if job.config.startswith("/") else "",
        "connect": [[host, port] for host, port in connect],
        "timeout_s": CONNECT_TIMEOUT_S,
    }
    script = python_command(job.python, FACTS, args, who="dflash multinode check")
    result = ctx.run(script, timeout=60 + CONNECT_TIMEOUT_S * len(connect), stdin=bundle(FACTS))
    if ctx.dry_run:
        return {"connect": []}
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError, RecursionError):
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("connect"), list):
        raise StepFailed(
            f"[{ctx.target_name}] {ctx.step}: no readable answer: {result.stdout.strip()[:200]!r}"
        )
    return answer


def same_job(job: MultinodeJob, nodes: Sequence[Node], found: list[dict], deploy: bool) -> str:
    """Every node runs the same python, torch, config and (without a deploy) trainer release."""
    first = found[0]
    checks = [
        ("python", "python", "install the same python on every node"),
        ("torch", "torch", "install the same torch version into every node's python"),
    ]
    if job.nodes[0].job.config.startswith("/"):
        checks.append(
            ("config_sha256", f"config {job.nodes[0].job.config}", "copy the same config file to every node")
        )
    if not deploy:
        checks.append(
            ("release", "trainer release", "deploy (drop --no-deploy) so every node gets the same one")
        )
    for key, what, fix in checks:
        if key == "release" and not first.get(key):
            raise StepFailed(f"[{nodes[0].name}] same_job: {nodes[0].label} has no trainer release; {fix}")
        if key == "config_sha256" and not _is_digest(first.get(key)):
            raise StepFailed(
                f"[{nodes[0].name}] same_job: {nodes[0].label}: {what} is {first.get(key)}; {fix}"
            )
        for node, theirs in zip(nodes[1:], found[1:], strict=True):
            if theirs.get(key) != first.get(key):
                raise StepFailed(
                    f"[{node.name}] same_job: {node.label} has {what} {_short(theirs.get(key))} but "
                    f"{nodes[0].label} has {_short(first.get(key))}; {fix}"
                )
    release = f", release {first['release']}" if not deploy else ""
    return f"{first['python']}, torch {first['torch']}{release} on every node; " + ", ".join(
        f"{node.label} is {answer.get('hostname')}" for node, answer in zip(nodes, found, strict=True)
    )


def _is_digest(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _short(value) -> str:
    if _is_digest(value):
        return f"sha256 {value[:12]}"
    return repr(value) if value is None else str(value)


def prove_shared(ctx: JobContext, job: MultinodeJob) -> str:
    """Tokens written on one node and read on the others prove the runs dir shared and writable everywhere."""
    nodes = ctx.nodes
    token = secrets.token_hex(16)
    names = {node.index: f"{SHARED_PREFIX}{token}-{node.index}" for node in nodes}
    first, others = nodes[0], nodes[1:]
    unshared = (
        f"{job.runs_dir} is not one shared filesystem: mount the same shared storage (NFS, CephFS, "
        f"Lustre...) at {job.runs_dir} on every node; rank 0 writes the checkpoints there and a resume "
        "on nodes that see different runs would start them at different steps"
    )

    def run(node_ctx: StepContext, *args: str, check: bool = True):
        return node_ctx.run(shell_command("shared_dir.sh", *args), timeout=30, check=check)

    def write(node: Node, node_ctx: StepContext) -> None:
        run(node_ctx, "write", job.runs_dir, names[node.index], f"{token}-{node.index}")

    def read(writer: Node, node: Node, node_ctx: StepContext) -> None:
        """`node` reads the file `writer` wrote."""
        got = run(node_ctx, "read", job.runs_dir, names[writer.index], check=False)
        if node_ctx.dry_run:
            return
        seen = got.stdout if got.ok else (got.stderr.strip() or got.stdout.strip() or f"exit {got.exit_code}")
        if not got.ok or got.stdout != f"{token}-{writer.index}":
            raise StepFailed(
                f"[{node.name}] shared_runs_dir: {node.label} does not see the file {writer.label} wrote "
                f"in {job.runs_dir} ({seen[:200]}): {unshared}"
            )

    try:
        one(ctx, first, write)
        each(ctx, others, functools.partial(read, first))
        each(ctx, others, write)
        for writer in others:
            one(ctx, first, functools.partial(read, writer))
    finally:  # cleanup: what a node says here is not the check's result (each_outcome never raises)
        each_outcome(
            ctx, nodes, lambda _node, c: run(c, "remove", job.runs_dir, *names.values(), check=False)
        )
    if ctx.dry_run:
        return f"would prove {job.runs_dir} shared (every node reads what the others write there)"
    return f"{job.runs_dir}: every node read the files the others wrote there"


def rendezvous(ctx: JobContext, job: MultinodeJob, found: list[dict]) -> str:
    """Every node reaches the rendezvous and each other node's own address (the ranks meet at the latter)."""
    nodes = ctx.nodes

    def check(node: Node, node_ctx: StepContext) -> str:
        wanted = [(job.rdzv_host, job.rdzv_port)] + [
            (str(answer.get("fqdn")), job.rdzv_port)
            for other, answer in zip(nodes, found, strict=True)
            if other.index != node.index and answer.get("fqdn")
        ]
        answer = facts(node_ctx, node.target.job, wanted)
        if node_ctx.dry_run:
            return "would connect to " + ", ".join(f"{host}:{port}" for host, port in wanted)
        said = []
        for i, ((host, _), reached) in enumerate(zip(wanted, answer["connect"], strict=False)):
            result = reached.get("result")
            if result not in REACHABLE:
                if i == 0:
                    whose = f"the rendezvous endpoint {job.endpoint}"
                    fix = "fix rdzv_host/rdzv_port, the network or the firewall"
                else:
                    whose = f"the address {host!r} another node advertises to torchrun"
                    fix = "make that name resolve and route from every node (DNS or /etc/hosts)"
                raise StepFailed(
                    f"[{node.name}] rendezvous: {node.label} cannot reach {whose}: {result}, "
                    f"{reached.get('detail')}; {fix}"
                )
            said.append(f"{host} {result}" + (LISTENING if i == 0 and result == "open" else ""))
        return ", ".join(said)

    messages = each(ctx, nodes, check)
    reached = "would be checked" if ctx.dry_run else "reachable"
    return f"{job.endpoint} {reached} from every node\n" + per_node(nodes, messages)
