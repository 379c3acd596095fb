"""A job's tmux commands hold its session name as one word whatever it ends with: tmux ends a
command at any word ending in ";", so `kill-session -t =job;` would kill `job`, a different
session. Real tmux on a private socket."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from dflash_ops.job import tmux
from dflash_ops.job.model import Job
from dflash_ops.remote import procs


@pytest.fixture
def socket(tmp_path):
    name = f"w-{tmp_path.name}"[:40]
    yield name
    subprocess.run(["tmux", "-L", name, "kill-server"], capture_output=True)


def bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def sessions(socket: str) -> set[str]:
    out = subprocess.run(["tmux", "-L", socket, "list-sessions", "-F", "#{session_name}"],
                         capture_output=True, text=True).stdout
    return set(out.splitlines())


@pytest.mark.parametrize("name", ["job;", "a b;", "x;;"])
def test_a_session_name_ending_in_a_semicolon_is_that_session_and_no_other(tmp_path, socket, name):
    job = dataclasses.replace(Job(workdir=str(tmp_path), python=sys.executable, config="tiny-cpu"),
                              session=name, tmux_socket=socket)
    plain = name.rstrip(";")
    for session in (name, plain):  # the job's session, and one its name without ";" would reach
        started = subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", procs.tmux_word(session),
                                  "sleep 60"], capture_output=True, text=True)
        assert started.returncode == 0, started.stderr
    assert sessions(socket) == {name, plain}

    assert bash(tmux.has_session(job)).returncode == 0
    assert procs.parse_panes(bash(tmux.pane_pids(job)).stdout)
    bash(tmux.kill_session(job))
    assert sessions(socket) == {plain}, "kill-session ended another session than the job's"
    assert bash(tmux.has_session(job)).returncode != 0
