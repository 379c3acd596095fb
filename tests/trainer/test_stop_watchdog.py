"""The stop watchdog process: it ends a trainer whose Python code cannot run after a stop signal,
and never a healthy one, and it never outlives the trainer.

A small stand-in trainer (real StopWatchdog, real signals, a real GIL-holding regex) keeps these fast;
tests/trainer/test_shutdown.py runs the real trainer.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
AFTER_S = 1.5
STAND_IN = r"""
import os, re, signal, sys, time
from trainer.train.stop_watchdog import StopWatchdog
after_s, mode, work_s = float(sys.argv[1]), sys.argv[2], float(sys.argv[3])
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
watchdog = StopWatchdog.start(after_s)
print(watchdog.proc.pid, flush=True)
if mode == "fork":  # a child forked from the trainer gets a SIGTERM; the trainer does not
    child = os.fork()
    if child == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os._exit(0)
    os.waitpid(child, 0)
if mode == "hold-gil":
    re.match(r"(a+)+$", "a" * 64 + "b")  # never returns, never lets go of the GIL
while not got and mode not in ("no-signal", "fork"):
    time.sleep(0.01)
if mode == "disarm":
    watchdog.disarm()
time.sleep(work_s)  # checkpointing, say
print("finished", flush=True)
"""


def start(mode: str, work_s: float = 0.0) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(AFTER_S), mode, str(work_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    watchdog_pid = int(proc.stdout.readline())
    assert alive(watchdog_pid) and parent_of(watchdog_pid) == proc.pid
    return proc, watchdog_pid


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone_soon(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def finish(proc) -> tuple[str, str, float]:
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, err, time.monotonic() - began


def test_it_kills_a_trainer_whose_python_handler_cannot_run():
    proc, watchdog = start("hold-gil")
    time.sleep(0.3)  # the regex holds the GIL by now
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as `timeout` and ops' stop do: the watchdog ignores it
    out, err, took = finish(proc)
    assert proc.returncode == -signal.SIGKILL, err
    assert AFTER_S <= took < AFTER_S + 3, took
    assert (f"dflash-train watchdog: pid {proc.pid} still running 2 s after SIGTERM: the interpreter did not get "
            f"control back (a thread stuck in C code, stacks above); ending it with SIGKILL") in err, err
    assert 'File "<string>", line 17 in <module>' in err, err  # the stuck thread's stack, printed before
    assert "finished" not in out
    assert gone_soon(watchdog)


def test_a_disarmed_watchdog_leaves_a_trainer_that_takes_long_to_finish_alone():
    """The normal stop: the step ends, the trainer disarms, then checkpoints for longer than AFTER_S."""
    proc, watchdog = start("disarm", work_s=2 * AFTER_S)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err, _ = finish(proc)
    assert proc.returncode == 0 and "finished" in out, err
    assert "watchdog" not in err
    assert gone_soon(watchdog)


def test_it_exits_with_the_trainer_that_never_got_a_signal():
    proc, watchdog = start("no-signal", work_s=0.2)
    out, err, _ = finish(proc)
    assert proc.returncode == 0 and err == ""
    assert gone_soon(watchdog, within_s=0.5)  # end of file on the pipe: at once


def test_it_exits_when_the_trainer_is_killed():
    proc, watchdog = start("no-signal", work_s=60)
    proc.kill()
    finish(proc)
    assert gone_soon(watchdog, within_s=1.0)


def test_a_signal_to_a_forked_child_does_not_arm_it():
    proc, watchdog = start("fork", work_s=2 * AFTER_S)
    out, err, _ = finish(proc)
    assert proc.returncode == 0 and "finished" in out, err
    assert gone_soon(watchdog)
