"""A stop request ends the trainer even while a drafter thread is stuck inside a compile."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.train.shutdown import WATCHDOG_MARGIN_S

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
STUCK = REPO / "tests" / "trainer" / "stuck_trainer.py"
ARGS = ["--config", "tiny-cpu", "--max-steps", "100000", "--drafter-devices", "cpu,cpu",
        "--set", "data.seq_len=32", "--set", "data.synthetic.num_samples=16", "--set", "train.epochs=30", "--set", "train.batch_size=2",
        "--set", "train.num_anchors=6", "--set", "run.torch_threads=1"]


def start_stuck_trainer(tmp_path, grace_s: float, *own: str) -> tuple[subprocess.Popen, Path]:
    markers = tmp_path / "markers"
    markers.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, str(STUCK), str(markers), *own, "--", *ARGS,
                             "--output-dir", str(tmp_path / "run"), "--metrics-file", str(metrics),
                             "--set", f"run.stop_grace_s={grace_s}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (markers / "stuck").exists():
        assert time.monotonic() < deadline, "drafter1 never got stuck"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # drafter0 finishes its step and waits at the barrier; the main thread waits
    return proc, metrics


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str, float]:
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, err, time.monotonic() - began


@pytest.mark.slow  # each test starts the real trainer (~35 s on two busy cores)
def test_sigterm_exits_after_the_grace_period_although_a_thread_is_stuck_in_a_compile(tmp_path):
    grace = 3.0
    proc, metrics = start_stuck_trainer(tmp_path, grace)
    assert (tmp_path / "markers" / "stuck").read_text() == "drafter1"
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode == 130, err[-3000:]
    # grace, then at most 5 s for the healthy threads to leave; far below ops' 30 s SIGKILL
    assert grace <= took < grace + 12, took
    assert ("SIGTERM 3 s ago (run.stop_grace_s): step 3 did not finish: drafter0 (waiting for the others at the "
            "gradient barrier), drafter1 (in forward+backward); exiting without a checkpoint") in out, out
    assert "exiting with threads still running: drafter1" in err
    done = records(metrics)[-1]
    assert done["event"] == "done" and done["reason"] == "interrupted" and done["step"] == 2, done


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once(tmp_path):
    proc, metrics = start_stuck_trainer(tmp_path, 120.0)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=60)
    assert proc.returncode == 130 and took < 15, (proc.returncode, took, err[-2000:])
    assert "second SIGTERM: stopping without a checkpoint" in out
    assert records(metrics)[-1]["event"] == "done"


WATCHDOG_LINE = "the interpreter did not get control back (a thread stuck in C code, stacks above); ending it with SIGKILL"


def hold_the_gil(tmp_path) -> None:
    (tmp_path / "markers" / "hold-gil").write_text("")
    time.sleep(0.5)  # drafter1 polls for the marker every 0.05 s, then never lets go of the GIL


def assert_ended_by_the_watchdog(proc, out, err, took, grace):
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-3000:])
    assert grace + WATCHDOG_MARGIN_S - 1 <= took < grace + WATCHDOG_MARGIN_S + 10, took
    assert f"dflash-train watchdog: pid {proc.pid} still running" in err and WATCHDOG_LINE in err, err[-3000:]
    assert "stuck_backend" in err, err[-3000:]  # every thread's stack, the stuck one's too


@pytest.mark.slow
def test_the_watchdog_ends_the_process_when_the_main_thread_cannot_run(tmp_path):
    """drafter1 holds the GIL after the signal was handled: the main thread cannot act on it."""
    grace = 2.0
    proc, _ = start_stuck_trainer(tmp_path, grace, "--hold-gil")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the handler has run (the main thread polls every 0.1 s)
    hold_the_gil(tmp_path)
    out, err, took = finish(proc, timeout=60)
    assert_ended_by_the_watchdog(proc, out, err, took - 0.5, grace)


@pytest.mark.slow
def test_sigterm_ends_the_trainer_although_its_python_handler_never_runs(tmp_path):
    """drafter1 holds the GIL BEFORE the signal: no Python code runs after it, the handler included."""
    grace = 2.0
    proc, _ = start_stuck_trainer(tmp_path, grace, "--hold-gil")
    hold_the_gil(tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err, took = finish(proc, timeout=60)
    assert_ended_by_the_watchdog(proc, out, err, took, grace)
    assert "SIGTERM" not in out  # the trainer itself never said anything after the signal


# --------------------------------------------------------------------------- the request itself, in process


def test_a_stop_is_overdue_only_once_its_grace_has_passed(monkeypatch):
    from trainer.train import shutdown

    now = [50.0]
    monkeypatch.setattr(shutdown.time, "monotonic", lambda: now[0])
    stop = shutdown.StopRequest(grace_s=2.5)
    assert stop.overdue() is None, "nothing requested: never overdue"
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and stop.signal_name == "SIGTERM" and stop.requested_at == 50.0
    now[0] = 52.4
    assert stop.overdue() is None
    now[0] = 52.5
    assert stop.overdue() == "SIGTERM 2.5 s ago (run.stop_grace_s)"
    with pytest.raises(KeyboardInterrupt, match="second SIGINT: stopping without a checkpoint"):
        stop._handle(signal.SIGINT, None)


def test_install_takes_the_signals_and_uninstall_gives_them_back():
    import threading

    from trainer.train.shutdown import StopRequest

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = StopRequest().install()
    try:
        assert all(signal.getsignal(sig) == stop._handle for sig in before)
    finally:
        stop.uninstall()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    elsewhere = []  # signals only reach the main thread: another thread installs nothing
    thread = threading.Thread(target=lambda: elsewhere.append(StopRequest().install()._previous))
    thread.start()
    thread.join()
    assert elsewhere == [{}]


def test_only_worker_threads_still_running_hold_up_an_abort(monkeypatch, capsys):
    import threading

    from trainer.train import shutdown

    release = threading.Event()

    class Worker(threading.Thread):
        dflash_worker = True

    stuck = Worker(target=release.wait, name="drafter1")
    plain = threading.Thread(target=release.wait, name="not-a-worker")
    exits = []
    monkeypatch.setattr(shutdown.os, "_exit", exits.append)
    shutdown.exit_if_threads_stuck(130)
    assert exits == [] and shutdown.worker_threads_alive() == []
    stuck.start()
    plain.start()
    try:
        assert shutdown.worker_threads_alive() == ["drafter1"]
        shutdown.exit_if_threads_stuck(130)
    finally:
        release.set()
        stuck.join()
        plain.join()
    assert exits == [130]
    assert capsys.readouterr().err == "dflash-train: exiting with threads still running: drafter1\n"
