"""The last verdict `health` saw per job, kept where health runs, to tell a change from a repeat;
each write renamed into place, a damaged file reads as no memory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile

from dflash_ops.job import jobpaths
from dflash_ops.job.relaunch_guard import safe_name, state_dir

MAX_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Remembered:
    state: str  # OK | WARNING | CRITICAL | UNKNOWN | stopped | finished
    launch: int | None  # the job's launch number (train-NNNN.log) when it was seen
    reason: str = ""
    time: float | None = None


def path_for(target) -> pathlib.Path:
    """One file per job, named by target and a digest of its workdir, socket and session."""
    job = target.job
    digest = hashlib.sha256(f"{job.workdir}\0{jobpaths.marker_value(job)}".encode()).hexdigest()[:12]
    return state_dir() / f"{safe_name(target.name)[:64]}-{digest}.verdict.json"


def recall(target) -> Remembered | None:
    try:
        with open(path_for(target), "rb") as f:
            data = json.loads(f.read(MAX_BYTES).decode("utf-8", "replace"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("state"), str):
        return None
    launch = data.get("launch")
    when = data.get("time")
    return Remembered(
        state=data["state"],
        launch=launch if isinstance(launch, int) and not isinstance(launch, bool) else None,
        reason=str(data.get("reason") or ""),
        time=when if isinstance(when, (int, float)) else None,
    )


def remember(target, seen: Remembered) -> None:
    path = path_for(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(seen), f)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
