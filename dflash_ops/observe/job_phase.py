"""What the job is doing, in one word, from a TargetStatus: the `state` label of `dflash_state` and
the state an `health --on-change` hook is told about."""

from __future__ import annotations

import posixpath

from dflash_ops.job import jobstate
from dflash_ops.remote import facts

RUNNING, STOPPED, FINISHED, DOWN, UNKNOWN = "running", "stopped", "finished", "down", "unknown"
PHASES = (RUNNING, STOPPED, FINISHED, DOWN, UNKNOWN)


def phase(status) -> str:
    """running (its trainer lives), stopped (by an operator), finished (the run is complete), down
    (neither: crashed, gone, never launched) or unknown (the probe or tmux gave no answer)."""
    if not status.probed or status.session.running is None:
        return UNKNOWN
    if status.session.running:
        return RUNNING
    recorded = (status.job_state or {}).get("state")
    if status.training.finished or recorded == jobstate.FINISHED:
        return FINISHED
    return STOPPED if recorded == jobstate.STOPPED else DOWN


def launch_number(status) -> int | None:
    """The number of the job's current launch: each relaunch writes the next train-NNNN.log, and a
    number is never reused while its log or metrics file exists."""
    log = status.log or (status.job_state or {}).get("log")
    match = facts.LOG_NAME.match(posixpath.basename(log)) if isinstance(log, str) else None
    return int(match.group(1)) if match else None
