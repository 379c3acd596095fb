"""What the job is doing, in one word, for `dflash_state` and `health --on-change`."""

from __future__ import annotations

import posixpath

from dflash_ops.job import jobstate
from dflash_ops.remote import facts

RUNNING, STOPPED, FINISHED, DOWN, UNKNOWN = "running", "stopped", "finished", "down", "unknown"
PHASES = (RUNNING, STOPPED, FINISHED, DOWN, UNKNOWN)


def phase(status) -> str:
    """running, stopped (by an operator), finished, down (crashed, gone, never launched) or unknown."""
    if not status.probed or status.session.running is None:
        return UNKNOWN
    if status.session.running:
        return RUNNING
    recorded = (status.job_state or {}).get("state")
    if status.training.finished or recorded == jobstate.FINISHED:
        return FINISHED
    return STOPPED if recorded == jobstate.STOPPED else DOWN


def launch_number(status) -> int | None:
    log = status.log or (status.job_state or {}).get("log")
    match = facts.LOG_NAME.match(posixpath.basename(log)) if isinstance(log, str) else None
    return int(match.group(1)) if match else None
