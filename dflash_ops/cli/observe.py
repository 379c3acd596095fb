"""Commands that observe the job without changing it: status, health, tail-log, attach."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import click

from dflash_ops.observe import budget
from dflash_ops.errors import DflashOpsError, InputError
from dflash_ops.cli.group import answer_within_option, cli, node_or_target, one_target, target_option


def _is_tty() -> bool:
    return sys.stdout.isatty() and os.environ.get("NO_COLOR") is None


@cli.command()
@target_option
@click.option("--json", "as_json", is_flag=True, help="JSON: one object for one target, a list for several.")
@click.option(
    "--watch", type=click.FloatRange(min=0.5), default=None, metavar="S", help="Refresh every S seconds."
)
@answer_within_option(
    budget.DEFAULT_STATUS_S, "Answer within S seconds; parts that take longer show UNKNOWN."
)
@click.pass_obj
def status(obj, target, as_json, watch, timeout):
    """GPUs, tmux session, step, loss, Ktok/s, ETA and a verdict, in one round trip per target.

    \b
    Example (a tiny run on one H200):
      $ dflash-ops status
      local (vm)  probe 0.27 s
      [0] NVIDIA H200 |   0 % |   1901 / 143771 MiB | target  | python3/1072(1278M)
      session dflash-local (tmux -L dflash): running, pane pid 1065
      job: running, run 0001, log /tmp/dflash-gpu/logs/train-0001.log
      step 240/300  loss 2.9870  22.0 Ktok/s  ETA 7 s  last metrics 5 s ago  data synthetic
      OK: step 240/300, loss 2.9870, 22.0 Ktok/s, last step 5 s ago
    """
    from dflash_ops.observe import health, job_check, status_output

    jobs = obj.inventory.jobs(target)
    while True:
        checked = job_check.check_all(jobs, timeout)
        statuses = [c.status for c in checked]
        if as_json:
            click.echo(status_output.status_json(statuses, indent=None if watch else 2))
        else:
            if watch and _is_tty():
                click.clear()
            click.echo(status_output.status_text(statuses, color=_is_tty()), nl=False)
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
    "--on-change",
    metavar="CMD",
    help="Run CMD (sh -c) when a job's verdict changes or it was relaunched; what changed is in its "
    "environment (DFLASH_OLD_STATE, DFLASH_NEW_STATE, DFLASH_REASON, DFLASH_PERFDATA, …). It gets what "
    "is left of --timeout and never changes the verdict.",
)
@answer_within_option(
    budget.DEFAULT_HEALTH_S, "Answer within S seconds (NRPE's default); parts that take longer are UNKNOWN."
)
@click.pass_obj
def health_cmd(obj, target, as_json, auto_relaunch, on_change, timeout):
    """For cron/Nagios: one line `DFLASH OK|WARNING|CRITICAL|UNKNOWN: … | perfdata`, exit 0/1/2/3.

    \b
    Example (a tiny run on one H200):
      $ dflash-ops health
      DFLASH OK: local: step 240/300, loss 2.9870, 22.0 Ktok/s, last step 5 s ago | step=240;; loss=2.987;; tokens_per_s=22030.6515;1000:; age_s=5.1453;;120
    """  # noqa: E501 (a real output line)
    from dflash_ops.observe import health

    try:
        sys.exit(_health(obj, target, as_json, auto_relaunch, timeout, on_change))
    except Exception as exc:  # noqa: BLE001 - cron reads one line and an exit code, never a traceback
        first = (str(exc).splitlines() or [""])[0][:300]
        click.echo(health.nagios_line(target or "dflash", health.unknown(f"{type(exc).__name__}: {first}")))
        sys.exit(3)


def _health(obj, target, as_json, auto_relaunch, timeout, on_change=None) -> int:
    from dflash_ops.observe import health, job_check, status_output

    deadline = time.monotonic() + timeout
    if on_change:  # the hook's share comes out of the budget, so health still answers within it
        timeout = max(1.0, timeout - min(budget.HOOK_MAX_S, timeout * budget.HOOK_SHARE))
    try:
        jobs = obj.inventory.jobs(target)
    except DflashOpsError as exc:  # the check itself could not run: UNKNOWN, not CRITICAL
        click.echo(health.nagios_line(target or "dflash", health.unknown(str(exc).splitlines()[0])))
        return 3
    checked = job_check.check_all(jobs, timeout)
    actions = {}
    if auto_relaunch:
        from dflash_ops import commands

        for jc in checked:
            # a CRITICAL job is relaunched whole (every node of it); a node's own target never alone
            node = obj.inventory.node_of(jc.job.name)
            if node:
                actions[jc.job.name] = commands.HealthAction(False, f"not relaunched: {node}")
            elif (action := commands.auto_relaunch(jc.job, jc)) is not None:
                actions[jc.job.name] = action
    if as_json:
        relaunched = {name: action.message for name, action in actions.items()} if auto_relaunch else None
        click.echo(status_output.status_json([jc.status for jc in checked], relaunched=relaunched))
    else:
        if len(checked) == 1:
            line = health.nagios_line(checked[0].job.name, checked[0].verdict)
        else:
            line, _ = health.nagios_line_many((c.job.name, c.verdict) for c in checked)
        click.echo(line)
        for name, action in actions.items():
            click.echo(f"{name}: {action.message}")
    if on_change:
        from dflash_ops.observe import on_change as hooks

        sys.stdout.flush()  # the verdict is out before any hook runs
        hooks.run_hooks(
            on_change,
            [c.as_one_target() for c in checked],
            deadline - budget.MARGIN_S / 2,
            lambda text: click.echo(text, err=True),
        )
    return health.EXIT_CODES[health.worst(c.verdict.level for c in checked)]


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
@click.option(
    "--node", metavar="NAME|INDEX", help="Of a multinode job (-t JOB): this node's log (default node 0)."
)
@click.pass_obj
def tail_log(obj, target, lines, follow, grep, log, node):
    """Show the end of the current run's log (the one the job state names).

    \b
    Example (a tiny run on one H200):
      $ dflash-ops tail-log -n 2
      step 239/300  loss 3.6034  acc@1 0.599  acc_avg 0.533  22,080 tok/s  lr 3.37e-04  gnorm 1.169  eta 0m07s
      step 240/300  loss 2.9870  acc@1 0.651  acc_avg 0.691  20,501 tok/s  lr 3.27e-04  gnorm 0.966  eta 0m07s
    """
    from dflash_ops.observe.log_tail import tail_log

    # polling leaves nothing running on the target
    with contextlib.suppress(KeyboardInterrupt):
        tail_log(node_or_target(obj, target, node), lines, follow, grep, log, emit=click.echo)


@cli.command()
@target_option
@click.pass_obj
def attach(obj, target):
    """Attach your terminal to the job's tmux session (detach with Ctrl-b d)."""
    from dflash_ops.job import tmux
    from dflash_ops.transport.factory import connect

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise InputError(
            "attach needs a terminal (stdin and stdout are not a TTY); run it from an "
            "interactive shell, or use `dflash-ops tail-log -f` to watch the job"
        )
    tgt = one_target(obj, target)
    with connect(tgt) as transport:
        sys.exit(transport.interactive(tmux.attach(tgt.job)))
