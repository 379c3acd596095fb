"""The `pct` target: one ssh session to the Proxmox host running `pct exec CTID -- ...`; pct exec
passes argv without a shell, so quoting is exactly as for ssh, and stdin passes through."""

from __future__ import annotations

import re
import shlex

from dflash_ops.errors import ContainerNotRunning, TransportError
from dflash_ops.job.model import HostSpec
from dflash_ops.transport.base import Result, decode, finish, local_limit_s, with_remote_timeout
from dflash_ops.transport.ssh import SshTransport

# How Proxmox refuses an exec into a container that is stopped or missing (first stderr line), and
# what the operator can do about it.
_STOPPED = "is not running; start it on the host with `pct start {ctid}`"
_REFUSALS = (
    (re.compile(r"container '(?P<ctid>\d+)' not running!"), _STOPPED),  # pct exec, PVE 7+
    (re.compile(r"CT (?P<ctid>\d+) not running"), _STOPPED),  # API-side checks
    (re.compile(r"lxc-attach: (?P<ctid>\d+): .*Failed to get init pid"), _STOPPED),  # older pct
    (
        re.compile(r"Configuration file 'nodes/[^/']+/lxc/(?P<ctid>\d+)\.conf' does not exist"),
        "does not exist; check the target's ctid against `pct list` on the host",
    ),
)


class PctTransport(SshTransport):
    def __init__(self, name: str, spec: HostSpec, ctid: int):
        super().__init__(name, spec)  # the inventory checked spec and ctid
        self.ctid = ctid

    def _wrap(self, argv: list[str]) -> list[str]:
        return ["pct", "exec", str(self.ctid), "--", *argv]

    def in_container(self, script: str, timeout: float = 60) -> str:
        return shlex.join(self._wrap(with_remote_timeout(script, timeout)))

    def _host_line(self, script: str, timeout: float) -> str:
        return shlex.join(with_remote_timeout(script, timeout)) + "; exit $?"

    def host_command_line(self, script: str, timeout: float = 60) -> str:
        return self._ssh_command(self._host_line(script, timeout))

    def run_on_host(
        self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None
    ) -> Result:
        """Run `script` on the Proxmox host, which sees real GPU pids and each process's container."""
        # _exec classifies the answer: a `pct exec` inside the script fails the same way
        code, out, err, seconds = self._exec(
            self._host_line(script, timeout), stdin, local_limit_s(timeout), step
        )
        return finish(self.name, step, timeout, code, out, err, seconds)

    def _classify(self, code: int, stderr: bytes, step: str) -> None:
        if code == 0:
            return
        err = decode(stderr)
        first = err.lstrip().split("\n", 1)[0]
        where = f"container {self.ctid} on {self.spec.host}"
        for pattern, problem in _REFUSALS:
            m = pattern.match(first)
            if m and m.group("ctid") == str(self.ctid):
                raise ContainerNotRunning(self.name, step, f"{where} {problem.format(ctid=self.ctid)}", err)
        if code == 127 and "pct: command not found" in err:
            raise TransportError(
                self.name,
                step,
                f"`pct` not found on {self.spec.host}; is ssh.host the Proxmox "
                "host (not the container itself)?",
                err,
            )
