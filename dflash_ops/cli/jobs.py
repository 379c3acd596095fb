"""Commands that act on the job; each is a function of dflash_ops.commands, whose defaults are read."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable

import click

from dflash_ops import commands
from dflash_ops.errors import InputError
from dflash_ops.cli.group import Obj, acting_options, cli, command_flag, grace_option, one_target


def default(command: Callable, option: str) -> str:
    """`(default 30)`: the command's own default, for --help."""
    return f"(default {commands.default_of(command, option):g})"


def run_each(jobs: list, name: str, source: str, act: Callable[[Any, Callable], Any]) -> int:
    """`act(job, on_progress)` on each job in parallel, one summary each; the exit code is the worst."""
    from dflash_ops.transport.fanout import fan_out
    from dflash_ops.cli.progress_view import ProgressPrinter

    lock = threading.Lock()
    printer = ProgressPrinter(
        lambda text: click.echo(text, nl=False), is_tty=sys.stdout.isatty(), with_target=len(jobs) > 1
    )

    def show(progress):
        with lock:
            # the reader left (`| head`): the command still runs to its end, silently
            with contextlib.suppress(BrokenPipeError):
                printer(progress)

    click.echo(f"{name}: ran {source}")
    code = 0
    for outcome in fan_out(jobs, lambda t: act(t, show)):
        if outcome.error is not None:
            click.echo(f"[{outcome.target.name}] {name}: {outcome.error}", err=True)
            code = max(code, getattr(outcome.error, "exit_code", 1))
        else:
            click.echo(outcome.value.summary(), err=not outcome.value.ok)
            code = max(code, outcome.value.exit_code)
    return code


def run_command(obj: Obj, target_name, command: Callable, dry_run: bool, **options) -> int:
    """Run a dflash_ops.commands function on each job -t names (a rollback takes targets: a release is one
    target's); options left None take its defaults."""
    given = {k: v for k, v in options.items() if v is not None}
    name = command.__name__.replace("_", "-")
    jobs = obj.targets(target_name) if command is commands.rollback else obj.inventory.jobs(target_name)
    ends_processes = command in (commands.relaunch, commands.stop, commands.gpu_clean)
    for job in jobs if ends_processes and not dry_run else ():
        node = obj.inventory.node_of(job.name)
        if node is not None:
            raise InputError(f"{name}: {node}")

    def act(job, show):
        return command(job, dry_run=dry_run, on_progress=show, **given)

    return run_each(jobs, name, f"{command.__module__}.{command.__name__}", act)


@cli.command()
@acting_options
@command_flag("--no-purge", "purge", False, "Keep the inductor/triton compile cache.")
@command_flag("--no-deploy", "deploy", False, "Launch the trainer release that is already current.")
@command_flag("--fresh", "resume", False, "Start a new run (runs/NNNN/); earlier runs' checkpoints are kept.")
@command_flag(
    "--allow-shared-gpus", "allow_shared_gpus", True, "Launch although foreign processes use the job's GPUs."
)
@click.option(
    "--first-step-timeout",
    "--timeout",
    "timeout",
    type=click.FloatRange(min=1),
    default=None,
    metavar="S",
    help=f"Seconds to wait for the first training step {default(commands.relaunch, 'timeout')}.",
)
@grace_option(f"Seconds between SIGTERM and SIGKILL when stopping {default(commands.relaunch, 'grace')}.")
@click.pass_obj
def relaunch(obj, target, dry_run, **options):
    """Check, stop, clean the GPUs, purge the compile cache, deploy, launch in tmux, confirm step 1.

    Safe to run twice in a row. The checks (python imports torch, release, GPU query, no foreign
    GPU process, free disk) run before anything is stopped. It resumes the newest run, or starts
    a new one when that run finished; it clears a `stop`.

    \b
    Example:
      $ dflash-ops relaunch -t gpu-box
      [1/8] preflight ... ok (4.7s) torch 2.11.0+cu130; 64 GiB free; GPUs 0 answer
      ...
      [8/8] wait_first_step ... ok (36.6s) step 12: loss 5.7298, 22.7 Ktok/s
    """
    sys.exit(run_command(obj, target, commands.relaunch, dry_run, **options))


@cli.command()
@acting_options
@grace_option(f"Seconds between SIGTERM and SIGKILL {default(commands.stop, 'grace')}.")
@click.pass_obj
def stop(obj, target, dry_run, grace):
    """Stop the job: SIGTERM its processes (it checkpoints), SIGKILL after the grace period,
    remove the tmux session, record the stop (health then reports OK and never relaunches it
    until the next relaunch), end leftover GPU processes, wait for them to leave the GPUs."""
    sys.exit(run_command(obj, target, commands.stop, dry_run, grace=grace))


@cli.command("gpu-clean")
@acting_options
@command_flag("--force", "force", True, "Also while the job runs: this ends the running trainer.")
@click.pass_obj
def gpu_clean(obj, target, dry_run, force):
    """End every process of this job (its tmux tree and anything carrying its DFLASH_OPS_JOB
    marker, the trainer included) and wait until they left its GPUs; processes that are not the
    job's are reported, never signalled. Refuses while the job runs unless --force."""
    sys.exit(run_command(obj, target, commands.gpu_clean, dry_run, force=force))


@cli.command("purge-cache")
@acting_options
@click.pass_obj
def purge_cache(obj, target, dry_run):
    """Remove the job's inductor/triton compile cache: only a dir holding the marker the launcher
    put there; refuses while any process of the job lives."""
    sys.exit(run_command(obj, target, commands.purge_cache, dry_run))


@cli.command()
@acting_options
@click.option(
    "--rollback",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[RELEASE]",
    help="Switch `current` to RELEASE (from --list), or to the one deployed before it.",
)
@click.option("--list", "list_", is_flag=True, help="Show the releases kept on the target.")
@click.pass_obj
def deploy(obj, target, dry_run, rollback, list_):
    """Deploy the bundled trainer as a versioned release (checksum, atomic `current` switch)."""
    from dflash_ops.act import deploy as deploy_lib

    if list_:
        if rollback is not None:
            raise InputError("--list and --rollback: give one of them")
        for line in deploy_lib.format_list(deploy_lib.list_releases(one_target(obj, target))):
            click.echo(line)
        return
    if rollback is None:
        sys.exit(run_command(obj, target, commands.deploy, dry_run))
    if rollback:
        deploy_lib.check_release_id(rollback, "--rollback")
    if not dry_run:
        for tgt in obj.targets(target):
            deploy_lib.require_kept_release(tgt, rollback or None)
    sys.exit(run_command(obj, target, commands.rollback, dry_run, release=rollback or None))
