"""`health --on-change CMD`: run CMD (`/bin/sh -c`, own process group) when a job's verdict changes or
it was relaunched, never on a repeat; on a job's first check only for a state not OK/stopped/finished.

Its environment: DFLASH_TARGET, DFLASH_JOB, DFLASH_EVENT (`changed` or `relaunched`), DFLASH_OLD_STATE,
DFLASH_NEW_STATE, DFLASH_LEVEL, DFLASH_EXIT_CODE, DFLASH_REASON, DFLASH_PERFDATA, DFLASH_OLD_LAUNCH,
DFLASH_NEW_LAUNCH. Output goes to `on-change.log` (a pipe would hold a monitor's read open); it gets
what is left of health's budget, then is killed with its group."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time

from dflash_ops.job import jobpaths
from dflash_ops.job.relaunch_guard import state_dir
from dflash_ops.job.model import Target
from dflash_ops.observe import health, job_phase, verdict_memory

QUIET_FIRST = ("OK", job_phase.STOPPED, job_phase.FINISHED)
LOG_NAME = "on-change.log"
MIN_HOOK_S = 0.2  # less time than this left: the hook is not started (and runs at the next check)


@dataclasses.dataclass(frozen=True)
class Change:
    target: Target
    event: str  # "changed" | "relaunched"
    old: verdict_memory.Remembered | None
    new: verdict_memory.Remembered
    verdict: health.Verdict

    def env(self) -> dict:
        return {
            "DFLASH_TARGET": self.target.name,
            "DFLASH_JOB": jobpaths.marker_value(self.target.job),
            "DFLASH_EVENT": self.event,
            "DFLASH_OLD_STATE": self.old.state if self.old else "none",
            "DFLASH_NEW_STATE": self.new.state,
            "DFLASH_LEVEL": self.verdict.level,
            "DFLASH_EXIT_CODE": str(self.verdict.exit_code),
            "DFLASH_REASON": self.verdict.summary,
            "DFLASH_PERFDATA": health.perfdata_text(self.verdict.perfdata),
            "DFLASH_OLD_LAUNCH": _text(self.old.launch if self.old else None),
            "DFLASH_NEW_LAUNCH": _text(self.new.launch),
        }


def _text(number: int | None) -> str:
    return "" if number is None else str(number)


def state_word(checked) -> str:
    """What a hook is told the job is: stopped or finished when the job rests, else the level."""
    phase = job_phase.phase(checked.status)
    return phase if phase in (job_phase.STOPPED, job_phase.FINISHED) else checked.verdict.level


def seen(checked, now: float | None = None) -> verdict_memory.Remembered:
    return verdict_memory.Remembered(
        state=state_word(checked),
        launch=job_phase.launch_number(checked.status),
        reason=checked.verdict.summary[:500],
        time=time.time() if now is None else now,
    )


def change_of(checked, old: verdict_memory.Remembered | None) -> Change | None:
    new = seen(checked)
    if new.launch is None and old is not None:  # not readable now (UNKNOWN): keep what was known
        new = dataclasses.replace(new, launch=old.launch)
    if old is None:
        event = None if new.state in QUIET_FIRST else "changed"
    elif new.launch is not None and old.launch is not None and new.launch > old.launch:
        event = "relaunched"
    else:
        event = "changed" if new.state != old.state else None
    return None if event is None else Change(checked.target, event, old, new, checked.verdict)


def run_hooks(command: str, checked_list, deadline: float, say) -> None:
    """Run `command` for each job whose verdict changed, until `deadline`; remember each verdict."""
    started = []
    for checked in checked_list:
        old = verdict_memory.recall(checked.target)
        change = change_of(checked, old)
        if change is None:
            if old is None or old.state != state_word(checked):
                verdict_memory.remember(checked.target, seen(checked))  # a quiet first sighting
            continue
        if deadline - time.monotonic() < MIN_HOOK_S:
            say(f"{checked.target.name}: on-change hook not run: no time left in the budget (next check)")
            continue  # not remembered: the next check sees the same change
        started.append((change, _start(command, change)))
        verdict_memory.remember(checked.target, change.new)
    for change, proc in started:
        name = change.target.name
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            say(f"{name}: on-change hook still running at the end of the time budget: killed")
            continue
        if code != 0:
            say(f"{name}: on-change hook exited with status {code} (output in {state_dir() / LOG_NAME})")


def _start(command: str, change: Change) -> subprocess.Popen:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOG_NAME, "ab") as log:
        log.write(
            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {change.target.name}: "
            f"{change.event} {change.old.state if change.old else 'none'} -> {change.new.state}\n".encode()
        )
        log.flush()
        return subprocess.Popen(
            ["/bin/sh", "-c", command],
            env={**os.environ, **change.env()},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
