"""The job state dflash-ops keeps on the target (`<workdir>/job-state.json`): running (the launch),
finished (the pane, on max_steps), stopping (`stop`, BEFORE it signals, so no interrupt leaves a
stopped trainer `running`, which health would relaunch) and stopped (only a relaunch clears it).

Every write is renamed into place, so no reader sees half a state. What is read back is data from
the target: at most MAX_BYTES, and a field of the wrong type or range reads as absent."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

from dflash_ops.job import jobpaths
from dflash_ops.job.model import Job
from dflash_ops.remote import facts

RUNNING, STOPPING, STOPPED, FINISHED = "running", "stopping", "stopped", "finished"
STATES = (RUNNING, STOPPING, STOPPED, FINISHED)
# an operator's decision or a completed run: nothing to alert on, nothing to relaunch
NOT_TO_RESTART = (STOPPING, STOPPED, FINISHED)
STOPPED_BY = "dflash-ops stop"
MAX_BYTES = facts.STATE_MAX_BYTES  # a reader takes no more (a runaway file is damage)
_MAX_TEXT = 4096  # a path or a name
_MAX_TIME = 2.0**33  # unix seconds (year 2242): any later `when` is damage, not a time


def _text(value) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= _MAX_TEXT and "\0" not in value else None


def _count(value, most: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most else None


def _time(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and 0 <= value <= _MAX_TIME else None


@dataclasses.dataclass(frozen=True)
class JobState:
    state: str
    job: str | None = None
    run: int | None = None
    run_dir: str | None = None
    log: str | None = None
    pid: int | None = None
    since: float | None = None
    when: float | None = None
    by: str | None = None
    grace_s: float | None = None

    @classmethod
    def from_dict(cls, data) -> "JobState | None":
        """None for anything that is no state record; a field of the wrong type or range is left out."""
        if not isinstance(data, dict) or data.get("state") not in STATES:
            return None
        get = data.get
        return cls(
            state=data["state"],
            job=_text(get(facts.STATE_JOB_KEY)),
            run=_count(get("run"), 10**9),
            run_dir=_text(get("run_dir")),
            log=_text(get("log")),
            pid=_count(get("pid"), 2**31),
            since=_time(get("since")),
            when=_time(get("when")),
            by=_text(get("by")),
            grace_s=_time(get("grace_s")),
        )

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def load(text: str):
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse(text: str) -> JobState | None:
    return JobState.from_dict(load(text))


def read_command(job: Job) -> str:
    """Prints at most MAX_BYTES (+1, to see a larger file) of a regular state file."""
    path = shlex.quote(jobpaths.state_file(job))
    return f"if [ -f {path} ]; then head -c {MAX_BYTES + 1} -- {path}; fi 2>/dev/null"


# What read_script says about the file before its text: the path is a plain file, absent, or
# something else (a directory, a socket) where no state can be written.
FILE, ABSENT, NOT_A_FILE = "file", "absent", "not-a-file"
# what to do about a state path that is not a regular file (a directory): the same advice everywhere
NOT_A_FILE_FIX = "remove it: no job state can be written in its place"


def read_script(job: Job) -> str:
    """Prints the target's clock, the kind of the state path (FILE, ABSENT, NOT_A_FILE), then its text."""
    path = shlex.quote(jobpaths.state_file(job))
    kind = (
        f"if [ -f {path} ]; then echo {FILE}; elif [ -e {path} ] || [ -L {path} ]; "
        f"then echo {NOT_A_FILE}; else echo {ABSENT}; fi"
    )
    return f"date +%s; {kind}; {read_command(job)}; true"


def parse_read(stdout: str) -> tuple[float, str, JobState | None]:
    """(the target's clock, what the state path is, the state) from read_script's output."""
    clock, _, rest = stdout.partition("\n")
    kind, _, text = rest.partition("\n")
    seconds = _time(float(clock)) if clock.strip().isdigit() else None
    if seconds is None:
        raise ValueError(f"the target's clock reads {clock.strip()[:40]!r}, not unix seconds")
    return seconds, kind.strip(), parse(text)


def stop_record(previous: JobState, state: str, when: float, grace_s: float | None = None) -> JobState:
    """What `stop` records: STOPPING (with `grace_s`) before it signals, STOPPED once the job ended."""
    return dataclasses.replace(previous, state=state, by=STOPPED_BY, when=when, grace_s=grace_s)


def encode(state: JobState) -> bytes:
    return (json.dumps(state.to_dict()) + "\n").encode()
