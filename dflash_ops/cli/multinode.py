"""The commands that take a multinode job's name (-t JOB): relaunch, stop, status, health and
tail-log act on every node of it as one job. The command modules call `job_named` first."""

from __future__ import annotations

from dflash_ops.errors import InputError
from dflash_ops.cli.group import Obj, one_target


def job_named(obj: Obj, target: str | None, node: str | None = None):
    """The multinode job `target` names, or None; `--node` belongs to a multinode job only."""
    job = obj.inventory.multinode.get(target) if target is not None else None
    if job is None and node is not None:
        raise InputError(
            f"--node {node}: applies to a multinode job (-t JOB); {target or 'the default target'} is not one"
        )
    return job


def node_or_target(obj: Obj, target: str | None, node: str | None):
    """What a command that reads one machine's files acts on: a multinode job's node (`--node`, default
    node 0) or the one target named."""
    job = job_named(obj, target, node)
    return job.node_named(node) if job is not None else one_target(obj, target)
