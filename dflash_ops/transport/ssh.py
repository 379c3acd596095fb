"""The `ssh` target: bash on a host reached with fabric/paramiko, one connection per transport.

The remote login shell parses our command line exactly once, so every argument is
`shlex.quote`d and nothing else is added but `; exit $?` (see `_remote_line`).

Commands run on a raw paramiko channel of the fabric Connection rather than through
`Connection.run`: invoke decodes stdin and stdout chunk by chunk ("replace" errors), which
corrupts binary uploads and multi-byte characters split across reads, and leaves remote stdin
open. Here stdin is sent as bytes and closed (EOF), and output is decoded once at the end.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import select
import shlex
import shutil
import signal
import socket
import sys
import threading
import time

import fabric
import paramiko

from ..errors import AuthError, ConnectError, HostKeyError, InputError, RemoteTimeout, TransportError
from ..model import HostSpec
from .base import (
    AFTER_EXIT_S,
    Result,
    Transport,
    decode,
    finish,
    local_limit_s,
    quote_argv,
    with_remote_timeout,
)
from .known_hosts import HostKeys, read_host_keys

# paramiko's reader thread logs failures (with tracebacks) that we report as one clear error
# ourselves; without a handler Python's last-resort handler would print them on stderr.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

POLL_S = 0.5  # how often a waiting read looks at the exit status
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def known_hosts_entry(host: str, port: int) -> str:
    """The name OpenSSH (and paramiko) files a host key under."""
    return host if port == 22 else f"[{host}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _UnknownHostKey(Exception):
    def __init__(self, entry: str, key: paramiko.PKey):
        super().__init__(entry)
        self.entry, self.key = entry, key


class _RevokedHostKey(_UnknownHostKey):
    pass


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """strict: an unknown host is refused (a changed key is refused by paramiko itself)."""

    def __init__(self, known: HostKeys):
        self.known = known

    def missing_host_key(self, client, hostname, key):
        if self.known.is_revoked(key):
            raise _RevokedHostKey(hostname, key)
        raise _UnknownHostKey(hostname, key)


class _RecordNew(paramiko.MissingHostKeyPolicy):
    """accept-new: trust an unknown host on first sight and append it to known_hosts.

    Appending one line (as OpenSSH does) keeps the user's comments and hashed entries; paramiko's
    own save would rewrite the whole file. A CHANGED key never reaches this policy.
    """

    def __init__(self, known_hosts: str, known: HostKeys):
        self.known_hosts, self.known = known_hosts, known

    def missing_host_key(self, client, hostname, key):
        if self.known.is_revoked(key):
            raise _RevokedHostKey(hostname, key)
        directory = os.path.dirname(self.known_hosts)
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def _put_script(remote_path: str, mode: int, size: int) -> str:
    """bash that stores stdin at remote_path atomically: temp file in the same dir, then rename.

    The size check keeps a transfer cut short (lost connection: the reader just sees EOF) from
    replacing a good file with a truncated one.
    """
    q = shlex.quote(remote_path)
    return f"""set -e
dest={q}
dir=$(dirname -- "$dest")
mkdir -p -- "$dir"
tmp=$(mktemp -- "$dir/.$(basename -- "$dest").tmp.XXXXXX")
trap 'rm -f -- "$tmp"' EXIT
cat > "$tmp"
got=$(stat -c %s -- "$tmp")
if [ "$got" != {size} ]; then echo "put: received $got of {size} bytes; $dest left unchanged" >&2; exit 1; fi
chmod {mode:o} -- "$tmp"
mv -f -- "$tmp" "$dest"
trap - EXIT
"""


def put_timeout_s(size: int) -> float:
    return 60 + size / 1e6  # at least 1 MB/s


class SshTransport(Transport):
    """Bash on an ssh host. One fabric Connection, opened on first use and reused by every run."""

    def __init__(self, name: str, spec: HostSpec):
        super().__init__(name)
        self.spec = spec
        self.known_hosts = os.path.expanduser(spec.known_hosts_file or DEFAULT_KNOWN_HOSTS)
        self._conn: fabric.Connection | None = None
        self._gateway: fabric.Connection | None = None
        self._lock = threading.Lock()

    # ---- the command line ------------------------------------------------------------------

    def _wrap(self, argv: list[str]) -> list[str]:
        """argv as run on the ssh host (PctTransport puts `pct exec CTID --` in front)."""
        return argv

    def _remote_line(self, argv: list[str]) -> str:
        # `; exit $?` stops the login shell from exec'ing the last command: a command killed by
        # a signal then ends the session with exit status 128+N instead of an ssh "exit-signal",
        # for which paramiko has no exit code.
        return quote_argv(self._wrap(argv)) + "; exit $?"

    def command_line(self, script: str, timeout: float = 60) -> str:
        return self._ssh_command(self._remote_line(with_remote_timeout(script, timeout)))

    def _ssh_command(self, remote_line: str) -> str:
        """An equivalent OpenSSH command line, for --dry-run output and copy-paste."""
        s = self.spec
        argv = ["ssh", "-p", str(s.port)]
        if s.identity_file:
            argv += ["-i", s.identity_file, "-o", "IdentitiesOnly=yes"]
        if s.jump:
            argv += ["-J", s.jump.destination()]
        checking = {"strict": "yes", "accept-new": "accept-new", "off": "no"}[s.host_key_policy]
        argv += [
            "-o",
            f"StrictHostKeyChecking={checking}",
            "-o",
            f"UserKnownHostsFile={self.known_hosts if s.host_key_policy != 'off' else '/dev/null'}",
            "-o",
            f"ConnectTimeout={int(s.connect_timeout_s)}",
            f"{s.user}@{s.host}",
            remote_line,
        ]
        return quote_argv(argv)

    # ---- connecting ------------------------------------------------------------------------

    def _new_connection(self, host: str, port: int, user: str, gateway=None) -> fabric.Connection:
        s = self.spec
        kwargs: dict[str, object] = {
            "banner_timeout": s.connect_timeout_s,
            "auth_timeout": s.connect_timeout_s,
        }
        if s.identity_file:
            # Only the named key, as OpenSSH's IdentitiesOnly: an agent or ~/.ssh keys must not
            # make a wrong inventory entry work by accident.
            kwargs.update(
                key_filename=[os.path.expanduser(s.identity_file)], look_for_keys=False, allow_agent=False
            )
        # The inventory is the whole truth about a host: ~/.ssh/config is not consulted.
        config = fabric.Config(overrides={"load_ssh_configs": False})
        conn = fabric.Connection(
            host,
            user=user,
            port=port,
            config=config,
            gateway=gateway,
            connect_timeout=max(1, int(round(s.connect_timeout_s))),
            connect_kwargs=kwargs,
        )
        client = conn.client
        if s.host_key_policy == "off":
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # in memory only, nothing saved
        else:
            entry = known_hosts_entry(host, port)
            known = (
                read_host_keys(self.known_hosts, entry)
                if os.path.exists(self.known_hosts)
                else HostKeys(entry)
            )
            for key in known.keys:  # what paramiko compares the server's key with
                client.get_host_keys().add(entry, key.get_name(), key)
            client.set_missing_host_key_policy(
                _RejectUnknown(known)
                if s.host_key_policy == "strict"
                else _RecordNew(self.known_hosts, known)
            )
        return conn

    def _connection(self, step: str) -> fabric.Connection:
        with self._lock:
            if self._conn is not None and self._conn.is_connected:
                return self._conn
            self._close_quietly()
            s = self.spec
            key = os.path.expanduser(s.identity_file) if s.identity_file else None
            if key and os.path.isdir(key):
                raise InputError(
                    f"target {self.name!r}: ssh.identity_file {s.identity_file!r} is a directory; "
                    "name the private key file in it (e.g. id_ed25519)"
                )
            if key and not os.path.isfile(key):
                raise InputError(
                    f"target {self.name!r}: ssh.identity_file {s.identity_file!r} does not exist; "
                    "fix the path in the inventory"
                )
            gateway = None
            if s.jump:
                jump, juser = s.jump, s.jump.user or s.user
                try:
                    gateway = self._gateway = self._new_connection(jump.host, jump.port, juser)
                    gateway.open()
                except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
                    error = self._connect_error(
                        exc, step, jump.host, jump.port, juser, "jump host ", self._gateway
                    )
                    self._close_quietly()
                    raise error from None
            try:
                conn = self._conn = self._new_connection(s.host, s.port, s.user, gateway)
                conn.open()
            except Exception as exc:  # noqa: BLE001
                error = self._connect_error(exc, step, s.host, s.port, s.user, "", self._conn)
                self._close_quietly()
                raise error from None
            conn.transport.set_keepalive(30)  # long `status --watch` sessions through NAT
            self._conn = conn
            return conn

    def _connect_error(
        self,
        exc: BaseException,
        step: str,
        host: str,
        port: int,
        user: str,
        what: str,
        conn: fabric.Connection | None = None,
    ) -> TransportError:
        where = f"{what}{user}@{host}:{port}"
        field = "ssh.jump" if what else "ssh.host"  # the inventory field that names this host
        entry = known_hosts_entry(host, port)
        if _connected_without_banner(conn) and isinstance(exc, (paramiko.SSHException, EOFError, OSError)):
            return ConnectError(
                self.name,
                step,
                f"{what}{host}:{port} accepted the connection but sent no SSH "
                f"banner within {self.spec.connect_timeout_s:g} s (is it an SSH "
                "server? is sshd wedged?)",
            )
        if isinstance(exc, paramiko.BadHostKeyException) and self._is_revoked(exc.key, entry):
            exc = _RevokedHostKey(entry, exc.key)  # revoked outranks "changed", as for ssh
        if isinstance(exc, _RevokedHostKey):
            return HostKeyError(
                self.name,
                step,
                f"{what}host key of {entry} ({fingerprint(exc.key)}) is marked @revoked in {self.known_hosts}; "
                "refusing to connect (a revoked key may be in the wrong hands). Give the host a new key, or "
                "remove the @revoked line only if this key is trusted again",
            )
        if isinstance(exc, _UnknownHostKey):
            return HostKeyError(
                self.name,
                step,
                f"{what}host key of {entry} ({fingerprint(exc.key)}) is not in {self.known_hosts} and "
                f"ssh.host_key_policy is strict. Check the fingerprint on the host (ssh-keygen -lf "
                f"/etc/ssh/ssh_host_*_key.pub), then add it: ssh-keyscan -p {port} {host} >> {self.known_hosts} "
                "(or set ssh.host_key_policy: accept-new to record it on first connect)",
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            return HostKeyError(
                self.name,
                step,
                f"{what}host key of {entry} has CHANGED: the server offers {fingerprint(exc.key)}, "
                f"{self.known_hosts} has {fingerprint(exc.expected_key)}. This may be an attack; if the host "
                f"was reinstalled, remove the old key with: ssh-keygen -f {self.known_hosts} -R '{entry}'",
            )
        if (
            isinstance(exc, OSError)
            and exc.filename
            and os.path.abspath(exc.filename) == os.path.abspath(self.known_hosts)
        ):
            return HostKeyError(
                self.name, step, f"cannot read {self.known_hosts} ({exc}); check ssh.known_hosts_file"
            )
        if isinstance(exc, OSError) and exc.filename:
            return AuthError(
                self.name, step, f"cannot read {exc.filename} ({exc.strerror}); check ssh.identity_file"
            )
        if isinstance(exc, paramiko.PasswordRequiredException):
            return AuthError(
                self.name,
                step,
                f"{where}: the key {self.spec.identity_file} is passphrase-protected; "
                "load it into ssh-agent and drop ssh.identity_file, or use a key without one",
            )
        if isinstance(exc, paramiko.AuthenticationException):
            key = (
                f"key {self.spec.identity_file}" if self.spec.identity_file else "the agent's and ~/.ssh keys"
            )
            return AuthError(
                self.name,
                step,
                f"{where} refused {key} for user {user!r} ({exc}); check ssh.user, "
                "ssh.identity_file and the host's authorized_keys",
            )
        if isinstance(exc, socket.gaierror):
            return ConnectError(
                self.name, step, f"cannot resolve {what or 'host '}{host!r} ({exc.strerror}); check {field}"
            )
        if isinstance(exc, paramiko.ChannelException):
            return ConnectError(
                self.name,
                step,
                f"the jump host could not open a connection to {host}:{port} "
                f"({exc.text}); check ssh.host/ssh.port and that forwarding is allowed",
            )
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return ConnectError(
                self.name,
                step,
                f"{where}: no answer within {self.spec.connect_timeout_s:g}s "
                f"(host down or port filtered? check {field})",
            )
        if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
            return ConnectError(
                self.name,
                step,
                f"{where}: connection refused (is sshd running on port {port}? check {field})",
            )
        return ConnectError(self.name, step, f"{where}: {type(exc).__name__}: {exc}")

    def _is_revoked(self, key: paramiko.PKey, entry: str) -> bool:
        try:
            return read_host_keys(self.known_hosts, entry).is_revoked(key)
        except OSError:
            return False

    # ---- running ---------------------------------------------------------------------------

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
        """Run one command line on a fresh channel; (exit code, stdout, stderr, seconds)."""
        start = time.monotonic()
        deadline = start + limit_s
        chan = self._open_channel(step)
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            chan.exec_command(line)
            threading.Thread(target=_feed, args=(chan, stdin), daemon=True).start()
            stderr_reader = threading.Thread(target=_drain, args=(chan.recv_stderr, err), daemon=True)
            stderr_reader.start()
            _read_until_exit(chan, out, deadline)
            stderr_reader.join(max(0.0, min(deadline, time.monotonic() + AFTER_EXIT_S) - time.monotonic()))
            # EOF usually comes just before the exit status: wait for it, up to the deadline.
            if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                raise socket.timeout()
            code = chan.recv_exit_status()
        except socket.timeout:
            raise RemoteTimeout(
                self.name,
                step,
                f"no answer within {limit_s:g}s although the remote `timeout` "
                "should have ended the command; gave up waiting",
                decode(b"".join(err)),
            ) from None
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
        return code, b"".join(out), b"".join(err), time.monotonic() - start

    def _classify(self, code: int, stderr: bytes, step: str) -> None:
        """Hook for errors recognised from the remote side (pct)."""

    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        line = self._remote_line(with_remote_timeout(script, timeout))
        code, out, err, seconds = self._exec(line, stdin, local_limit_s(timeout), step)
        self._classify(code, err, step)
        return finish(self.name, step, timeout, code, out, err, seconds)

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        self.check(
            _put_script(remote_path, mode, len(data)), timeout=put_timeout_s(len(data)), step=step, stdin=data
        )

    def interactive(self, script: str) -> int:
        chan = self._open_channel("attach")
        try:
            size = shutil.get_terminal_size()
            chan.get_pty(term=os.environ.get("TERM", "xterm-256color"), width=size.columns, height=size.lines)
            chan.exec_command(self._remote_line(["bash", "-c", script]))
            _passthrough(chan)
            return chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(self.name, "attach", f"connection to {self.spec.host} lost: {exc}") from None
        finally:
            chan.close()

    def close(self) -> None:
        with self._lock:
            self._close_quietly()

    def _close_quietly(self) -> None:
        for conn in (self._conn, self._gateway):
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - closing a broken connection may fail; nothing to do
                    pass
        self._conn = self._gateway = None


def _connected_without_banner(conn: fabric.Connection | None) -> bool:
    """The TCP connection was made but the server's `SSH-2.0-…` line never came."""
    transport = conn.client.get_transport() if conn is not None else None
    return transport is not None and transport.sock is not None and not transport.remote_version


def _read_until_exit(chan: paramiko.Channel, sink: list[bytes], deadline: float) -> None:
    """Collect stdout until EOF, or until AFTER_EXIT_S after the exit status arrived.

    A background process that kept the command's stdout open (`cmd &` without redirection)
    would otherwise hold the channel open for as long as it lives, as with plain ssh.
    Raises socket.timeout at the deadline.
    """
    grace_end = None
    while True:
        now = time.monotonic()
        if grace_end is None and chan.status_event.is_set():
            grace_end = now + AFTER_EXIT_S
        if grace_end is not None and now >= grace_end:
            return
        if now >= deadline:
            if chan.status_event.is_set():
                return
            raise socket.timeout()
        until = deadline if grace_end is None else min(deadline, grace_end)
        chan.settimeout(min(until - now, POLL_S))
        try:
            data = chan.recv(65536)
        except socket.timeout:
            continue
        if not data:
            return
        sink.append(data)


def _feed(chan: paramiko.Channel, data: bytes | None) -> None:
    """Send stdin, then EOF (so a remote `cat` ends; cron has no stdin to offer anyway)."""
    try:
        if data:
            chan.sendall(data)
        chan.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the command ended without reading all of it; its exit code tells the story


def _drain(recv, sink: list[bytes]) -> None:
    try:
        while True:
            data = recv(65536)
            if not data:
                return
            sink.append(data)
    except (OSError, EOFError, paramiko.SSHException):
        return


def _passthrough(chan: paramiko.Channel) -> None:
    """Copy the user's terminal to a pty channel and back until the remote side ends."""
    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    is_tty = os.isatty(in_fd)
    saved = None
    old_winch = None
    if is_tty:
        import termios
        import tty

        saved = termios.tcgetattr(in_fd)
        tty.setraw(in_fd)

        def resize(*_):
            size = shutil.get_terminal_size()
            chan.resize_pty(width=size.columns, height=size.lines)

        if threading.current_thread() is threading.main_thread():
            old_winch = signal.signal(signal.SIGWINCH, resize)
    watch = [chan, in_fd]
    try:
        while True:
            try:
                ready, _, _ = select.select(watch, [], [])
            except InterruptedError:
                continue
            if chan in ready:
                data = chan.recv(65536)
                if not data:
                    return
                os.write(out_fd, data)
            if in_fd in ready:
                data = os.read(in_fd, 4096)
                if data:
                    chan.sendall(data)
                else:
                    chan.shutdown_write()
                    watch = [chan]
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
