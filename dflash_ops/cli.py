"""dflash-ops: a thin click layer over dflash_ops.ops. Every command takes --target NAME|GROUP;
a group fans out in parallel, one result per target, and the exit code is the worst."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import click

from . import (
    budget,
    cron,
    deploy as deploy_lib,
    health,
    inventory as inventory_lib,
    ops,
    playbook,
    status as status_lib,
)
from .errors import DflashOpsError, InputError
from .fanout import fan_out
from .progress_view import ProgressPrinter

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Obj:
    def __init__(self, inventory_path: str | None, playbook_dir: str | None):
        self.inventory_path = inventory_path
        self.playbook_dir = playbook_dir
        self._inventory = None

    @property
    def inventory(self):
        if self._inventory is None:
            self._inventory = inventory_lib.load_inventory(self.inventory_path)
        return self._inventory

    def targets(self, name):
        return self.inventory.resolve(name)

    def search_dirs(self):
        return playbook.playbook_search_dirs(self.playbook_dir, self.inventory.source)


def target_option(f):
    return click.option(
        "-t",
        "--target",
        "target",
        envvar="DFLASH_OPS_TARGET",
        default=None,
        metavar="NAME|GROUP",
        help="Target or group from the inventory (default: the inventory's default_target, else `local`).",
    )(f)


@click.group(context_settings=CONTEXT)
@click.option(
    "--inventory",
    "inventory_path",
    envvar=inventory_lib.ENV_VAR,
    metavar="PATH",
    help=f"Inventory file (default: ${inventory_lib.ENV_VAR}, ./inventory.yaml, "
    "~/.config/dflash-ops/inventory.yaml, else only the built-in `local` target).",
)
@click.option(
    "--playbook-dir",
    envvar="DFLASH_OPS_PLAYBOOKS",
    metavar="DIR",
    help="Extra directory searched first for playbooks.",
)
@click.version_option(package_name="dflash-ops")
@click.pass_context
def cli(ctx, inventory_path, playbook_dir):
    """Run and babysit DFlash drafter training on a GPU box: local, over ssh, or in a Proxmox
    LXC container (ssh to the host, then `pct exec`)."""
    ctx.obj = Obj(inventory_path, playbook_dir)


# ------------------------------------------------------------------ playbook-backed commands


def _run_book(obj: Obj, target_name, book: str, options: dict, dry_run: bool, runner=ops.run_playbook) -> int:
    targets = obj.targets(target_name)
    many = len(targets) > 1
    lock = threading.Lock()

    printer = ProgressPrinter(
        lambda text: click.echo(text, nl=False), is_tty=sys.stdout.isatty(), with_target=many
    )

    def show(progress):
        with lock:
            printer(progress)

    dirs = obj.search_dirs()
    # Validate once before any target is touched: a bad playbook or option is exit 2 for all.
    loaded = ops.load_book(book, dirs, options)
    playbook.bind_options(loaded.playbook, {k: v for k, v in options.items() if v is not None})
    for warning in loaded.warnings:
        click.echo(warning, err=True)
    click.echo(f"{book}: {loaded.describe()}")
    outcomes = fan_out(targets, lambda t: runner(t, book, options, dry_run, show, dirs))
    code = 0
    for outcome in outcomes:
        if outcome.error is not None:
            click.echo(f"[{outcome.target.name}] {book}: {outcome.error}", err=True)
            code = max(code, getattr(outcome.error, "exit_code", 1))
        else:
            click.echo(outcome.value.summary(), err=not outcome.value.ok)
            code = max(code, outcome.value.exit_code)
    return code


def dry_run_option(f):
    return click.option("--dry-run", is_flag=True, help="Print every exact remote command; touch nothing.")(f)


@cli.command()
@target_option
@dry_run_option
@click.option("--no-purge", is_flag=True, help="Keep the inductor/triton compile cache.")
@click.option("--no-deploy", is_flag=True, help="Launch the trainer release that is already current.")
@click.option(
    "--fresh", is_flag=True, help="Start a new run (runs/NNNN/); earlier runs' checkpoints are kept."
)
@click.option(
    "--allow-shared-gpus", is_flag=True, help="Launch although foreign processes use the job's GPUs."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=None,
    metavar="S",
    help="Seconds to wait for the first training step (default 900).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    metavar="S",
    help="Seconds between SIGTERM and SIGKILL when stopping (default 30).",
)
@click.pass_obj
def relaunch(obj, target, dry_run, no_purge, no_deploy, fresh, allow_shared_gpus, timeout, grace):
    """Check, stop, clean the GPUs, purge the compile cache, deploy, launch in tmux, confirm step 1.

    Runs playbooks/relaunch.yaml; safe to run twice in a row. The checks (python imports torch,
    release, GPU query, no foreign GPU process, free disk) run before anything is stopped. It
    resumes the newest run, or starts a new one when that run finished; it clears a `stop`.

    \b
    Example:
      $ dflash-ops relaunch -t gpu-box
      [1/7] stop_session ... ok (3.1s) ended 4 process(es): 4 on SIGTERM, 0 needed SIGKILL
      ...
      [7/7] wait_first_step ... ok (41.0s) step 1: loss 11.9310, 52.4 Ktok/s
    """
    options = {
        "purge": False if no_purge else None,
        "deploy": False if no_deploy else None,
        "resume": False if fresh else None,
        "timeout": timeout,
        "grace": grace,
        "allow_shared_gpus": True if allow_shared_gpus else None,
    }
    sys.exit(_run_book(obj, target, "relaunch", options, dry_run))


@cli.command()
@target_option
@dry_run_option
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    metavar="S",
    help="Seconds between SIGTERM and SIGKILL (default 30).",
)
@click.pass_obj
def stop(obj, target, dry_run, grace):
    """Stop the job: SIGTERM its processes (it checkpoints), SIGKILL after the grace period,
    remove the tmux session, record the stop (health then reports OK and never relaunches it
    until the next relaunch), end leftover GPU processes, wait for them to leave the GPUs."""
    sys.exit(_run_book(obj, target, "stop", {"grace": grace}, dry_run, runner=ops.stop_job))


@cli.command("gpu-clean")
@target_option
@dry_run_option
@click.option("--force", is_flag=True, help="Also while the job runs: this ends the running trainer.")
@click.pass_obj
def gpu_clean(obj, target, dry_run, force):
    """End every process of this job (its tmux tree and anything carrying its DFLASH_OPS_JOB
    marker, the trainer included) and wait until they left its GPUs; processes that are not the
    job's are reported, never signalled. Refuses while the job runs unless --force."""
    sys.exit(_run_book(obj, target, "gpu-clean", {"force": True if force else None}, dry_run))


@cli.command("purge-cache")
@target_option
@dry_run_option
@click.pass_obj
def purge_cache(obj, target, dry_run):
    """Remove the job's inductor/triton compile cache: only a dir holding the marker the launcher
    put there; refuses while any process of the job lives."""
    sys.exit(_run_book(obj, target, "purge-cache", {}, dry_run))


@cli.command()
@target_option
@dry_run_option
@click.option(
    "--rollback",
    "rollback",
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
    if list_:
        if rollback is not None:
            raise InputError("--list and --rollback: give one of them")
        for line in deploy_lib.format_list(ops.list_releases(_one_target(obj, target))):
            click.echo(line)
        return
    if rollback is None:
        sys.exit(_run_book(obj, target, "deploy", {}, dry_run))
    if rollback:
        deploy_lib.check_release_id(rollback)
    sys.exit(_run_book(obj, target, "rollback", {"release": rollback or deploy_lib.PREVIOUS}, dry_run))


@cli.group("playbook")
def playbook_group():
    """List or run playbooks (ordered steps in playbooks/*.yaml)."""


@playbook_group.command("list")
@click.pass_obj
def playbook_list(obj):
    """Show the playbooks found and the steps they may use."""
    for name, path in playbook.list_playbooks(obj.search_dirs()).items():
        click.echo(f"{name:14} {path}")
    click.echo("\nsteps: " + ", ".join(spec.signature() for spec in ops.steps.registry))


@playbook_group.command("run")
@click.argument("name")
@target_option
@dry_run_option
@click.option("--set", "assignments", multiple=True, metavar="OPTION=VALUE", help="Set a playbook option.")
@click.pass_obj
def playbook_run(obj, name, target, dry_run, assignments):
    """Run the playbook NAME (a name from `playbook list`, or a path)."""
    sys.exit(_run_book(obj, target, name, playbook.parse_option_assignments(assignments), dry_run))


# ------------------------------------------------------------------ status and health


def _is_tty() -> bool:
    return sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


@cli.command()
@target_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per target (a list for a group).")
@click.option(
    "--watch", type=click.FloatRange(min=0.5), default=None, metavar="S", help="Refresh every S seconds."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=budget.DEFAULT_STATUS_S,
    show_default=True,
    metavar="S",
    help="Answer within S seconds; parts that take longer show UNKNOWN.",
)
@click.pass_obj
def status(obj, target, as_json, watch, timeout):
    """GPUs, tmux session, step, loss, Ktok/s, ETA and a verdict, in one round trip per target.

    \b
    Example:
      $ dflash-ops status -t gpu-box
      gpu-box  pve1 ct 200  ...
      [0] NVIDIA H200 | 71234 / 143771 MiB |  97 % | target  | 41872
    """
    targets = obj.targets(target)
    while True:
        checked = [o.value for o in fan_out(targets, lambda t: ops.check(t, timeout_s=timeout))]
        if as_json:
            objs = [c.status for c in checked]
            click.echo(json.dumps(objs[0] if len(objs) == 1 else objs, indent=None if watch else 2))
        else:
            if watch and _is_tty():
                click.clear()
            # each table ends with its newline; one blank line between targets, none after the last
            click.echo(
                "\n".join(status_lib.render_table(c.status, color=_is_tty()) for c in checked), nl=False
            )
        if not watch:
            sys.exit(health.EXIT_CODES[health.worst(c.verdict.level for c in checked)])
        time.sleep(watch)


@cli.command("health")
@target_option
@click.option("--json", "as_json", is_flag=True, help="Verdicts as JSON instead of the Nagios line.")
@click.option(
    "--auto-relaunch",
    is_flag=True,
    help="Relaunch a CRITICAL target (at most max_relaunches_per_hour; never two at once).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=budget.DEFAULT_HEALTH_S,
    show_default=True,
    metavar="S",
    help="Answer within S seconds (NRPE's default); parts that take longer are UNKNOWN.",
)
@click.pass_obj
def health_cmd(obj, target, as_json, auto_relaunch, timeout):
    """For cron/Nagios: one line `DFLASH OK|WARNING|CRITICAL|UNKNOWN: … | perfdata`, exit 0/1/2/3.

    \b
    Example:
      $ dflash-ops health -t gpu-box
      DFLASH OK: gpu-box: step 1200/90000, loss 2.31, 51.2 Ktok/s | step=1200 tokens_per_s=51234;20000: ...
    """
    try:
        targets = obj.targets(target)
    except DflashOpsError as exc:  # the check itself could not run: UNKNOWN, not CRITICAL
        click.echo(health.nagios_line(target or "dflash", health.unknown(str(exc).splitlines()[0])))
        sys.exit(3)
    checked = [o.value for o in fan_out(targets, lambda t: ops.check(t, timeout_s=timeout))]
    actions = {}
    if auto_relaunch:
        for c in checked:
            action = ops.auto_relaunch(c.target, c, obj.search_dirs())
            if action is not None:
                actions[c.target.name] = action
    if as_json:
        # the same shape as `status --json`: one object for one target, a list for a group
        objs = [
            dict(
                c.status,
                **(
                    {"auto_relaunch": actions[c.target.name].message if c.target.name in actions else None}
                    if auto_relaunch
                    else {}
                ),
            )
            for c in checked
        ]
        click.echo(json.dumps(objs[0] if len(objs) == 1 else objs, indent=2))
    else:
        if len(checked) == 1:
            line, code = (
                health.nagios_line(checked[0].target.name, checked[0].verdict),
                checked[0].verdict.exit_code,
            )
        else:
            line, code = health.nagios_line_many((c.target.name, c.verdict) for c in checked)
        click.echo(line)
        for name, action in actions.items():
            click.echo(f"{name}: {action.message}")
    sys.exit(health.EXIT_CODES[health.worst(c.verdict.level for c in checked)])


# ------------------------------------------------------------------ logs and terminal


def _one_target(obj: Obj, target):
    targets = obj.targets(target)
    if len(targets) != 1:
        raise InputError(f"--target {target}: this command needs one target, not a group of {len(targets)}")
    return targets[0]


@cli.command("tail-log")
@target_option
@click.option("-n", "lines", type=click.IntRange(min=0), default=50, show_default=True, help="Lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines; Ctrl-C stops.")
@click.option("--grep", metavar="REGEX", help="Only lines matching this regular expression.")
@click.option(
    "--log",
    metavar="PATH",
    help="A specific log on the target (default: the log of the run in the job state).",
)
@click.pass_obj
def tail_log(obj, target, lines, follow, grep, log):
    """Show the end of the current run's log (the one the job state names).

    \b
    Example:
      $ dflash-ops tail-log -n 2 --grep step
      step 1199/90000 loss 2.3127 acc@1 0.712 51.3 Ktok/s lr 5.98e-04 eta 20:41:10
      step 1200/90000 loss 2.3088 acc@1 0.714 51.2 Ktok/s lr 5.98e-04 eta 20:41:02
    """
    tgt = _one_target(obj, target)
    try:
        ops.tail_log(tgt, lines, follow, grep, log, emit=click.echo)
    except KeyboardInterrupt:
        pass  # polling leaves nothing running on the target


@cli.command()
@target_option
@click.pass_obj
def attach(obj, target):
    """Attach your terminal to the job's tmux session (detach with Ctrl-b d)."""
    from . import tmux

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise InputError(
            "attach needs a terminal (stdin and stdout are not a TTY); run it from an "
            "interactive shell, or use `dflash-ops tail-log -f` to watch the job"
        )
    tgt = _one_target(obj, target)
    with ops.connect(tgt) as transport:
        sys.exit(transport.interactive(tmux.attach(tgt.job)))


@cli.command()
@click.pass_obj
def targets(obj):
    """List the inventory's targets (* marks the default)."""
    click.echo(f"inventory: {obj.inventory.source or 'built-in (no file found)'}")
    for line in inventory_lib.describe(obj.inventory):
        click.echo(line)
    for name, members in obj.inventory.groups.items():
        click.echo(f"  group {name}: {', '.join(members)}")


# ------------------------------------------------------------------ cron


@cli.group("cron")
def cron_group():
    """Manage the crontab line that runs `dflash-ops health` for a target."""


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
@click.pass_obj
def cron_install(obj, target, schedule, auto_relaunch, log_path):
    """Install (or replace) the health-check line for the target."""
    name = target or obj.inventory.default_target
    obj.targets(name)  # refuse unknown names before writing anything
    exe = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "dflash-ops" else None
    argv = [exe] if exe else [sys.executable, "-m", "dflash_ops"]
    if obj.inventory.source:
        argv += ["--inventory", os.path.abspath(obj.inventory.source)]
    argv += ["health", "--target", name] + (["--auto-relaunch"] if auto_relaunch else [])
    log_path = os.path.expanduser(log_path)
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    for line in cron.install(cron.health_line(schedule, argv, log_path, name), name):
        click.echo(line)


@cron_group.command("show")
@target_option
def cron_show(target):
    """Show our crontab lines."""
    for line in cron.ours(cron.read(), target):
        click.echo(line)


@cron_group.command("remove")
@target_option
def cron_remove(target):
    """Remove our crontab line(s) (for the target, or all of ours)."""
    gone = cron.remove(target)
    click.echo(f"removed {len(gone)} line(s)")


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="dflash-ops", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except DflashOpsError as exc:
        click.echo(f"dflash-ops: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
