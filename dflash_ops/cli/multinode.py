"""The commands that take a multinode job's name (-t JOB): relaunch, stop, status, health and
tail-log act on every node of it as one job. The command modules call `job_named` first and hand
over when it finds one."""

from __future__ import annotations

import sys
import threading

import click

from dflash_ops.errors import DflashOpsError, InputError
from dflash_ops.cli.group import Obj, one_target


def job_named(obj: Obj, target: str | None, node: str | None = None):
    """The multinode job `target` names, or None; `--node` belongs to a multinode job only."""
    job = obj.inventory.multinode.get(target) if target is not None else None
    if job is None and node is not None:
        raise InputError(
            f"--node {node}: applies to a multinode job (-t JOB); {target or 'the default target'} is not one"
        )
    return job


def _printer():
    from dflash_ops.cli.progress_view import ProgressPrinter

    lock = threading.Lock()
    printer = ProgressPrinter(lambda text: click.echo(text, nl=False), is_tty=sys.stdout.isatty())

    def show(progress) -> None:
        with lock:
            try:
                printer(progress)
            except BrokenPipeError:
                pass

    return show


def _finish(command: str, job, run) -> int:
    try:
        result = run()
    except DflashOpsError as exc:  # a lock held elsewhere, a node that cannot be reached at all
        click.echo(f"[{job.name}] {command}: {exc}", err=True)
        return exc.exit_code
    click.echo(result.summary(), err=not result.ok)
    return result.exit_code


def run_whole_job(job, name: str, dry_run: bool, given: dict) -> int:
    """`relaunch` or `stop` (`name`) of a multinode job on every node at once, as one job; `given`
    holds the options set (the others take the command's defaults)."""
    from dflash_ops.commands import multinode

    command = {"relaunch": multinode.relaunch, "stop": multinode.stop}[name]
    click.echo(f"{name}: multinode job {job.name} on {', '.join(n.name for n in job.nodes)}")
    return _finish(name, job, lambda: command(job, dry_run=dry_run, on_progress=_printer(), **given))


def node_or_target(obj: Obj, target: str | None, node: str | None):
    """What a command that reads one machine's files acts on: a multinode job's node (`--node`, default
    node 0) or the one target named."""
    from dflash_ops.observe import multinode as multinode_status

    job = job_named(obj, target, node)
    return multinode_status.node_target(job, node) if job is not None else one_target(obj, target)
