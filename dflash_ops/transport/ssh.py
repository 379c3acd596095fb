"""The `ssh` target: bash over a raw paramiko channel of a fabric Connection, every argument quoted.
Not `Connection.run`: invoke decodes chunk by chunk (corrupting binary uploads and split characters)
and leaves stdin open; here stdin is bytes then EOF, and output is decoded once."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import socket
import threading
import time

import fabric
import paramiko

from dflash_ops.errors import ConnectError
from dflash_ops.job.model import HostSpec
from dflash_ops.remote import shell_command
from dflash_ops.transport.base import AFTER_EXIT_S, Transport, decode, outlived
from dflash_ops.transport.ssh_channel import drain, feed, first_line, passthrough, read_until_exit
from dflash_ops.transport.ssh_connect import SshConnecting

# paramiko's reader thread logs failures (with tracebacks) that we report as one clear error
# ourselves; without a handler Python's last-resort handler would print them on stderr.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def put_script(remote_path: str, mode: int, size: int) -> str:
    """bash storing stdin at remote_path atomically (remote/put_file.sh)."""
    return shell_command("put_file.sh", remote_path, f"{mode:o}", str(size))


class SshTransport(SshConnecting, Transport):
    def __init__(self, name: str, spec: HostSpec):
        super().__init__(name)
        self.spec = spec
        self.known_hosts = os.path.expanduser(spec.known_hosts_file or DEFAULT_KNOWN_HOSTS)
        self._conn: fabric.Connection | None = None
        self._gateway: fabric.Connection | None = None
        self._lock = threading.Lock()

    def _wrap(self, argv: list[str]) -> list[str]:
        return argv

    def _remote_line(self, argv: list[str]) -> str:
        # `; exit $?` stops the login shell from exec'ing the last command: a command killed by
        # a signal then ends the session with exit status 128+N instead of an ssh "exit-signal",
        # for which paramiko has no exit code.
        return shlex.join(self._wrap(argv)) + "; exit $?"

    def _command_line_of(self, argv: list[str]) -> str:
        return self._ssh_command(self._remote_line(argv))

    def _ssh_command(self, remote_line: str) -> str:
        """An equivalent OpenSSH command line, for --dry-run output and copy-paste."""
        s = self.spec
        argv = ["ssh", "-p", str(s.port)]
        if s.identity_file:
            argv += ["-i", s.identity_file, "-o", "IdentitiesOnly=yes"]
        if s.jump:
            argv += ["-J", s.jump.destination()]
        checking = {"strict": "yes", "accept-new": "accept-new", "off": "no"}[s.host_key_policy]
        options = (
            f"StrictHostKeyChecking={checking}",
            f"UserKnownHostsFile={self.known_hosts if s.host_key_policy != 'off' else '/dev/null'}",
            f"ConnectTimeout={int(s.connect_timeout_s)}",
        )
        argv += [word for option in options for word in ("-o", option)]
        return shlex.join([*argv, f"{s.user}@{s.host}", remote_line])

    def _open_channel(self, step: str) -> paramiko.Channel:
        for attempt in (1, 2):
            conn = self._connection(step)
            try:
                return conn.transport.open_session(timeout=self.spec.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                # A stale connection (server restarted, NAT dropped it): nothing has run yet, so
                # one fresh connection is safe.
                with self._lock:
                    self._close_quietly()
                if attempt == 2:
                    raise ConnectError(
                        self.name, step, f"cannot open an ssh session on {self.spec.host}: {exc}"
                    ) from None
        raise AssertionError("unreachable")

    def _exec(
        self, line: str, stdin: bytes | None, limit_s: float, step: str
    ) -> tuple[int, bytes, bytes, float]:
        start = time.monotonic()
        deadline = start + limit_s
        chan = self._open_channel(step)
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            chan.exec_command(line)
            threading.Thread(target=feed, args=(chan, stdin), daemon=True).start()
            stderr_reader = threading.Thread(target=drain, args=(chan.recv_stderr, err), daemon=True)
            stderr_reader.start()
            read_until_exit(chan, out, deadline)
            stderr_reader.join(max(0.0, min(deadline, time.monotonic() + AFTER_EXIT_S) - time.monotonic()))
            # EOF usually comes just before the exit status: wait for it, up to the deadline.
            if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                raise socket.timeout()
            code = chan.recv_exit_status()
        except socket.timeout:
            raise outlived(self.name, step, limit_s, b"".join(err), "gave up waiting") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            with self._lock:
                self._close_quietly()
            raise ConnectError(
                self.name, step, f"connection to {self.spec.host} lost: {exc}", decode(b"".join(err))
            ) from None
        finally:
            chan.close()
        if code == -1:
            raise ConnectError(
                self.name,
                step,
                f"the session on {self.spec.host} ended without an exit status "
                "(connection lost or the remote shell was killed)",
                decode(b"".join(err)),
            )
        self._classify(code, b"".join(err), step)
        return code, b"".join(out), b"".join(err), time.monotonic() - start

    def _classify(self, code: int, stderr: bytes, step: str) -> None:
        """Hook for errors recognised from the remote side (pct)."""

    def _execute(
        self, argv: list[str], stdin: bytes | None, limit_s: float, step: str
    ) -> tuple[int, bytes, bytes, float]:
        return self._exec(self._remote_line(argv), stdin, limit_s, step)

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        # the bytes go on the command's stdin, at least 1 MB/s
        self.check(
            put_script(remote_path, mode, len(data)), timeout=60 + len(data) / 1e6, step=step, stdin=data
        )

    @contextlib.contextmanager
    def hold(self, script: str, step: str = "hold", answer_s: float = 30):
        chan = self._open_channel(step)
        try:
            try:
                chan.exec_command(self._remote_line(["bash", "-c", script]))
                first = first_line(chan, time.monotonic() + answer_s)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise ConnectError(self.name, step, f"connection to {self.spec.host} lost: {exc}") from None
            yield first
        finally:
            try:
                chan.shutdown_write()  # EOF: the script ends and lets go of what it held
                chan.status_event.wait(10)
            except (paramiko.SSHException, EOFError, OSError):
                pass  # the connection is gone: so is the remote side's stdin
            finally:
                chan.close()

    def interactive(self, script: str) -> int:
        chan = self._open_channel("attach")
        try:
            size = shutil.get_terminal_size()
            chan.get_pty(term=os.environ.get("TERM", "xterm-256color"), width=size.columns, height=size.lines)
            chan.exec_command(self._remote_line(["bash", "-c", script]))
            passthrough(chan)
            return chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(self.name, "attach", f"connection to {self.spec.host} lost: {exc}") from None
        finally:
            chan.close()

    def close(self) -> None:
        with self._lock:
            self._close_quietly()
