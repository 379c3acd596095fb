"""--dry-run as a transport: commands described as the real transport would run them; none runs."""

from __future__ import annotations

from dflash_ops.transport.base import Result, Transport

_EMPTY = Result(0, "", "", 0.0)


class DryRunTransport(Transport):
    """Runs nothing: every run is an empty success, every put writes nothing."""

    def __init__(self, real: Transport):
        super().__init__(real.name)
        self.real = real

    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        return _EMPTY

    def run_on_host(
        self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None
    ) -> Result:
        return _EMPTY

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        pass

    def interactive(self, script: str) -> int:
        return 0

    def command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.command_line(script, timeout)

    def host_command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.host_command_line(script, timeout)
