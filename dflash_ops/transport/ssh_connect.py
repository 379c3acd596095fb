"""Opening an ssh target's connection: jump host, identity, host keys by policy, one clear error each."""

from __future__ import annotations

import contextlib
import base64
import hashlib
import os
import socket
import threading

import fabric
import paramiko

from dflash_ops.errors import AuthError, ConnectError, HostKeyError, InputError, TransportError
from dflash_ops.job.model import HostSpec
from dflash_ops.transport.known_hosts import HostKeys, read_host_keys


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


class _UnknownHostPolicy(paramiko.MissingHostKeyPolicy):
    """An unknown host: strict refuses, accept-new appends it to `record` (one line keeps the user's file)."""

    def __init__(self, known: HostKeys, record: str | None = None):
        self.known, self.known_hosts = known, record

    def missing_host_key(self, client, hostname, key):
        if self.known.is_revoked(key):
            raise _RevokedHostKey(hostname, key)
        if self.known_hosts is None:
            raise _UnknownHostKey(hostname, key)
        directory = os.path.dirname(self.known_hosts)
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class SshConnecting:
    """The connection half of SshTransport, which sets these attributes."""

    name: str
    spec: HostSpec
    known_hosts: str
    _conn: fabric.Connection | None
    _gateway: fabric.Connection | None
    _lock: threading.Lock

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
            record = None if s.host_key_policy == "strict" else self.known_hosts
            client.set_missing_host_key_policy(_UnknownHostPolicy(known, record))
        return conn

    def _connection(self, step: str) -> fabric.Connection:
        with self._lock:
            if self._conn is not None and self._conn.is_connected:
                return self._conn
            self._close_quietly()
            s = self.spec
            key = os.path.expanduser(s.identity_file) if s.identity_file else None
            if key and not os.path.isfile(key):
                problem = (
                    "is a directory; name the private key file in it (e.g. id_ed25519)"
                    if os.path.isdir(key)
                    else "does not exist; fix the path in the inventory"
                )
                raise InputError(f"target {self.name!r}: ssh.identity_file {s.identity_file!r} {problem}")
            gateway = None
            if s.jump:
                jump = s.jump
                gateway = self._gateway = self._open(
                    step, jump.host, jump.port, jump.user or s.user, "jump host "
                )
            conn = self._conn = self._open(step, s.host, s.port, s.user, "", gateway)
            conn.transport.set_keepalive(30)  # long `status --watch` sessions through NAT
            return conn

    def _open(self, step: str, host: str, port: int, user: str, what: str, gateway=None) -> fabric.Connection:
        """An open connection; any failure closes every connection and is raised as one clear error."""
        conn = None
        try:
            conn = self._new_connection(host, port, user, gateway)
            conn.open()
        except Exception as exc:  # noqa: BLE001 - every failure becomes one clear error
            error = self._connect_error(exc, step, host, port, user, what, conn)
            self._close_quietly(conn)
            raise error from None
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
        # the TCP connection was made but the server's `SSH-2.0-…` line never came
        transport = conn.client.get_transport() if conn is not None else None
        no_banner = transport is not None and transport.sock is not None and not transport.remote_version
        if no_banner and isinstance(exc, (paramiko.SSHException, EOFError, OSError)):
            return ConnectError(
                self.name,
                step,
                f"{what}{host}:{port} accepted the connection but sent no SSH "
                f"banner within {self.spec.connect_timeout_s:g} s (is it an SSH "
                "server? is sshd wedged?)",
            )
        host_key = self._host_key_problem(exc, port, host, what)
        if host_key:
            return HostKeyError(self.name, step, host_key)
        auth = self._auth_problem(exc, where, user)
        if auth:
            return AuthError(self.name, step, auth)
        return ConnectError(self.name, step, self._reach_problem(exc, host, port, what, where))

    def _host_key_problem(self, exc: BaseException, port: int, host: str, what: str) -> str | None:
        entry = known_hosts_entry(host, port)
        if isinstance(exc, paramiko.BadHostKeyException):
            with contextlib.suppress(OSError):
                if read_host_keys(self.known_hosts, entry).is_revoked(exc.key):
                    exc = _RevokedHostKey(entry, exc.key)  # revoked outranks "changed", as for ssh
        if isinstance(exc, _RevokedHostKey):
            return (
                f"{what}host key of {entry} ({fingerprint(exc.key)}) is marked @revoked in "
                f"{self.known_hosts}; refusing to connect (a revoked key may be in the wrong hands). Give "
                "the host a new key, or remove the @revoked line only if this key is trusted again"
            )
        if isinstance(exc, _UnknownHostKey):
            return (
                f"{what}host key of {entry} ({fingerprint(exc.key)}) is not in {self.known_hosts} and "
                f"ssh.host_key_policy is strict. Check the fingerprint on the host (ssh-keygen -lf "
                f"/etc/ssh/ssh_host_*_key.pub), then add it: "
                f"ssh-keyscan -p {port} {host} >> {self.known_hosts} "
                "(or set ssh.host_key_policy: accept-new to record it on first connect)"
            )
        if isinstance(exc, paramiko.BadHostKeyException):
            return (
                f"{what}host key of {entry} has CHANGED: the server offers {fingerprint(exc.key)}, "
                f"{self.known_hosts} has {fingerprint(exc.expected_key)}. This may be an attack; if the host "
                f"was reinstalled, remove the old key with: ssh-keygen -f {self.known_hosts} -R '{entry}'"
            )
        if (
            isinstance(exc, OSError)
            and exc.filename
            and os.path.abspath(exc.filename) == os.path.abspath(self.known_hosts)
        ):
            return f"cannot read {self.known_hosts} ({exc}); check ssh.known_hosts_file"
        return None

    def _auth_problem(self, exc: BaseException, where: str, user: str) -> str | None:
        if isinstance(exc, OSError) and exc.filename:
            return f"cannot read {exc.filename} ({exc.strerror}); check ssh.identity_file"
        if isinstance(exc, paramiko.PasswordRequiredException):
            return (
                f"{where}: the key {self.spec.identity_file} is passphrase-protected; "
                "load it into ssh-agent and drop ssh.identity_file, or use a key without one"
            )
        if isinstance(exc, paramiko.AuthenticationException):
            key = (
                f"key {self.spec.identity_file}" if self.spec.identity_file else "the agent's and ~/.ssh keys"
            )
            return (
                f"{where} refused {key} for user {user!r} ({exc}); check ssh.user, "
                "ssh.identity_file and the host's authorized_keys"
            )
        return None

    def _reach_problem(self, exc: BaseException, host: str, port: int, what: str, where: str) -> str:
        field = "ssh.jump" if what else "ssh.host"  # the inventory field that names this host
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve {what or 'host '}{host!r} ({exc.strerror}); check {field}"
        if isinstance(exc, paramiko.ChannelException):
            return (
                f"the jump host could not open a connection to {host}:{port} "
                f"({exc.text}); check ssh.host/ssh.port and that forwarding is allowed"
            )
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return (
                f"{where}: no answer within {self.spec.connect_timeout_s:g}s "
                f"(host down or port filtered? check {field})"
            )
        if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
            return f"{where}: connection refused (is sshd running on port {port}? check {field})"
        return f"{where}: {type(exc).__name__}: {exc}"

    def _close_quietly(self, opening: fabric.Connection | None = None) -> None:
        for conn in (opening, self._conn, self._gateway):
            if conn is not None:
                # noqa: BLE001 - closing a broken connection may fail; nothing to do
                with contextlib.suppress(Exception):
                    conn.close()
        self._conn = self._gateway = None
