"""The job state dflash-ops keeps on the target, next to the job (`<workdir>/job-state.json`).

    running   {"state", "run", "run_dir", "log", "pid", "since"}   written by the launch
    finished  the same, "when"       written by the pane when the trainer's `done` says max_steps
    stopped   the same, "by", "when"  written by `dflash-ops stop`; only a relaunch clears it

Every write is a whole new file renamed into place, so a reader never sees half a state. status,
health and tail-log follow the run and log named here, never "the newest file"; an operator's stop
is a decision that health reports as OK and never undoes.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

from . import jobpaths
from .model import Job

RUNNING, STOPPED, FINISHED = "running", "stopped", "finished"
STOPPED_BY = "dflash-ops stop"


@dataclasses.dataclass(frozen=True)
class JobState:
    state: str
    run: int | None = None
    run_dir: str | None = None
    log: str | None = None
    pid: int | None = None
    since: float | None = None
    when: float | None = None
    by: str | None = None

    @classmethod
    def from_dict(cls, data) -> "JobState | None":
        """None for anything that is not a state record (absent, foreign or damaged file)."""
        if not isinstance(data, dict) or data.get("state") not in (RUNNING, STOPPED, FINISHED):
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse(text: str) -> JobState | None:
    try:
        return JobState.from_dict(json.loads(text))
    except ValueError:
        return None


def read_script(job: Job) -> str:
    """Prints the target's clock (unix seconds), then the state file ("" when there is none)."""
    return f"date +%s; cat {shlex.quote(jobpaths.state_file(job))} 2>/dev/null; true"


def parse_read(stdout: str) -> tuple[float, JobState | None]:
    clock, _, text = stdout.partition("\n")
    return float(clock.strip() or 0), parse(text)


@dataclasses.dataclass(frozen=True)
class Slot:
    """A number only the script writing a state knows (digits only): `@name@` in json_template."""

    name: str


def json_template(**fields) -> str:
    """A state's JSON text for a script to complete: Python values are encoded here (hostile paths
    stay data), a Slot stands for a number (`@name@`, unquoted), a tuple (text, Slot, text) for a
    string with a number in its middle, e.g. a numbered log path. Every "@" of a value is written
    as \\u0040 (the same JSON), so data never reads as a slot."""

    def text(value) -> str:
        return json.dumps(value).replace("@", "\\u0040")

    def encoded(value) -> str:
        if isinstance(value, Slot):
            return f"@{value.name}@"
        if isinstance(value, tuple):
            head, slot, tail = value
            return text(head)[:-1] + encoded(slot) + text(tail)[1:]
        return text(value)

    return "{" + ",".join(f"{text(key)}:{encoded(value)}" for key, value in fields.items()) + "}"


def stopped(previous: JobState | None, when: float) -> JobState:
    """The state `dflash-ops stop` leaves: the last run and log stay named for status and tail-log."""
    base = previous or JobState(STOPPED)
    return dataclasses.replace(base, state=STOPPED, by=STOPPED_BY, when=when)


def encode(state: JobState) -> bytes:
    return (json.dumps(state.to_dict()) + "\n").encode()
