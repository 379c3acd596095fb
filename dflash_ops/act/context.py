"""Where a step acts and what it returns; under --dry-run the same commands are recorded, none runs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from dflash_ops.errors import RemoteCommandError
from dflash_ops.transport.base import Result, Transport
from dflash_ops.transport.dry_run import DryRunTransport

if TYPE_CHECKING:
    from dflash_ops.job.model import Target


@dataclasses.dataclass
class StepOutcome:
    """What a step returns; a later step takes a subclass with typed fields (steps.Launched)."""

    message: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    ok: bool = True

    @classmethod
    def failed(cls, message: str, **kwargs: Any) -> StepOutcome:
        return cls(message, ok=False, **kwargs)

    def report_data(self) -> dict[str, Any]:
        typed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _BASE}
        return {**self.data, **typed}


_BASE = {f.name for f in dataclasses.fields(StepOutcome)}


def _ignore(_message: str) -> None:
    pass


@dataclasses.dataclass
class StepContext:
    """Where a step acts; each step gets its own copy (its name, number and record of commands)."""

    target: Target
    transport: Transport
    log: Callable[[str], None] = _ignore  # a line that stays
    status: Callable[[str], None] = _ignore  # a transient progress line; each replaces the last
    step: str = ""
    number: int = 0
    commands: list[str] = dataclasses.field(default_factory=list)

    @property
    def dry_run(self) -> bool:
        """Whether commands are only described (a step says what it would do, from no output)."""
        return isinstance(self.transport, DryRunTransport)

    @property
    def target_name(self) -> str:
        return self.target.name

    def run(
        self, script: str, *, timeout: float = 60.0, check: bool = True, stdin: bytes | None = None
    ) -> Result:
        self.commands.append(self.transport.command_line(script, timeout))
        runner = self.transport.check if check else self.transport.run
        return runner(script, timeout=timeout, step=self.step or "run", stdin=stdin)

    def run_on_host(self, script: str, *, timeout: float = 60.0, check: bool = True) -> Result:
        """Like run, but on the Proxmox host of a pct target (real pids, the host's nvidia-smi)."""
        self.commands.append(self.transport.host_command_line(script, timeout))
        result = self.transport.run_on_host(script, timeout=timeout, step=self.step or "run")
        if check and not result.ok:
            raise RemoteCommandError(self.target_name, self.step or "run", result)
        return result

    def put(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        self.commands.append(f"# put {len(data)} bytes -> {remote_path} (mode {mode:04o})")
        self.transport.put(data, remote_path, mode=mode, step=self.step or "put")
