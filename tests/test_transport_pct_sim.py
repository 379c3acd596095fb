"""The pct simulator's own CLI: Proxmox's output formats and exit codes (see tests/sim/pct).

Expected texts come from pve-container's PVE/CLI/pct.pm (`status: %s`, the list format
"%-10s %-10s %-12s %-20s") and pve-common's CLIHandler (usage errors exit -1, i.e. 255).
"""
from __future__ import annotations

import os
import random
import subprocess

import pytest

try:
    from tests.sshd import SIM_DIR
except ImportError:
    from sshd import SIM_DIR

PCT = str(SIM_DIR / "pct")


def test_status_of_running_and_stopped(pct_target, stopped_pct_target, pct_cli):
    for ctid, status in ((200, "running"), (201, "stopped")):
        done = pct_cli("status", ctid)
        assert (done.returncode, done.stdout, done.stderr) == (0, f"status: {status}\n", "")


def test_list_table(pct_target, stopped_pct_target, pct_cli):
    done = pct_cli("list")
    assert done.returncode == 0
    assert done.stdout.splitlines() == [
        "VMID       Status     Lock         Name                ",
        "200        running                 ct200               ",
        "201        stopped                 ct201               ",
    ]


def test_unknown_container_exits_2(pct_cli):
    for command in ("status", "start", "stop", "exec"):
        done = pct_cli(command, 999, "--", "true") if command == "exec" else pct_cli(command, 999)
        assert done.returncode == 2, command
        assert done.stderr == "Configuration file 'nodes/pve/lxc/999.conf' does not exist\n"


@pytest.mark.parametrize("args,first_line", [
    (["status", "abc"], "400 Parameter verification failed."),
    (["status", "42"], "400 Parameter verification failed."),
    (["status"], "400 not enough arguments"),
    (["frobnicate", "200"], "ERROR: unknown command 'pct frobnicate'"),
    ([], "ERROR: no command specified"),
])
def test_bad_calls_exit_255_with_usage(pct_cli, args, first_line):
    done = pct_cli(*args)
    assert done.returncode == 255
    assert done.stderr.splitlines()[0] == first_line
    assert done.stdout == ""


def test_exec_refuses_a_stopped_container(stopped_pct_target, pct_cli):
    done = pct_cli("exec", 201, "--", "true")
    assert (done.returncode, done.stderr) == (255, "container '201' not running!\n")


def test_start_and_stop_refuse_the_wrong_state(pct_target, stopped_pct_target, pct_cli):
    assert (pct_cli("start", 200).returncode, pct_cli("start", 200).stderr) == (255, "CT 200 already running\n")
    assert (pct_cli("stop", 201).returncode, pct_cli("stop", 201).stderr) == (255, "CT 201 not running\n")


def test_exec_passes_argv_unchanged_without_a_shell(pct_target, pct_cli):
    words = ["$(echo pwned)", "`id`", "a b", "'", '"', "*", ";", "\\", "new\nline", "✓", "-n", ""]
    done = pct_cli("exec", 200, "--", "printf", "%s\\0", *words)
    assert done.returncode == 0
    assert done.stdout.split("\0")[:-1] == words


def test_exec_without_double_dash_takes_dash_words_for_options(pct_target, pct_cli):
    done = pct_cli("exec", 200, "ls", "-la")
    assert done.returncode == 255 and done.stderr.startswith("Unknown option: la\n400 unable to parse option")
    assert pct_cli("exec", 200, "hostname").stdout == "ct200\n"  # plain words are the command


def test_exec_passes_stdin_and_exit_codes(pct_target, pct_sim_root):
    env = {**os.environ, "PCT_SIM_ROOT": str(pct_sim_root)}

    def pct_exec(*argv, data=b""):
        return subprocess.run([PCT, "exec", "200", "--", *argv], input=data, capture_output=True, env=env, timeout=30)

    assert pct_exec("cat", data=b"\0\xff binary \n").stdout == b"\0\xff binary \n"
    assert pct_exec("sh", "-c", "exit 42").returncode == 42
    # killed by a signal: 128+N, as lxc-attach reports it (not a signal on pct itself)
    assert pct_exec("bash", "-c", "kill -TERM $$").returncode == 143
    assert pct_exec("no-such-command").returncode == 127


def test_a_locked_container_does_not_start(pct_cli, pct_sim_root):
    conf = pct_sim_root / "lxc" / "205.conf"
    conf.write_text("hostname: backup-me\nlock: backup\n")
    try:
        done = pct_cli("start", 205)
        assert (done.returncode, done.stderr) == (255, "CT is locked (backup)\n")
        assert "205        stopped    backup       backup-me           " in pct_cli("list").stdout.splitlines()
    finally:
        conf.unlink()


def test_without_namespaces_exec_and_stop_still_work(pct_sim_root):
    # The fallback for machines that refuse namespaces (unprivileged CI): forced here by env.
    conf = pct_sim_root / "lxc" / "206.conf"
    conf.write_text("hostname: plain\n")
    env = {**os.environ, "PCT_SIM_ROOT": str(pct_sim_root), "PCT_SIM_NO_NAMESPACES": "1"}

    def pct(*args):
        return subprocess.run([PCT, *args], capture_output=True, text=True, env=env, timeout=30)

    secs = f"{random.randint(10**6, 10**7)}.25"  # a sleep no other test run uses
    try:
        started = pct("start", "206")
        assert started.returncode == 0 and "plain process session" in started.stderr
        assert pct("exec", "206", "--", "tmux", "-L", "plain", "new-session", "-d", f"sleep {secs}").returncode == 0
        assert pct("exec", "206", "--", "tmux", "-L", "plain", "ls").returncode == 0  # persists across execs
        assert pct("stop", "206").returncode == 0
        leftovers = subprocess.run(["pgrep", "-f", f"sleep {secs}"], capture_output=True, text=True).stdout
        assert leftovers == ""
        assert pct("status", "206").stdout == "status: stopped\n"
    finally:
        if pct("status", "206").stdout == "status: running\n":
            pct("stop", "206")
        conf.unlink()
