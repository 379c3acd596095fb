"""The inventory's `multinode:` section: one torchrun job across several targets.

    multinode:
      pair:
        nodes: [gpu-a, gpu-b]          # node i = position i; each a `launcher: torchrun` target
        runs_dir: /mnt/shared/dflash/runs   # the SAME shared filesystem on every node (checkpoints)
        rdzv_port: 29400               # default 29400
        rdzv_host: 10.0.0.7            # default: the first node's ssh host

Every node runs the same job; anything else is refused in one FILE:LINE line."""

from __future__ import annotations

import dataclasses

from trainer.launchers import TORCHRUN
from trainer.typed_yaml import kind_of, show

from dflash_ops.job import cache_guard, jobpaths
from dflash_ops.errors import InputError
from dflash_ops.inventory.layers import Where, check_name, unknown_field
from dflash_ops.inventory.rules import Bad, host_rule, path_rule, whole_rule
from dflash_ops.job.model import Job, Target
from dflash_ops.inventory.strict_yaml import YamlMap

KEY = "multinode"
DEFAULT_RDZV_PORT = 29400
FIELDS = ("nodes", "runs_dir", "rdzv_port", "rdzv_host")
EXAMPLE = "pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/shared/dflash/runs}"
# What every node must agree on, and how a mismatch is fixed.
SAME = (
    ("nproc_per_node", "ranks per node"),
    ("python", "python"),
    ("config", "config"),
    ("train_args", "train_args"),
)


@dataclasses.dataclass(frozen=True)
class NodeJob(Job):
    """A node's part of a multinode job: its target's job plus nnodes, rendezvous and the shared runs dir."""

    rdzv_id: str = ""  # torchrun --rdzv-id: one per launch of the job, the same on every node
    runs_dir: str = ""  # the runs dir every node shares


@dataclasses.dataclass(frozen=True)
class MultinodeJob:
    name: str
    nodes: tuple[Target, ...]  # node i is nodes[i]
    runs_dir: str  # on a filesystem every node mounts at this path
    rdzv_host: str
    rdzv_port: int = DEFAULT_RDZV_PORT

    @property
    def endpoint(self) -> str:
        host = f"[{self.rdzv_host}]" if ":" in self.rdzv_host else self.rdzv_host
        return f"{host}:{self.rdzv_port}"

    @property
    def world_size(self) -> int:
        return sum(node.job.nproc_per_node for node in self.nodes)

    def node_job(self, index: int, rdzv_id: str = "") -> NodeJob:
        job = self.nodes[index].job
        fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(Job)}
        fields.update(nnodes=len(self.nodes), rdzv_endpoint=self.endpoint)
        return NodeJob(**fields, rdzv_id=rdzv_id, runs_dir=self.runs_dir)

    def node_target(self, index: int, rdzv_id: str = "") -> Target:
        return dataclasses.replace(self.nodes[index], job=self.node_job(index, rdzv_id))

    def node_targets(self, rdzv_id: str = "") -> list[Target]:
        return [self.node_target(i, rdzv_id) for i in range(len(self.nodes))]

    def node_named(self, node: str | None) -> Target:
        """The node `--node NAME|INDEX` names (default node 0) as a target running its part of the job."""
        names = [n.name for n in self.nodes]
        if node is None:
            return self.node_target(0)
        if node in names:
            return self.node_target(names.index(node))
        if node.isdigit() and int(node) < len(names):
            return self.node_target(int(node))
        raise InputError(
            f"--node {node}: not a node of {self.name} (nodes: {', '.join(names)}, or 0-{len(names) - 1})"
        )


def parse(
    raw: object, line: int, targets: dict[str, Target], groups: dict, filename: str
) -> dict[str, MultinodeJob]:
    """The `multinode:` section (None when absent) checked against the targets it names."""
    top = Where(filename)
    if raw is None:
        return {}
    if not isinstance(raw, YamlMap):
        raise top.error(line, KEY, f"expected a mapping like {{{EXAMPLE}}}, got {kind_of(raw)}")
    jobs = {}
    for name, spec in raw.items():
        job_line = raw.key_lines.get(name, raw.line)
        check_name(name, "multinode job", top, job_line)
        where = Where(filename, f"multinode {name!r}")
        if name in targets or name in groups:
            kind = "target" if name in targets else "group"
            raise where.error(job_line, None, f"{name!r} is also a {kind} name; give the job another name")
        jobs[name] = _job(name, spec, job_line, targets, where)
    return jobs


def _job(name: str, spec: object, line: int, targets: dict[str, Target], where: Where) -> MultinodeJob:
    if not isinstance(spec, YamlMap):
        raise where.error(
            line, None, f"expected a mapping like {EXAMPLE.split(': ', 1)[1]}, got {kind_of(spec)}"
        )
    lines = {key: spec.key_lines.get(key, line) for key in spec}
    for key in spec:
        if key not in FIELDS:
            raise where.error(lines[key], str(key), unknown_field(key, FIELDS, "multinode."))

    def rule(key, check):
        try:
            return check(spec[key])
        except Bad as exc:
            raise where.error(lines[key], key, str(exc)) from None

    examples = {
        "nodes": "[gpu-a, gpu-b]",
        "runs_dir": "/mnt/shared/dflash/runs (the same filesystem on every node)",
    }
    for key, example in examples.items():
        if key not in spec:
            raise where.error(line, key, f"is required, e.g. {key}: {example}")
    nodes = _nodes(spec["nodes"], lines["nodes"], targets, where)
    runs_dir = rule("runs_dir", path_rule).rstrip("/") or "/"
    if not runs_dir.startswith("/"):
        raise where.error(
            lines["runs_dir"], "runs_dir", f"must be an absolute path on every node, got {show(runs_dir)}"
        )
    port = rule("rdzv_port", whole_rule(1, 65535, "29400")) if "rdzv_port" in spec else DEFAULT_RDZV_PORT
    if "rdzv_host" in spec:
        host = rule("rdzv_host", host_rule)
    elif nodes[0].transport == "ssh" and nodes[0].ssh is not None:
        host = nodes[0].ssh.host
    else:
        kind = "a pct" if nodes[0].transport == "pct" else "the local"
        raise where.error(
            line,
            "rdzv_host",
            f"is required: the first node {nodes[0].name!r} is {kind} target, so its address as the "
            "other nodes reach it is not known; give it, e.g. rdzv_host: 10.0.0.7",
        )
    # the shared runs dir holds every run's checkpoints: no node's purged cache may touch it
    for node in nodes:
        why = cache_guard.problem(node.job.cache_dir, [(runs_dir, "shared runs_dir", True)])
        if why is not None:
            raise where.error(
                lines["runs_dir"],
                "runs_dir",
                f"target {node.name!r}'s cache_dir {node.job.cache_dir} {why} and is purged on relaunch; "
                "give the runs and the cache directories of their own",
            )
    return MultinodeJob(name=name, nodes=nodes, runs_dir=runs_dir, rdzv_host=host, rdzv_port=port)


def _nodes(value: object, line: int, targets: dict[str, Target], where: Where) -> tuple[Target, ...]:
    def bad(problem: str) -> InputError:
        return where.error(line, "nodes", problem)

    if not isinstance(value, list) or len(value) < 2:
        got = f"{len(value)} node" if isinstance(value, list) else kind_of(value)
        raise bad(f"expected a list of at least two target names like [gpu-a, gpu-b], got {got}")
    nodes: list[Target] = []
    for name in value:
        if not isinstance(name, str) or name not in targets:
            raise bad(f"names unknown target {show(name)}; known targets: {', '.join(targets)}")
        if value.count(name) > 1:
            raise bad(f"lists target {name!r} twice; a target is one node")
        nodes.append(targets[name])
    for node in nodes:
        job = node.job
        if job.launcher != TORCHRUN:
            raise bad(
                f"target {node.name!r} runs launcher {job.launcher}; every node must be a torchrun "
                "target: give it job: {launcher: torchrun, nproc_per_node: N}"
            )
        if job.nnodes != 1 or job.rdzv_endpoint:
            raise bad(
                f"target {node.name!r} sets job.nnodes/rdzv_endpoint itself; this section sets them "
                "for all its nodes: remove them from the target"
            )
    first = nodes[0]
    for node in nodes[1:]:
        for field, what in SAME:
            mine, theirs = getattr(node.job, field), getattr(first.job, field)
            if mine != theirs:
                raise bad(
                    f"target {node.name!r} has job.{field} {_shown(mine)} but the first node "
                    f"{first.name!r} has {_shown(theirs)}; every node runs the same job: give every "
                    f"node the same {what}"
                )
    for i, node in enumerate(nodes):
        for other in nodes[:i]:
            same_job = jobpaths.marker_value(node.job) == jobpaths.marker_value(other.job)
            if _machine(node) == _machine(other) and same_job:
                raise bad(
                    f"targets {other.name!r} and {node.name!r} are the same machine with the same tmux "
                    f"socket and session ({jobpaths.marker_value(node.job)}), so they would end each "
                    "other's processes; give one of them another job.tmux_socket or job.session"
                )
    return tuple(nodes)


def _shown(value) -> str:
    return show(list(value)) if isinstance(value, tuple) else show(value)


def _machine(target: Target) -> tuple | None:
    return None if target.ssh is None else (target.ssh.host, target.ssh.port, target.ctid)
