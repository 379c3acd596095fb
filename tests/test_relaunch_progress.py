"""relaunch shows how its longest step (waiting for the first training step) is going."""
from __future__ import annotations

import dataclasses
import subprocess

import pytest

from dflash_ops.act import steps
from dflash_ops.act.context import StepContext
from dflash_ops.act.runner import StepEvent
from dflash_ops.cli.progress_view import CLEAR_LINE, ProgressPrinter
from dflash_ops.transport.local import LocalTransport


def test_wait_first_step_reports_elapsed_time_and_the_last_log_line(local_target, tmp_path):
    job = dataclasses.replace(local_target.job, tmux_socket=f"progress-{tmp_path.name}"[:60], session="job")
    log = tmp_path / "train-0001.log"
    log.write_text("compiling the drafter\nstill compiling (layer 3)\n")
    subprocess.run(["tmux", "-L", job.tmux_socket, "new-session", "-d", "-s", "job", "sleep 30"], check=True)
    shown, logged = [], []
    try:
        ctx = StepContext(target=local_target, transport=LocalTransport("local"), step="wait_first_step",
                          status=shown.append, log=logged.append)
        with pytest.raises(Exception, match="no training step after 1.5s"):
            steps.wait_first_step(ctx, job, steps.Launched(log=str(log)), timeout_s=1.5, poll_s=0.2)
    finally:
        subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], capture_output=True)
    assert len(shown) >= 2, shown
    assert all(s.startswith("waiting for the first step: ") and s.endswith(" s of 1.5 s") for s in shown), shown
    # the log's last line is shown once, not again with every status
    assert logged == ["log: still compiling (layer 3)"]


def test_wait_first_step_shows_each_new_log_line_once(local_target, tmp_path):
    job = dataclasses.replace(local_target.job, tmux_socket=f"progress2-{tmp_path.name}"[:60], session="job")
    log = tmp_path / "train-0001.log"
    log.write_text("launching run 0001\n")
    subprocess.run(["tmux", "-L", job.tmux_socket, "new-session", "-d", "-s", "job", "sleep 30"], check=True)
    logged = []

    def note(line):
        logged.append(line)
        if len(logged) == 1:
            with open(log, "a") as f:
                f.write("compiling the drafter\n")

    try:
        ctx = StepContext(target=local_target, transport=LocalTransport("local"), step="wait_first_step", log=note)
        with pytest.raises(Exception, match="no training step after 2s"):
            steps.wait_first_step(ctx, job, steps.Launched(log=str(log)), timeout_s=2, poll_s=0.2)
    finally:
        subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], capture_output=True)
    assert logged == ["log: launching run 0001", "log: compiling the drafter"]


def _status(message):
    return StepEvent("status", 7, 7, "wait_first_step", message=message)


def test_status_lines_are_live_on_a_terminal_and_every_15_s_elsewhere():
    now = [0.0]
    out = []
    printer = ProgressPrinter(out.append, is_tty=False, clock=lambda: now[0])
    printer(StepEvent("start", 7, 7, "wait_first_step"))
    for second in range(0, 46):
        now[0] = float(second)
        printer(_status(f"waiting {second} s"))
    assert [line.strip() for line in out] == ["waiting 15 s", "waiting 30 s", "waiting 45 s"]

    out.clear()
    live = ProgressPrinter(out.append, is_tty=True, clock=lambda: now[0])
    live(_status("waiting 1 s"))
    live(_status("waiting 2 s"))
    assert out == [CLEAR_LINE + "waiting 1 s", CLEAR_LINE + "waiting 2 s"]



def test_a_trainer_already_many_records_past_its_start_is_confirmed(local_target, tmp_path):
    """A fast trainer (or a late first look) leaves its start record far above the metrics tail; the
    first step is still this launch's and is found (before, the watch never saw it and waited out)."""
    import json
    import time

    from dflash_ops.job import jobpaths
    from trainer import metrics_format

    job = dataclasses.replace(local_target.job, workdir=str(tmp_path / "w"), tmux_socket=f"p3-{tmp_path.name}"[:60],
                              session="job")
    log = tmp_path / "train-0001.log"
    log.write_text("step 500\n")
    launched = time.time() - 5
    state = {"state": "running", "run": 1, "log": str(log), "pid": 1, "since": launched}
    state_file = jobpaths.state_file(job)
    (tmp_path / "w").mkdir()
    with open(state_file, "w") as f:
        json.dump(state, f)
    records = [metrics_format.encode("start", time=launched + 1, pid=1, total_steps=1000)]
    records += [metrics_format.encode("step", time=launched + 2, step=n, total_steps=1000, loss=1.0,
                                      tokens_per_s=10.0, eta_s=1.0, lr=1e-4, grad_norm=1.0) for n in range(1, 501)]
    with open(metrics_format.metrics_path_for_log(str(log)), "w") as f:
        f.writelines(records)
    subprocess.run(["tmux", "-L", job.tmux_socket, "new-session", "-d", "-s", "job", "sleep 30"], check=True)
    try:
        ctx = StepContext(target=local_target, transport=LocalTransport("local"), step="wait_first_step")
        outcome = steps.wait_first_step(ctx, job, steps.Launched(log=str(log)), timeout_s=3, poll_s=0.2)
    finally:
        subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], capture_output=True)
    assert outcome.message.startswith("step 500:"), outcome.message
