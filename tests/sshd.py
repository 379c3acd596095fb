"""A real OpenSSH sshd on 127.0.0.1 for the tests, with its own config, host key and client key.

Used by tests/conftest.py; importable by any test (`from tests.sshd import ...`) that needs an
extra server, e.g. one with a different host key.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SIM_DIR = Path(__file__).resolve().parent / "sim"

SKIP_ENV = "DFLASH_SKIP_SSH_TESTS"


class MissingTool(RuntimeError):
    pass


def find_sshd() -> str:
    # sshd lives in sbin, which is not on every user's PATH; it must be run by absolute path
    # (it re-executes itself for each connection).
    path = shutil.which("sshd", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if not path:
        raise MissingTool(
            "OpenSSH server (sshd) not found: the transport tests run against a real sshd. "
            f"Install it (`apt-get install -y openssh-server`) or set {SKIP_ENV}=1 to skip these tests.")
    return path


def require_tools(*names: str) -> None:
    for name in names:
        if not shutil.which(name):
            raise MissingTool(f"`{name}` not found on PATH: the integration tests need it. "
                              f"Install it (see .ci/run) or set {SKIP_ENV}=1 to skip these tests.")


def make_keypair(path: Path, kind: str = "ed25519") -> Path:
    """Write an unencrypted key pair at path / path.pub; returns path."""
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"dflash-test-{path.name}", "-f", str(path)],
                   check=True, capture_output=True)
    return path


def known_hosts_line(host: str, port: int, pubkey_file: Path) -> str:
    """An OpenSSH known_hosts line for host:port (the [host]:port form for non-22 ports)."""
    kind, blob = pubkey_file.read_text().split()[:2]
    entry = host if port == 22 else f"[{host}]:{port}"
    return f"{entry} {kind} {blob}\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Sshd:
    """One running sshd. `host_key` is its private host key (its .pub next to it)."""

    port: int
    directory: Path
    host_key: Path
    config: Path
    process: subprocess.Popen
    session_env: dict

    @property
    def host_key_pub(self) -> Path:
        return Path(str(self.host_key) + ".pub")

    def known_hosts_line(self, host: str = "127.0.0.1") -> str:
        return known_hosts_line(host, self.port, self.host_key_pub)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _config_text(port: int, host_key: Path, authorized_keys: Path, pid_file: Path, session_env: dict) -> str:
    # SetEnv values are split on whitespace by sshd: keep paths free of spaces (they are tmp dirs).
    for key, value in session_env.items():
        if any(c.isspace() or c == '"' for c in value):
            raise ValueError(f"sshd SetEnv cannot carry {key}={value!r} (whitespace or quote)")
    setenv = " ".join(f"{k}={v}" for k, v in session_env.items())
    return "\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {host_key}",
        f"PidFile {pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin yes",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # the key files live in a world-readable tmp dir
        "AllowTcpForwarding yes",  # for the jump-host tests
        "MaxStartups 100",
        "MaxSessions 100",
        "LogLevel ERROR",
        "Subsystem sftp internal-sftp",
        f"SetEnv {setenv}",
        "",
    ])


def start_sshd(directory: Path, authorized_pubkeys: list[Path], session_env: dict,
               host_key: Path | None = None, attempts: int = 5, wrap: tuple[str, ...] = ()) -> Sshd:
    """Start sshd -D on a free loopback port; returns once it answers with an SSH banner. `wrap`
    runs it under a command that execs its arguments (e.g. a private mount namespace)."""
    sshd = find_sshd()
    directory.mkdir(parents=True, exist_ok=True)
    if host_key is None:
        host_key = make_keypair(directory / "ssh_host_ed25519_key")
    authorized = directory / "authorized_keys"
    authorized.write_text("".join(p.read_text() for p in authorized_pubkeys))
    # A root sshd insists on its privilege-separation directory.
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    last_error = ""
    for _ in range(attempts):  # another test run may grab the free port before sshd binds it
        port = free_port()
        config = directory / "sshd_config"
        config.write_text(_config_text(port, host_key, authorized, directory / "sshd.pid", session_env))
        log = open(directory / "sshd.log", "wb")
        proc = subprocess.Popen([*wrap, sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        if _wait_banner(port, proc, 15):
            return Sshd(port, directory, host_key, config, proc, dict(session_env))
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        last_error = (directory / "sshd.log").read_text(errors="replace")
        if "Address already in use" not in last_error:
            break
    raise RuntimeError(f"sshd did not start (config {directory / 'sshd_config'}):\n{last_error}")


def _wait_banner(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(64).startswith(b"SSH-2.0-"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False
