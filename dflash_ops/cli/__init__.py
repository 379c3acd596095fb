"""dflash-ops: a thin click layer over dflash_ops.commands and dflash_ops.observe."""

from __future__ import annotations

import os
import sys

import click

from dflash_ops.errors import DflashOpsError
from dflash_ops.cli import admin, jobs, metrics, observe, report  # noqa: F401  (each registers its commands on `cli`)
from dflash_ops.cli.group import cli

__all__ = ["cli", "main"]


def main(argv=None):
    try:
        _run(argv)
    finally:
        _quiet_if_reader_left()


def _quiet_if_reader_left():
    """Output piped into a reader that stopped (`| head -2`): no complaint at exit, as other tools behave."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(argv):
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
