"""What status shows of the job's tmux session and of the processes running in it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TmuxSession:
    """The session and its pane (fields in the JSON's order); None where tmux gave no answer."""

    name: str
    socket: str
    running: bool | None = None
    exists: bool | None = None
    pane_pid: int | None = None
    exit_status: int | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TmuxSession:
        return cls(**data)

    def state(self) -> str:
        """`running, pane pid 4100`, `exited with status 1`, `not running` or `unknown`."""
        if self.running is None:
            return "unknown"
        if self.running:
            return "running" + (f", pane pid {self.pane_pid}" if self.pane_pid else "")
        if self.exists:
            return "exited" + (f" with status {self.exit_status}" if self.exit_status is not None else "")
        return "not running"

    def line(self) -> str:
        return f"session {self.name} (tmux -L {self.socket}): {self.state()}"


@dataclasses.dataclass(frozen=True)
class JobProcess:
    """One process of the session's process tree (fields in the JSON's order)."""

    pid: int
    ppid: int | None
    name: str | None
    cmdline: str | None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> JobProcess:
        return cls(**data)

    def runs_module(self, module: str) -> bool:
        """`python -m MODULE ...` (not the pane's shell, whose arguments carry the same words)."""
        words = (self.cmdline or "").split()
        if "-m" not in words[1:3]:
            return False
        at = words.index("-m", 1)
        return words[at + 1 : at + 2] == [module]
