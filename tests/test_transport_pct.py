"""PctTransport through a real sshd to the pct simulator: containers that persist, stop and refuse."""
from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import pytest

from dflash_ops.errors import ContainerNotRunning, InputError, RemoteTimeout
from dflash_ops.transport.factory import make_transport
from dflash_ops.transport.pct import PctTransport


def _host_processes_with(marker: str) -> list[str]:
    """Command lines of live processes on this machine (any namespace) containing marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline}")
    return found


def test_commands_run_inside_the_container(pct_target, ssh_target):
    with make_transport(pct_target) as ct, make_transport(ssh_target) as host:
        assert ct.check("hostname").stdout == "ct200\n"
        assert host.check("hostname").stdout != "ct200\n"
        # its own pid namespace: pid 1 is the container's init, not the machine's
        assert "pct-init-200" in ct.check("tr '\\0' ' ' < /proc/1/cmdline").stdout


def test_stopped_container_names_target_step_and_stderr(stopped_pct_target):
    with make_transport(stopped_pct_target) as t, pytest.raises(ContainerNotRunning) as info:
        t.run("echo never", step="read metrics")
    err = info.value
    assert (err.target, err.step) == ("ct201", "read metrics")
    assert err.stderr.strip() == "container '201' not running!"
    text = str(err)
    assert "ct201" in text and "read metrics" in text and "pct start 201" in text and "not running!" in text
    assert err.__cause__ is None


def test_missing_container_says_it_does_not_exist(pct_target):
    target = dataclasses.replace(pct_target, name="ghost", ctid=299)
    with make_transport(target) as t, pytest.raises(ContainerNotRunning) as info:
        t.put(b"x", "/tmp/x", step="upload")
    assert "does not exist" in str(info.value) and "pct list" in str(info.value)
    assert "Configuration file 'nodes/pve/lxc/299.conf' does not exist" in info.value.stderr


def test_a_command_failing_with_similar_words_is_just_a_result(pct_target):
    # pct's refusal names OUR container; a command inside that reports on another one is not it
    with make_transport(pct_target) as t:
        result = t.run("echo \"container '999' not running!\" >&2; exit 255")
    assert (result.exit_code, result.stderr) == (255, "container '999' not running!\n")


def test_tmux_server_started_in_one_exec_lives_in_the_next(pct_target):
    with make_transport(pct_target) as t:
        t.check("tmux -L persist new-session -d -s job 'sleep 4242.5'")
    time.sleep(0.2)
    with make_transport(pct_target) as t2:  # a new ssh connection and a new pct exec
        out = t2.check("tmux -L persist has-session -t =job && tmux -L persist list-panes -t =job -F '#{pane_current_command}'")
        assert out.stdout == "sleep\n"
        t2.check("tmux -L persist kill-server")


def _unique_seconds() -> str:
    # sleep lengths nobody else uses: other test runs may share this machine
    return f"{random.randint(10**6, 10**7)}.5"


def test_pct_stop_kills_everything_inside(pct_target, pct_cli, pct_sim_root):
    a, b, c = (_unique_seconds() for _ in range(3))
    with make_transport(pct_target) as t:
        t.check(f"tmux -L doomed new-session -d -s job 'sleep {a}'; "
                f"setsid -f sleep {b} >/dev/null 2>&1; nohup sleep {c} >/dev/null 2>&1 &")
    time.sleep(0.2)
    markers = [f"sleep {a}", f"sleep {b}", f"sleep {c}", f"pct-init-200 ct200 {pct_sim_root}/"]
    assert all(_host_processes_with(m) for m in markers)
    stopped = pct_cli("stop", "200")
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, "", "")
    for marker in markers:
        assert _host_processes_with(marker) == [], marker
    assert pct_cli("status", "200").stdout == "status: stopped\n"
    assert pct_cli("start", "200").returncode == 0
    with make_transport(pct_target) as t:
        assert t.run("tmux -L doomed has-session -t =job").exit_code == 1  # a fresh container


def test_time_limit_kills_a_command_that_ignores_term(pct_target):
    # TERM is ignored, so `timeout` must KILL after KILL_AFTER_S: exit 137 -> RemoteTimeout
    secs = _unique_seconds()
    with make_transport(pct_target) as t:
        start = time.monotonic()
        with pytest.raises(RemoteTimeout) as info:
            t.run(f"trap '' TERM; sleep {secs}; sleep {secs}", timeout=1, step="stubborn")
        assert 6 <= time.monotonic() - start < 12
        assert "killed" in str(info.value)
        assert _host_processes_with(f"sleep {secs}") == []


def _inventory_error(target_yaml: str) -> str:
    """The inventory is the one place that checks a target; transports get only checked ones."""
    from dflash_ops.inventory.load import load_inventory_text

    with pytest.raises(InputError) as info:
        load_inventory_text("targets:\n  ct200:\n" + target_yaml
                            + "    job: {workdir: /w, python: /usr/bin/python3, config: tiny-cpu}\n")
    return str(info.value)


@pytest.mark.parametrize("bad", ["0", "99", '"200"', "true"])
def test_ctid_must_be_a_container_id(bad):
    message = _inventory_error(f"    transport: pct\n    host: h\n    ctid: {bad}\n")
    assert "ctid" in message and "ct200" in message, message


def test_factory_builds_each_kind(local_target, ssh_target, pct_target):
    assert type(make_transport(local_target)).__name__ == "LocalTransport"
    assert type(make_transport(ssh_target)).__name__ == "SshTransport"
    pct = make_transport(pct_target)
    assert isinstance(pct, PctTransport) and pct.ctid == 200


@pytest.mark.parametrize("target_yaml,words", [
    ("    transport: telnet\n", ["telnet", "local, ssh, pct"]),
    ("    transport: ssh\n", ["host"]),
    ("    transport: pct\n    host: h\n", ["ctid"]),
])
def test_incomplete_targets_are_refused(target_yaml, words):
    message = _inventory_error(target_yaml)
    assert all(w in message for w in words) and "ct200" in message, message
