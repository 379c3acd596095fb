"""One interface for every way of reaching a job: local subprocess, ssh, ssh + pct exec."""
from __future__ import annotations

import abc
import dataclasses
import shlex

from ..errors import RemoteCommandError


@dataclasses.dataclass(frozen=True)
class Result:
    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


# Seconds between the remote `timeout`'s TERM and its KILL.
KILL_AFTER_S = 5


def remote_limit_s(timeout: float) -> int:
    """The whole seconds coreutils `timeout` gets on the remote side."""
    return max(1, int(round(timeout)))


def with_remote_timeout(script: str, timeout: float) -> list[str]:
    """argv that runs `script` in bash under coreutils `timeout` ON THE REMOTE SIDE.

    A local time limit alone leaves the remote command running (fabric does not stop it).
    Exit code 124 means the limit was hit; 137 means it had to be killed.
    """
    return ["timeout", "-k", str(KILL_AFTER_S), f"{remote_limit_s(timeout)}s", "bash", "-c", script]


class Transport(abc.ABC):
    """Run bash scripts on a target and put files there.

    `run` never raises for a non-zero exit code (see `check`); it raises TransportError subclasses
    when the target cannot be reached or the time limit is hit.
    """

    def __init__(self, name: str):
        self.name = name

    @abc.abstractmethod
    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        """Run `script` with bash on the target (non-login shell: absolute paths, explicit env)."""

    def check(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        """Like run, but a non-zero exit raises RemoteCommandError naming target and step."""
        result = self.run(script, timeout=timeout, step=step, stdin=stdin)
        if not result.ok:
            raise RemoteCommandError(self.name, step, result)
        return result

    @abc.abstractmethod
    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        """Write `data` to `remote_path` atomically: temp file in the same dir, then rename."""

    @abc.abstractmethod
    def interactive(self, script: str) -> int:
        """Run `script` with the user's terminal attached (for `attach`); returns the exit code."""

    @abc.abstractmethod
    def command_line(self, script: str, timeout: float = 60) -> str:
        """The exact command line `run` would execute here, for --dry-run output."""

    def close(self) -> None:
        """Release connections. Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def quote_argv(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
