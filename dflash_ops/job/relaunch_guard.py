"""Guard for `health --auto-relaunch`: at most N relaunches per hour, never two at once (an flock held
for the whole relaunch), kept where cron runs, because that is where overlapping runs meet."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import time

WINDOW_S = 3600


def state_dir() -> pathlib.Path:
    base = os.environ.get("DFLASH_OPS_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "dflash-ops"
    )
    return pathlib.Path(base)


def safe_name(name: str) -> str:
    """`name` as part of a file name: anything but letters, digits, `_.-` becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class RelaunchGuard:
    def __init__(self, target: str, max_per_hour: int, directory: pathlib.Path | None = None):
        self.directory = directory or state_dir()
        self.max_per_hour = max_per_hour
        self.state_path = self.directory / f"{safe_name(target)}.relaunches.json"
        self.lock_path = self.directory / f"{safe_name(target)}.lock"

    def recent(self, now: float | None = None) -> list[float]:
        now = time.time() if now is None else now
        try:
            data = json.loads(self.state_path.read_text()[: 1 << 20])
        except (OSError, ValueError, RecursionError):
            data = None
        stamps = data.get("relaunches") if isinstance(data, dict) else None
        numbers = [t for t in stamps if isinstance(t, (int, float))] if isinstance(stamps, list) else []
        return [t for t in numbers if now - t < WINDOW_S]

    def record(self, now: float | None = None) -> None:
        stamps = self.recent(now) + [time.time() if now is None else now]
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"relaunches": stamps}))
        tmp.replace(self.state_path)

    @contextlib.contextmanager
    def hold(self):
        """Yields True when this run may relaunch (lock taken, budget left), else a reason string."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield "another health run is relaunching this target right now"
                return
            try:
                recent = self.recent()
                if len(recent) >= self.max_per_hour:
                    yield (
                        f"relaunch limit reached: {len(recent)} in the last hour "
                        f"(max_relaunches_per_hour={self.max_per_hour})"
                    )
                else:
                    yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
