"""Verdict rules for a job nobody watches: a stop or a finished run is OK; blind spots are WARNINGs."""

from __future__ import annotations

import time

from dflash_ops.observe import gpu_owners
from dflash_ops.job import jobpaths, jobstate
from dflash_ops.remote import facts


def _clock(seconds: float | None) -> str:
    """`2026-12-01 22:15:04 UTC`, or `an unknown time` for anything that is not one."""
    if seconds is None:  # gmtime(None) would be now
        return "an unknown time"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    except (TypeError, ValueError, OverflowError, OSError):
        return "an unknown time"


def unusable_state(report, job) -> str | None:
    """Why the state file holds no usable state; without one a stop looks like a crash, so no relaunch."""
    if report.job_state_error is None:
        return None
    fix = (
        jobstate.NOT_A_FILE_FIX
        if report.job_state_error == facts.STATE_NOT_A_FILE
        else "fix or remove it (a relaunch rewrites a damaged file)"
    )
    return (
        f"job state {jobpaths.state_file(job)} is unusable ({report.job_state_error}): a stop cannot be "
        f"told from a crash, so nothing is relaunched; {fix}"
    )


# how long past its grace a stop may still be ending (its checks and the last kill)
STOP_SLACK_S = 120.0


def stop_underway(report) -> str | None:
    """The reason for a job being stopped (never a crash); an old stop with a live trainer was interrupted."""
    state = jobstate.JobState.from_dict(report.job_state)
    if state is None or state.state != jobstate.STOPPING:
        return None
    began = f"{state.by or jobstate.STOPPED_BY} began stopping it at {_clock(state.when)}"
    if report.session.running is False:
        return f"stopped: {began}; the stop did not finish (`dflash-ops stop` ends any leftovers)"
    deadline = (state.when or 0.0) + (state.grace_s or 0.0) + STOP_SLACK_S
    if state.when is not None and report.time <= deadline:
        return f"being stopped: {began}"
    return None


NEVER_LAUNCHED = "no job launched here yet (`dflash-ops relaunch` starts one)"


def never_launched(report) -> bool:
    """Nothing of the job was ever here: still CRITICAL, said as what it is."""
    return (
        report.session.exists is False
        and report.job_state is None
        and report.job_state_error is None
        and report.log is None
        and not report.processes
    )


def parked(report, progress) -> str | None:
    """The OK reason for a job that is deliberately not running (or being stopped), else None."""
    underway = stop_underway(report)
    if underway is not None:
        return underway
    if report.session.running is not False:
        return None
    state = jobstate.JobState.from_dict(report.job_state)
    if state is not None and state.state == jobstate.STOPPED:
        return f"stopped by {state.by or jobstate.STOPPED_BY} at {_clock(state.when)}"
    if state is not None and state.state == jobstate.FINISHED and progress.done_reason != "max_steps":
        return f"finished (run {state.run:04d})" if isinstance(state.run, int) else "finished"
    return None


def warnings(report, job) -> list[str]:
    found = []
    state = jobstate.JobState.from_dict(report.job_state)
    if state is not None and state.state == jobstate.STOPPING and stop_underway(report) is None:
        found.append(  # a stop that was recorded but never ended the still-running trainer
            f"{state.by or jobstate.STOPPED_BY} began stopping the job at {_clock(state.when)} but the "
            "trainer still runs (the stop was interrupted?); run `dflash-ops stop` again, or "
            "`dflash-ops relaunch`"
        )
    if report.log_missing and report.session.running is not False:
        start = next((r for r in report.records if r.get("event") == "start"), None)
        pid = (start or {}).get("pid") or report.session.pane_pid
        found.append(
            f"log {report.log_missing} is missing while the trainer (pid {pid}) is alive: "
            "deleted or rotated away? progress is read from its metrics file"
        )
    if job.gpus and not report.gpu.ok:
        found.append(
            f"GPUs {','.join(map(str, job.gpus))} are assigned but the GPU query failed: {report.gpu.error}"
        )
    foreign = gpu_owners.foreign_on_job_gpus(report, job)
    if foreign:
        found.append(
            "foreign process(es) on the job's GPUs (never signalled): "
            + "; ".join(f.describe() for f in foreign)
        )
    return found
