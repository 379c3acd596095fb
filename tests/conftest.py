"""Shared fixtures: a REAL OpenSSH sshd on 127.0.0.1 and a simulated Proxmox host behind it.

Session-scoped (started once per test run, ~0.3 s):

  sshd_server       tests.sshd.Sshd: sshd on a free loopback port, own config/host key; root login
                    with `client_key`. Its sessions get (sshd_config SetEnv):
                      PATH                  tests/sim first: `pct` and `nvidia-smi` simulators
                      PCT_SIM_ROOT          `pct_sim_root`
                      NVIDIA_SMI_SIM_STATE  `gpu_state_path`
                      SHLVL=1               so bash skips root's ~/.bashrc (see _session_env)
  sshd_server_b     a second, independent sshd (own port and host key), for fan-out tests
  client_key        Path of the private key both servers accept (its .pub next to it)
  known_hosts       Path of a known_hosts file holding both servers' host keys
  pct_sim_root      Path of the simulated Proxmox host's state (see tests/sim/pct): containers
                    200 (hostname "ct200", started) and 201 ("ct201", stopped)
  gpu_state_path    Path the nvidia-smi simulator reads (the file itself is NOT created here;
                    a test that writes it should remove it afterwards)

Per test (cheap; they restore the container state first):

  ssh_spec / ssh_spec_b   dflash_ops.job.model.HostSpec for each server (strict host keys)
  ssh_target / ssh_target_b  Target(transport="ssh") on each server
  pct_target        Target(transport="pct", ctid=200); container 200 is running
  stopped_pct_target  Target(transport="pct", ctid=201); container 201 is stopped
  pct_cli           run the pct simulator on this machine: pct_cli("status", "200") -> CompletedProcess
  local_target      Target(transport="local")
  silent_server     port of a TCP server that accepts and never sends an SSH banner

Targets' jobs point at a fresh tmp dir (`job.workdir`), python = this interpreter.
A "container" shares the host's filesystem (only /proc, pids and the hostname are its own), so
files a test puts there are visible to the test directly.

Missing sshd/tmux/unshare FAIL these fixtures with the fix in the message; set
DFLASH_SKIP_SSH_TESTS=1 to skip the tests that use them instead.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

try:
    from tests import sshd as sshd_helpers
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import sshd as sshd_helpers

from dflash_ops.inventory.load import inventory_from_data
from dflash_ops.job.model import HostSpec, Job, Target

SIM_DIR = sshd_helpers.SIM_DIR
RUNNING_CT, STOPPED_CT = 200, 201

# Every tmux server the tests start (here, through LocalTransport, or in sshd sessions) puts its
# socket in this run's own directory, never in the machine's /tmp/tmux-UID. tmux 3.3 leaves a dead
# server's socket file behind, so after each test its new servers are killed and their files
# removed, and the directory goes at the end of the run.
TMUX_DIR = Path(tempfile.mkdtemp(prefix="dflash-tests-tmux-", dir=os.environ.get("TMUX_TMPDIR") or None))
os.environ["TMUX_TMPDIR"] = str(TMUX_DIR)

# Scripts the tests run by name (`#!/usr/bin/env python3`, e.g. tests/sim/standin-trainer) must get
# this interpreter and its packages, as in an activated virtualenv, whatever python3 PATH has first.
_THIS_PYTHON_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _THIS_PYTHON_BIN:
    os.environ["PATH"] = _THIS_PYTHON_BIN + os.pathsep + os.environ.get("PATH", "")


def _tmux_sockets() -> set[Path]:
    return set(TMUX_DIR.glob("tmux-*/*"))


def _end_tmux(sockets) -> None:
    for socket_file in sockets:
        subprocess.run(["tmux", "-S", str(socket_file), "kill-server"], capture_output=True, timeout=30)
        socket_file.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _tmux_cleanup():
    """Each test ends the tmux servers it started and removes their socket files."""
    before = _tmux_sockets()
    yield
    _end_tmux(_tmux_sockets() - before)


def pytest_sessionfinish(session, exitstatus):
    _end_tmux(_tmux_sockets())
    shutil.rmtree(TMUX_DIR, ignore_errors=True)


def _need_tools() -> None:
    if os.environ.get(sshd_helpers.SKIP_ENV) == "1":
        pytest.skip(f"{sshd_helpers.SKIP_ENV}=1: tests against a real sshd/tmux are skipped")
    try:
        sshd_helpers.find_sshd()
        sshd_helpers.require_tools("ssh-keygen", "tmux", "unshare", "nsenter", "setsid", "timeout", "bash")
    except sshd_helpers.MissingTool as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def _ssh_base(tmp_path_factory) -> Path:
    _need_tools()
    return tmp_path_factory.mktemp("ssh")


@pytest.fixture(scope="session")
def client_key(_ssh_base) -> Path:
    return sshd_helpers.make_keypair(_ssh_base / "client_ed25519")


@pytest.fixture(scope="session")
def gpu_state_path(_ssh_base) -> Path:
    return _ssh_base / "gpu-state.json"


def pct_env(root: Path) -> dict:
    return {**os.environ, "PCT_SIM_ROOT": str(root)}


@pytest.fixture(scope="session")
def pct_sim_root(_ssh_base):
    root = _ssh_base / "pve"
    (root / "lxc").mkdir(parents=True)
    for ctid in (RUNNING_CT, STOPPED_CT):
        (root / "lxc" / f"{ctid}.conf").write_text(f"arch: amd64\nhostname: ct{ctid}\nostype: debian\n")
    yield root
    # Stop whatever is still running, so no container outlives the test run.
    for conf in (root / "lxc").glob("*.conf"):
        ctid = conf.stem
        if _pct(root, "status", ctid).stdout.strip() == "status: running":
            _pct(root, "stop", ctid)


def _pct(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SIM_DIR / "pct"), *args], env=pct_env(root), capture_output=True, text=True, timeout=60)


@pytest.fixture
def pct_cli(pct_sim_root):
    """Run the pct simulator here (as the Proxmox host's root would): pct_cli("list")."""
    return lambda *args: _pct(pct_sim_root, *map(str, args))


def _session_env(pct_root: Path, gpu_state: Path) -> dict:
    python_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join([str(SIM_DIR), python_bin, "/usr/local/sbin", "/usr/local/bin",
                            "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    # SHLVL=1: Debian's bash sources ~/.bashrc for every ssh command unless it is nested; this
    # machine's root .bashrc (pyenv init) costs ~0.3 s per command, which a lean Proxmox host's
    # does not, and it would reorder PATH. The sessions see exactly the PATH above.
    return {"PATH": path, "PCT_SIM_ROOT": str(pct_root), "NVIDIA_SMI_SIM_STATE": str(gpu_state), "SHLVL": "1",
            "TMUX_TMPDIR": str(TMUX_DIR)}


def _serving_sshd(folder: Path, client_key: Path, pct_root: Path, gpu_state: Path):
    server = sshd_helpers.start_sshd(folder, [Path(f"{client_key}.pub")], _session_env(pct_root, gpu_state))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sshd_server(_ssh_base, client_key, pct_sim_root, gpu_state_path):
    yield from _serving_sshd(_ssh_base / "sshd-a", client_key, pct_sim_root, gpu_state_path)


@pytest.fixture(scope="session")
def sshd_server_b(_ssh_base, client_key, pct_sim_root, gpu_state_path):
    yield from _serving_sshd(_ssh_base / "sshd-b", client_key, pct_sim_root, gpu_state_path)


@pytest.fixture(scope="session")
def known_hosts(_ssh_base, sshd_server, sshd_server_b) -> Path:
    path = _ssh_base / "known_hosts"
    path.write_text(sshd_server.known_hosts_line() + sshd_server_b.known_hosts_line())
    return path


def _written(obj) -> dict:
    """The fields of a model dataclass that differ from their defaults."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if getattr(obj, f.name) != f.default}


def checked(target: Target) -> Target:
    """`target` as the inventory builds it from the same fields. The inventory is the one place
    that checks a target and the transports trust it, so a fixture's target must pass it too."""
    fields = {**_written(target), **_written(target.ssh)}
    fields["job"] = {key: getattr(target.job, key) for key in ("workdir", "python", "config")}
    del fields["name"], fields["ssh"]
    built = inventory_from_data({"targets": {target.name: fields}}, "conftest.py", os.getcwd())
    assert built.targets[target.name] == target, "the inventory reads this fixture's target differently"
    return built.targets[target.name]


def host_spec(server, client_key: Path, known_hosts: Path) -> HostSpec:
    spec = HostSpec(host="127.0.0.1", port=server.port, user="root", identity_file=str(client_key),
                    host_key_policy="strict", known_hosts_file=str(known_hosts), connect_timeout_s=5.0)
    return checked(Target(name="box", transport="ssh", job=make_job(Path("/srv/w")), ssh=spec)).ssh


def make_job(workdir: Path) -> Job:
    return Job(workdir=str(workdir), python=sys.executable, config="tiny-cpu")


@pytest.fixture
def ssh_spec(sshd_server, client_key, known_hosts) -> HostSpec:
    return host_spec(sshd_server, client_key, known_hosts)


@pytest.fixture
def ssh_spec_b(sshd_server_b, client_key, known_hosts) -> HostSpec:
    return host_spec(sshd_server_b, client_key, known_hosts)


@pytest.fixture
def local_target(tmp_path) -> Target:
    return Target(name="local", transport="local", job=make_job(tmp_path / "work-local"))


@pytest.fixture
def ssh_target(ssh_spec, tmp_path) -> Target:
    return checked(Target(name="box-a", transport="ssh", job=make_job(tmp_path / "work-a"), ssh=ssh_spec))


@pytest.fixture
def ssh_target_b(ssh_spec_b, tmp_path) -> Target:
    return checked(Target(name="box-b", transport="ssh", job=make_job(tmp_path / "work-b"), ssh=ssh_spec_b))


def _ensure(root: Path, ctid: int, running: bool) -> None:
    is_running = _pct(root, "status", str(ctid)).stdout.strip() == "status: running"
    if is_running != running:
        done = _pct(root, "start" if running else "stop", str(ctid))
        if done.returncode != 0:
            pytest.fail(f"pct simulator could not {'start' if running else 'stop'} CT {ctid}: {done.stderr}",
                        pytrace=False)


@pytest.fixture
def pct_target(ssh_spec, pct_sim_root, tmp_path) -> Target:
    _ensure(pct_sim_root, RUNNING_CT, True)
    return checked(Target(name=f"ct{RUNNING_CT}", transport="pct", job=make_job(tmp_path / "work-ct"),
                          ssh=ssh_spec, ctid=RUNNING_CT))


@pytest.fixture
def stopped_pct_target(ssh_spec, pct_sim_root, tmp_path) -> Target:
    _ensure(pct_sim_root, STOPPED_CT, False)
    return checked(Target(name=f"ct{STOPPED_CT}", transport="pct", job=make_job(tmp_path / "work-ct-stopped"),
                          ssh=ssh_spec, ctid=STOPPED_CT))


@pytest.fixture
def silent_server():
    """Accepts TCP connections and never says a word (a wedged sshd, a port forward to nothing)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()
