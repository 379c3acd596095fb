"""`metrics`: the Prometheus text format for node_exporter's textfile collector, or over HTTP."""

from __future__ import annotations

import click

from dflash_ops.observe import budget
from dflash_ops.cli.group import answer_within_option, cli, target_option
from dflash_ops.observe.textfile import DEBIAN_DIR


@cli.command("metrics")
@target_option
@click.option(
    "--textfile-dir",
    default=DEBIAN_DIR,
    show_default=True,
    metavar="DIR",
    help="node_exporter's --collector.textfile.directory; '-' prints to stdout instead.",
)
@click.option(
    "--serve",
    "port",
    type=click.IntRange(0, 65535),
    default=None,
    metavar="PORT",
    help="Serve /metrics on PORT (prometheus-client) instead, checking the targets at each scrape.",
)
@click.option("--listen", default="127.0.0.1", show_default=True, metavar="ADDR", help="Address for --serve.")
@answer_within_option(
    budget.DEFAULT_HEALTH_S, "Check each target within S seconds; parts that take longer are left out."
)
@click.pass_obj
def metrics_cmd(obj, target, textfile_dir, port, listen, timeout):
    """Job and GPU metrics in the Prometheus text format, one file per target or group.

    \b
    Written atomically (a temp file renamed into place) as DIR/dflash-ops-<target>.prom, for
    node_exporter's textfile collector; `cron install --metrics DIR` runs it every few minutes.
    An unreachable target still writes dflash_up 0 and dflash_health_status 3. A multinode job
    gives each node's series, labelled with the node's target.
    """
    from dflash_ops.observe import job_check, prometheus, textfile

    jobs = obj.inventory.jobs(target)

    def render() -> str:  # a multinode job: each node's series
        return prometheus.render([node for jc in job_check.check_all(jobs, timeout) for node in jc.nodes])

    if port is not None:
        from dflash_ops.observe import prometheus_serve

        prometheus_serve.serve(
            render, port, listen, ready=lambda p: click.echo(f"serving http://{listen}:{p}/metrics", err=True)
        )
        return
    text = render()
    if textfile_dir == "-":
        click.echo(text, nl=False)
        return
    path = textfile.write(textfile_dir, textfile.file_name(target or obj.inventory.default_target), text)
    click.echo(f"wrote {path}")
