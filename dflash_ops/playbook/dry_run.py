"""The transport a step gets under --dry-run: it describes commands and refuses to act."""

from __future__ import annotations

from ..errors import DflashOpsError
from ..transport.base import Result, Transport


class DryRunViolation(DflashOpsError):
    """A step tried to act on the target during --dry-run (a bug in that step)."""


class DryRunTransport(Transport):
    """Stands in for the real transport under --dry-run: describes commands, refuses to act, so a
    step that forgets to check ctx.dry_run fails instead of touching the target."""

    def __init__(self, real: Transport):
        super().__init__(real.name)
        self.real = real

    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        raise DryRunViolation(
            f"[{self.name}] {step}: tried to run a command during --dry-run "
            "(the step must use ctx.run or check ctx.dry_run)"
        )

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        raise DryRunViolation(f"[{self.name}] {step}: tried to write {remote_path} during --dry-run")

    def interactive(self, script: str) -> int:
        raise DryRunViolation(f"[{self.name}]: tried to attach a terminal during --dry-run")

    def command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.command_line(script, timeout)

    def host_command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.host_command_line(script, timeout)
