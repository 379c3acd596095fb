"""Commands about the tool's own setup: targets, playbook list/run, cron."""

from __future__ import annotations

import os
import sys

import click

from dflash_ops.errors import InputError
from dflash_ops.inventory import load as inventory_lib
from dflash_ops.cli.group import acting_options, cli, target_option
from dflash_ops.cli.jobs import run_each


@cli.command()
@click.pass_obj
def targets(obj):
    """List the inventory's targets (* marks the default)."""
    click.echo(f"inventory: {obj.inventory.source or 'built-in (no file found)'}")
    for line in inventory_lib.describe(obj.inventory):
        click.echo(line)
    for name, members in obj.inventory.groups.items():
        click.echo(f"  group {name}: {', '.join(members)}")


@cli.group("playbook")
def playbook_group():
    """List or run your playbooks (library steps in YAML; see playbooks/README.md)."""


@playbook_group.command("list")
@click.pass_obj
def playbook_list(obj):
    """Show your playbooks and the steps they may use."""
    from dflash_ops.act import library
    from dflash_ops.playbook import signature, user

    for name, path in user.list_playbooks(obj.search_dirs()).items():
        click.echo(f"{name:14} {path}")
    click.echo("\nsteps:")
    for name, step in library.LIBRARY.items():
        click.echo(f"  {signature.describe(name, step)}")


@playbook_group.command("run")
@click.argument("name")
@acting_options
@click.option("--set", "assignments", multiple=True, metavar="OPTION=VALUE", help="Set a playbook option.")
@click.pass_obj
def playbook_run(obj, name, target, dry_run, assignments):
    """Run the playbook NAME (a name from `playbook list`, or a path)."""
    from dflash_ops import commands
    from dflash_ops.act import library
    from dflash_ops.playbook import user

    targets = obj.targets(target)  # an unknown target is refused before the file is read
    book = user.load(name, obj.search_dirs(), library.LIBRARY)
    options = user.bind_options(book, library.LIBRARY, user.parse_option_assignments(assignments))

    def act(tgt, show):
        return commands.run_playbook(tgt, book, options, dry_run=dry_run, on_progress=show)

    sys.exit(run_each(targets, book.name, book.source, act))


@cli.group("cron")
def cron_group():
    """Manage the crontab lines that run `dflash-ops health` (and `metrics`) for a target."""


@cron_group.command("install")
@target_option
@click.option("--schedule", default="*/5 * * * *", show_default=True, help="Cron schedule (5 fields).")
@click.option("--auto-relaunch", is_flag=True, help="Let the health check relaunch on CRITICAL.")
@click.option(
    "--log",
    "log_path",
    default="~/.local/state/dflash-ops/health.log",
    show_default=True,
    help="File the health output is appended to.",
)
@click.option(
    "--metrics",
    "metrics_dir",
    metavar="DIR",
    help="Install (or replace) the line that writes `dflash-ops metrics` into DIR (node_exporter's "
    "textfile directory) instead of the health line.",
)
@click.pass_obj
def cron_install(obj, target, schedule, auto_relaunch, log_path, metrics_dir):
    """Install (or replace) the health-check line for the target (or its metrics line)."""
    from dflash_ops import cron

    name = target or obj.inventory.default_target
    obj.inventory.jobs(name)  # refuse unknown names before writing anything
    exe = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "dflash-ops" else None
    argv = [exe] if exe else [sys.executable, "-m", "dflash_ops"]
    if obj.inventory.source:
        argv += ["--inventory", os.path.abspath(obj.inventory.source)]
    tag = cron.TAG
    if metrics_dir is not None:
        if auto_relaunch:
            raise InputError("--auto-relaunch belongs to the health line; install it without --metrics")
        if not os.path.isdir(metrics_dir):
            raise InputError(
                f"--metrics {metrics_dir}: no such directory; give node_exporter's textfile directory"
            )
        argv += ["metrics", "--target", name, "--textfile-dir", os.path.abspath(metrics_dir)]
        tag = cron.METRICS_TAG
    else:
        argv += ["health", "--target", name] + (["--auto-relaunch"] if auto_relaunch else [])
    log_path = os.path.expanduser(log_path)
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    for line in cron.install(cron.health_line(schedule, argv, log_path, name, tag), name, tag):
        click.echo(line)


@cron_group.command("show")
@target_option
def cron_show(target):
    """Show our crontab lines."""
    from dflash_ops import cron

    for line in cron.ours(cron.read(), target):
        click.echo(line)


@cron_group.command("remove")
@target_option
def cron_remove(target):
    """Remove our crontab line(s) (for the target, or all of ours)."""
    from dflash_ops import cron

    gone = cron.remove(target)
    click.echo(f"removed {len(gone)} line(s)")
