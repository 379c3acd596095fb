"""One interface for every way of reaching a job, and the rules turning a bash run into a Result."""

from __future__ import annotations

import abc
import contextlib
import dataclasses

from dflash_ops.errors import RemoteCommandError, RemoteTimeout, TransportError


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
    """argv running `script` under coreutils `timeout` ON THE REMOTE SIDE (fabric won't stop it)."""
    return ["timeout", "-k", str(KILL_AFTER_S), f"{remote_limit_s(timeout)}s", "bash", "-c", script]


# Seconds the local watchdog waits beyond the remote `timeout` (and its KILL) before giving up:
# it only fires when the remote side could not enforce the limit (e.g. a hung connection).
LOCAL_GRACE_S = 5
# After the command exits, how long to keep collecting output still in flight.
AFTER_EXIT_S = 1.0


def local_limit_s(timeout: float) -> float:
    return remote_limit_s(timeout) + KILL_AFTER_S + LOCAL_GRACE_S


def decode(data: bytes) -> str:
    # Decoded once, whole: decoding chunk by chunk would mangle characters split across reads.
    return data.decode("utf-8", "replace")


def finish(
    target: str, step: str, timeout: float, exit_code: int, stdout: bytes, stderr: bytes, seconds: float
) -> Result:
    """The Result, or RemoteTimeout when 124/137 came after the limit really elapsed."""
    err = decode(stderr)
    if exit_code in (124, 137) and seconds >= remote_limit_s(timeout):
        how = (
            "stopped with TERM"
            if exit_code == 124
            else f"did not stop on TERM, killed after {KILL_AFTER_S}s more"
        )
        raise RemoteTimeout(
            target, step, f"time limit of {remote_limit_s(timeout)}s reached; the command was {how}", err
        )
    return Result(exit_code, decode(stdout), err, seconds)


def outlived(target: str, step: str, limit_s: float, stderr: bytes, then: str) -> RemoteTimeout:
    """The local watchdog's error: the command outlived `limit_s` despite its remote `timeout`."""
    return RemoteTimeout(
        target,
        step,
        f"no answer within {limit_s:g}s although the remote `timeout` should have ended the command; {then}",
        decode(stderr),
    )


class Transport(abc.ABC):
    """Run bash scripts on a target and put files there; `run` raises only when unreachable or out of time."""

    def __init__(self, name: str):
        self.name = name

    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        """Run `script` with bash on the target (non-login shell: absolute paths, explicit env)."""
        code, out, err, seconds = self._execute(
            with_remote_timeout(script, timeout), stdin, local_limit_s(timeout), step
        )
        return finish(self.name, step, timeout, code, out, err, seconds)

    def _execute(
        self, argv: list[str], stdin: bytes | None, limit_s: float, step: str
    ) -> tuple[int, bytes, bytes, float]:
        """Run `argv`, given up after `limit_s`; (exit code, stdout, stderr, seconds)."""
        raise NotImplementedError

    def check(
        self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None
    ) -> Result:
        """Like run, but a non-zero exit raises RemoteCommandError naming target and step."""
        result = self.run(script, timeout=timeout, step=step, stdin=stdin)
        if not result.ok:
            raise RemoteCommandError(self.name, step, result)
        return result

    @abc.abstractmethod
    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        """Write `data` to `remote_path` atomically: temp file in the same dir, then rename."""

    def hold(
        self, script: str, step: str = "hold", answer_s: float = 30
    ) -> contextlib.AbstractContextManager[str]:
        """Start `script`, yield its first line; leaving (or dying) closes its stdin, releasing its hold."""
        raise TransportError(self.name, step, "this transport cannot keep a command running")

    @abc.abstractmethod
    def interactive(self, script: str) -> int:
        """Run `script` with the user's terminal attached (for `attach`); returns the exit code."""

    def command_line(self, script: str, timeout: float = 60) -> str:
        """The exact command line `run` would execute here, for --dry-run output."""
        return self._command_line_of(with_remote_timeout(script, timeout))

    def _command_line_of(self, argv: list[str]) -> str:
        raise NotImplementedError

    # What a Proxmox (pct) target adds: commands on the host of its container. Other transports
    # have no such host; the inventory lets only pct targets query GPUs there (gpu_host_ctid).

    def in_container(self, script: str, timeout: float = 60) -> str:
        """A host shell command running `script` in the container (to compose with host work)."""
        raise TransportError(self.name, "in_container", "not a Proxmox container target (transport: pct)")

    def host_command_line(self, script: str, timeout: float = 60) -> str:
        """The exact command line `run_on_host` would execute, for --dry-run output."""
        raise TransportError(self.name, "run_on_host", "not a Proxmox container target (transport: pct)")

    def run_on_host(
        self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None
    ) -> Result:
        """Run `script` on the Proxmox host of the container, over the same connection."""
        raise TransportError(self.name, step, "not a Proxmox container target (transport: pct)")

    def close(self) -> None:
        """Release connections. Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
