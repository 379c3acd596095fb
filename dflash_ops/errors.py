"""The error types every layer raises; the CLI maps each to one message and an exit code."""

from __future__ import annotations


def with_remote_stderr(message: str, stderr: str) -> str:
    """`message`, then what the remote side said on stderr, indented under it, when it said anything."""
    return message + ("\n  remote stderr: " + stderr.replace("\n", "\n  ") if stderr else "")


class DflashOpsError(Exception):
    """Base class: a failure we can explain in one message."""

    exit_code = 1


class InputError(DflashOpsError):
    """Bad user input (inventory, config, playbook, CLI args). Nothing destructive has happened."""

    exit_code = 2


class TransportError(DflashOpsError):
    """Reaching the target failed; names the target and the step, with the remote stderr when there is one."""

    def __init__(self, target: str, step: str, reason: str, stderr: str = ""):
        self.target, self.step, self.reason, self.stderr = target, step, reason, stderr
        super().__init__(with_remote_stderr(f"[{target}] {step}: {reason}", stderr.strip()))


class ConnectError(TransportError):
    """Host unreachable: DNS, refused port, network timeout."""


class AuthError(TransportError):
    """The host refused our key/user."""


class HostKeyError(TransportError):
    """Host key unknown (under the strict policy) or changed since it was recorded."""


class ContainerNotRunning(TransportError):
    """`pct exec` refused: the LXC container is stopped or does not exist."""


class RemoteTimeout(TransportError):
    """The remote command ran past its time limit and was killed on the remote side."""


class StepFailed(DflashOpsError):
    """A step ran but could not do its job (GPUs still busy, no first step, …); the message says why."""


class Interrupted(DflashOpsError):
    """The operator interrupted (Ctrl-C) a command at a point where what was done must be said."""

    exit_code = 130


class RemoteCommandError(DflashOpsError):
    """A remote command ran and exited non-zero where success was required."""

    def __init__(self, target: str, step: str, result):
        self.target, self.step, self.result = target, step, result
        tail = (result.stderr.strip() or result.stdout.strip())[-2000:]
        super().__init__(with_remote_stderr(f"[{target}] {step}: exit code {result.exit_code}", tail))


class JobBusy(DflashOpsError):
    """Another command holds the job's lock; nothing was done. Exit 75 (EX_TEMPFAIL): try again later."""

    exit_code = 75

    def __init__(self, target: str, reason: str):
        self.target, self.reason = target, reason
        super().__init__(reason)
