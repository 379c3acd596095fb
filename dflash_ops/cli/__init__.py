"""dflash-ops: a thin click layer over dflash_ops.ops. Every command takes --target NAME|GROUP;
a group fans out in parallel, one result per target, and the exit code is the worst."""

from __future__ import annotations

import sys

import click

from ..errors import DflashOpsError
from . import admin, jobs, observe, report  # noqa: F401  (each registers its commands on `cli`)
from .group import cli

__all__ = ["cli", "main"]


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
