"""A file for node_exporter's textfile collector, renamed into place so it appears whole."""

from __future__ import annotations

import contextlib
import os
import tempfile

from dflash_ops.errors import DflashOpsError, InputError
from dflash_ops.job.relaunch_guard import safe_name

SUFFIX = ".prom"
DEBIAN_DIR = "/var/lib/prometheus/node-exporter"  # prometheus-node-exporter's default directory


def file_name(selection: str) -> str:
    """One file per target or group, so several cron lines never overwrite each other's."""
    return f"dflash-ops-{safe_name(selection)}{SUFFIX}"


def write(directory: str, name: str, text: str) -> str:
    if not os.path.isdir(directory):
        raise InputError(
            f"--textfile-dir {directory}: no such directory; give the directory node_exporter reads "
            "(its --collector.textfile.directory)"
        )
    path = os.path.join(directory, name)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)  # not *.prom: unread
    except OSError as exc:
        raise DflashOpsError(f"cannot write in {directory}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # node_exporter runs as its own user
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise DflashOpsError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
    return path
