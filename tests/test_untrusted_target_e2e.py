"""What the target says is data, never an order: a dead pane's pid taken over by a foreign process, a
symlinked cache path, damaged job state files, a deleted log whose metrics stay, two relaunches at once.

Real tmux, real sshd + the pct simulator (a container with its own pid namespace, so a test can put
a foreign process on a chosen pid through /proc/sys/kernel/ns_last_pid), the stand-in trainer.
Each test checks that no foreign process was signalled, no checkpoint was lost, and that every
failure is one line with a defined exit code and no traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_ops import jobpaths, ops
from dflash_ops.cli import main as cli_main

try:
    from tests.test_ops_e2e import cleanup, quick, standin, step  # noqa: F401 (cleanup: a fixture)
    from tests.test_unattended_e2e import alive, bystander, checkpoints, finite, job_state, wait_for  # noqa: F401
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_ops_e2e import cleanup, quick, standin, step  # noqa: F401
    from test_unattended_e2e import alive, bystander, checkpoints, finite, job_state, wait_for  # noqa: F401

# Run in the container: fork until a child gets pid WANT (ns_last_pid says which pid comes next in
# this pid namespace); that child leaves the session and becomes `sleep 300`, a process that has
# nothing to do with the job. Prints the pid it got.
ON_PID = r"""
import os, sys
want = int(sys.argv[1])
for _ in range(50):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(want - 1))
    pid = os.fork()
    if pid == 0:
        if os.getpid() == want:
            os.setsid()
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execvp("sleep", ["sleep", "300"])
        os._exit(0)
    if pid == want:
        print(pid)
        sys.exit(0)
    os.waitpid(pid, 0)
sys.exit("pid %d stayed taken" % want)
"""


def in_ct(target, script: str, timeout: float = 30):
    with ops.connect(target) as t:
        return t.run(script, timeout=timeout)


def foreign_on_pid(target, pid: int) -> int:
    """A real foreign process in the target's container, on `pid` (which must be free)."""
    got = in_ct(target, _python_c(ON_PID, str(pid)))
    assert got.ok, got.stderr
    assert int(got.stdout.strip()) == pid
    return pid


def _python_c(code: str, *args: str) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in (sys.executable, "-c", code, *args))


def alive_in(target, pid: int) -> bool:
    return in_ct(target, f"test -d /proc/{pid} && ! grep -q '^State:.*Z' /proc/{pid}/status").ok


def dead_pane_pid(target) -> int:
    """The pid tmux still lists for the job's pane after its trainer ended (remain-on-exit)."""
    out = in_ct(
        target,
        f"tmux -L {target.job.tmux_socket} list-panes -s -t '={target.job.session}:' "
        "-F '#{pane_pid} #{pane_dead}'",
    ).stdout.split()
    assert out[1] == "1", out
    return int(out[0])


def cli(*argv: str, inventory: Path) -> tuple[int, str, str]:
    """The CLI as cron runs it: its own process, so a traceback would show on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


# 1 ------------------------------------------------------------------------------------------------


def test_a_foreign_process_on_a_dead_panes_pid_is_never_the_jobs(pct_target, cleanup, bystander):
    target = finite(standin(pct_target), 6)
    cleanup(target)
    assert ops.run_playbook(target, "relaunch", quick()).ok
    wait_for(lambda: job_state(target)["state"] == "finished", what="the run to finish")
    pane = wait_for(lambda: _dead(target), what="tmux to reap the pane")
    foreign = foreign_on_pid(target, pane)
    kept = checkpoints(target, 1)
    try:
        checked = ops.check(target)
        assert foreign not in [p["pid"] for p in checked.status["processes"]], checked.status["processes"]

        stopped = ops.run_playbook(target, "stop", {"grace": 2.0})
        assert stopped.ok, stopped.summary()
        assert "ended" not in step(stopped, "stop_session").message, step(stopped, "stop_session").message
        assert alive_in(target, foreign), "stop signalled a foreign process that took the dead pane's pid"

        assert ops.run_playbook(target, "purge-cache").ok  # never "the job is running (pids <foreign>)"
        relaunched = ops.run_playbook(finite(target, 400), "relaunch", quick())
        assert relaunched.ok, relaunched.summary()
        assert alive_in(target, foreign)
        assert ops.run_playbook(target, "stop", {"grace": 5.0}).ok
        assert alive_in(target, foreign)
        assert set(kept) <= set(checkpoints(target, 1)) | set(checkpoints(target, 2))
    finally:
        in_ct(target, f"kill {foreign}")
    assert alive(bystander.pid)


def _dead(target):
    try:
        pid = dead_pane_pid(target)
    except AssertionError:
        return None
    # reaped: nothing (not even a zombie) holds the pid any more
    return pid if not in_ct(target, f"test -e /proc/{pid}").ok else None
