"""A `launcher: torchrun` job end to end over the real sshd: 2 CPU ranks of the REAL tiny trainer under
the real torchrun — relaunch, status from rank 0's metrics, stop ends every rank (with a checkpoint),
relaunch resumes, and a rank killed with SIGKILL makes the job CRITICAL with that rank named."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.transport.factory import connect

from dflash_ops.job import jobpaths
from dflash_ops.job.model import Health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = ("--set", "train.epochs=10000", "--set", "data.synthetic.num_samples=32", "--set", "run.checkpoint_every=1000")


def torchrun_job(target, tag):
    job = dataclasses.replace(target.job, tmux_socket=f"tr-{tag}", session=f"ranks {tag}", launcher="torchrun",
                              nproc_per_node=2, train_args=SMALL, health=Health(stall_seconds=120))
    return dataclasses.replace(target, job=job)


def job_processes(job) -> dict[int, str]:
    """pid -> RANK ('' for torchrun itself) of every python process carrying the job's marker (the pane's
    shell carries it too, with the trainer's command line among its arguments)."""
    return {pid: env.get("RANK", "") for pid, env in marked_python_processes(job).items()}


def marked_python_processes(job) -> dict[int, dict[str, str]]:
    """pid -> environment of every python process carrying the job's marker."""
    marker = f"{jobpaths.JOB_MARKER_ENV}={jobpaths.marker_value(job)}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in env and os.path.basename(cmd.split(b"\0")[0]).startswith(b"python"):
            found[int(pid)] = dict(e.decode(errors="replace").split("=", 1) for e in env if b"=" in e)
    return found


def launch_of(result):
    return next(s for s in result.steps if s.step == "launch")


def metrics_of(log: str) -> list[dict]:
    path = Path(log).with_name(Path(log).stem + ".metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_torchrun_job_relaunch_status_stop_resume_and_a_dead_rank(ssh_target):
    target = torchrun_job(ssh_target, uuid.uuid4().hex[:8])
    try:
        dry = commands.relaunch(target, timeout=240.0, dry_run=True)
        assert "-m torch.distributed.run --standalone --nproc-per-node 2 -m trainer" in launch_of(dry).message

        first = commands.relaunch(target, timeout=240.0, grace=60.0)
        assert first.ok, first.summary()
        ranks = job_processes(target.job)
        assert sorted(ranks.values()) == ["", "0", "1"], ranks  # torchrun and both ranks carry the marker

        checked = check_lib.check(target)
        assert checked.verdict.level == "OK", checked.verdict.reasons
        assert checked.status.training.total_steps == 40000  # 32 sequences / (2 ranks x 4) x 10000 epochs
        log = launch_of(first).data["log"]
        starts = [r for r in metrics_of(log) if r["event"] == "start"]
        assert len(starts) == 1 and starts[0]["config"]["run"]["launcher"] == "torchrun"  # rank 0 alone

        stopped = commands.stop(target, grace=60.0)
        assert stopped.ok and "0 needed SIGKILL" in stopped.steps[0].message, stopped.steps[0].message
        assert job_processes(target.job) == {}
        records = metrics_of(log)
        assert records[-1]["event"] == "done" and records[-1]["reason"] == "interrupted", records[-3:]
        assert any(r["event"] == "checkpoint" for r in records), "SIGTERM must leave a checkpoint"
        stopped_at = records[-1]["step"]
        assert "aborted" not in Path(log).read_text()  # torchrun's forwarded SIGTERM is not a second stop

        second = commands.relaunch(target, timeout=240.0, grace=60.0, deploy=False)
        assert second.ok, second.summary()
        assert second.steps[-1].data["step"]["step"] > stopped_at, "the relaunch did not resume"

        rank1 = next(pid for pid, rank in job_processes(target.job).items() if rank == "1")
        os.kill(rank1, signal.SIGKILL)
        deadline = time.time() + 90
        while job_processes(target.job) and time.time() < deadline:
            time.sleep(0.5)
        assert job_processes(target.job) == {}, "torchrun must end the other ranks"
        verdict = check_lib.check(target).verdict
        assert verdict.level == "CRITICAL"
        died = [r for r in verdict.reasons if r.startswith("rank died:")]
        assert died and f"rank 1 (local rank 1, pid {rank1}) exited with code -9 (SIGKILL)" in died[0], \
            verdict.reasons
        assert not any("ChildFailedError" in r for r in verdict.reasons), verdict.reasons
    finally:
        with connect(target) as t:
            t.run(f"tmux -L {target.job.tmux_socket} kill-server", timeout=30)
