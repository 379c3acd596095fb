"""relaunch → status → stop → relaunch (resume) with the REAL tiny trainer on the local target."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.transport.factory import connect
from dflash_ops.job.model import Health


def launch_of(result):
    return next(s for s in result.steps if s.step == "launch")


def test_real_tiny_trainer_relaunch_status_stop_resume(local_target):
    tag = uuid.uuid4().hex[:8]
    job = dataclasses.replace(local_target.job, tmux_socket=f"real-{tag}", session="tiny",
                              train_args=("--max-steps", "400"), health=Health(stall_seconds=120))
    target = dataclasses.replace(local_target, job=job)
    try:
        first = commands.relaunch(target, timeout=240.0, grace=60.0)
        assert first.ok, first.summary()
        step = first.steps[-1].data["step"]
        assert step["step"] >= 1 and step["loss"] > 0 and step["tokens_per_s"] > 0

        checked = check_lib.check(target)
        assert checked.verdict.level == "OK", checked.verdict.reasons
        assert checked.status.training.total_steps == 400

        stopped = commands.stop(target, grace=60.0)
        assert stopped.ok and "0 needed SIGKILL" in stopped.steps[0].message, stopped.steps[0].message
        assert check_lib.check(target).verdict.reasons[0].startswith("stopped by dflash-ops stop")
        log = Path(launch_of(first).data["log"])
        records = [json.loads(line) for line in log.with_name(log.stem + ".metrics.jsonl").read_text().splitlines()]
        assert records[-1]["event"] == "done" and records[-1]["reason"] == "interrupted"
        assert any(r["event"] == "checkpoint" for r in records), "SIGTERM must leave a checkpoint"
        stopped_at = records[-1]["step"]
        assert not (Path(job.workdir) / "runs" / "0001" / "FINISHED").exists()  # interrupted, not complete

        second = commands.relaunch(target, timeout=240.0, grace=60.0, deploy=False)
        assert second.ok, second.summary()
        assert second.steps[-1].data["step"]["step"] > stopped_at, "the relaunch did not resume"
        assert "--resume" in Path(launch_of(second).data["log"]).read_text()
    finally:
        with connect(target) as t:
            t.run(f"tmux -L {job.tmux_socket} kill-server", timeout=30)


def test_the_bundled_tiny_run_finishes_healthy_with_the_tau_its_accuracy_predicts(local_target):
    # The README's main job, whole: it must end OK, its measured tau near the one training accuracy
    # predicts (a memorising config ends in health's tau-gap WARNING).
    tag = uuid.uuid4().hex[:8]
    job = dataclasses.replace(local_target.job, tmux_socket=f"real-{tag}", session="tiny",
                              health=Health(stall_seconds=120))
    target = dataclasses.replace(local_target, job=job)
    try:
        assert commands.relaunch(target, timeout=240.0).ok
        deadline = time.monotonic() + 240
        checked = check_lib.check(target)
        while not checked.status.training.finished and time.monotonic() < deadline:
            time.sleep(2)
            checked = check_lib.check(target)
        assert checked.status.training.finished, checked.status.training
        assert checked.verdict.level == "OK", checked.verdict.reasons
        tau = checked.status.eval
        assert tau.step == checked.status.training.total_steps and tau.lossless, tau
        assert tau.tau >= 0.8 * tau.expected_tau, tau
    finally:
        with connect(target) as t:
            t.run(f"tmux -L {job.tmux_socket} kill-server", timeout=30)
