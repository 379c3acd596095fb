"""`dflash-ops report`: a picture of the job's run (dflash_ops.observe.report does the work)."""

from __future__ import annotations

import click

from dflash_ops.cli.group import cli, node_or_target, target_option


@cli.command("report")
@target_option
@click.option("--run", "run", metavar="NNNN", help="The run to draw (default: the job state's run).")
@click.option("--all-runs", is_flag=True, help="Overlay every run of the job.")
@click.option(
    "-o",
    "--out",
    default="report.png",
    show_default=True,
    metavar="FILE",
    help="A .png, or a .html page embedding it with a summary table (best τ, steps, wall time).",
)
@click.option(
    "--node", metavar="NAME|INDEX", help="Of a multinode job (-t JOB): this node's metrics (default node 0)."
)
@click.pass_obj
def report(obj, target, run, all_runs, out, node):
    """Draw the run's metrics: loss, τ measured and expected from accuracy, acceptance per block
    position (latest eval against earliest), tokens/s with relaunch and stop markers. One round
    trip reads the metrics, thinned on the target; works while the job runs, after a stop or when
    finished. No metrics yet: one line, exit 2.

    \b
    Example (the bundled tiny run, stopped once and resumed):
      $ dflash-ops report -t demo -o run.html
      [demo] run 0002: 512/512 steps, best τ 1.579 (step 240), 0m44s, 2 launches, finished
      wrote run.html
    """
    from dflash_ops.observe import report as report_lib

    tgt = node_or_target(obj, target, node)
    built = report_lib.report(tgt, report_lib.run_selection(run, all_runs), out)
    for history in built.histories:
        click.echo(f"[{tgt.name}] {history.summary_line()}")
    click.echo(f"wrote {built.path}")
