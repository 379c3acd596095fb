"""`status`: its JSON and its table, from hand-built reports and from a real probe."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops.observe import health, probe, status, status_output
from dflash_ops.observe.gpu import Gpu, GpuProcess, GpuSnapshot
from dflash_ops.job.model import Health, Job
from dflash_ops.observe.status import TargetStatus
from dflash_ops.transport.local import LocalTransport
from trainer import metrics_format

NOW = 50_000.0
JOB = Job(workdir="/srv/dflash", python="/srv/dflash/venv/bin/python", config="tiny-cpu", session="dflash",
          target_gpus=(0,), drafter_gpus=(1,), health=Health(stall_seconds=900))
SIM_DIR = Path(__file__).resolve().parent / "sim"


def records(loss=2.31412, eta=4980.0):
    text = metrics_format.encode("start", time=NOW - 500, total_steps=1000, config={}, devices=[],
                                 compile_lock="x", pid=1)
    text += metrics_format.encode("step", time=NOW - 22, step=119, total_steps=1000, loss=2.4, tokens_per_s=45000.0,
                                  eta_s=eta + 10, lr=1e-4, grad_norm=1.0)
    text += metrics_format.encode("step", time=NOW - 12, step=120, total_steps=1000, loss=loss, tokens_per_s=45400.0,
                                  eta_s=eta, lr=1e-4, grad_norm=1.0)
    return tuple(metrics_format.parse_lines(text))


SNAPSHOT = GpuSnapshot((
    Gpu(0, "GPU-0", "NVIDIA H200", 70000, 143771, 97, (GpuProcess(4123, 0, 69000, "python3"),)),
    Gpu(1, "GPU-1", "NVIDIA H200", 30000, 143771, None, ()),
), "nvidia-smi")


def make_report(recs=None, snapshot=SNAPSHOT, running=True):
    recs = records() if recs is None else recs
    return probe.ProbeReport(
        target="gpu-box", time=NOW, hostname="ct200", gpu=snapshot,
        session=probe.SessionState("dflash", "dflash", running, running, 4100 if running else None),
        processes=(probe.ProcessInfo(4100, 1, "bash", "S", "bash start.sh"),
                   probe.ProcessInfo(4123, 4100, "python3", "S", "python3 -m trainer.cli.main")),
        log_dir="/srv/dflash/logs",
        log=probe.FileTail("/srv/dflash/logs/train-0003.log", 10, NOW - 3, ("step 120",)),
        metrics=probe.FileTail("/srv/dflash/logs/train-0003.metrics.jsonl", 10, NOW - 12, ()),
        records=recs, seconds=0.21)


def test_status_json_fields():
    report = make_report()
    verdict = health.evaluate(report, JOB)
    st = status.build_status("gpu-box", report, JOB, verdict).to_json()
    json.dumps(st, allow_nan=False)  # plain JSON: what `status --json` prints
    assert st["target"] == "gpu-box" and st["hostname"] == "ct200" and st["probe_seconds"] == 0.21
    assert [(g["index"], g["name"], g["memory_used_mib"], g["memory_total_mib"], g["utilization_pct"], g["role"])
            for g in st["gpus"]] == [(0, "NVIDIA H200", 70000, 143771, 97, "target"),
                                     (1, "NVIDIA H200", 30000, 143771, None, "drafter")]
    # foreign None: this report cannot tell (pid 4123 is not visible where the probe ran)
    assert st["gpus"][0]["processes"] == [{"pid": 4123, "used_memory_mib": 69000, "name": "python3", "owner": None,
                                           "foreign": None}]
    assert st["gpus"][1]["ghost_memory_mib"] == 30000
    assert st["session"]["name"] == "dflash" and st["session"]["running"] is True
    assert st["training"] == {"step": 120, "total_steps": 1000, "loss": 2.31412, "tokens_per_s": 45200.0,
                              "eta_s": 4980.0, "last_update_age_s": 12.0, "finished": False}
    assert st["verdict"] == "OK" and st["reasons"] == list(verdict.reasons)
    assert [p["pid"] for p in st["processes"]] == [4100, 4123]
    assert st["log"].endswith("train-0003.log")


def test_status_json_has_no_nan():
    report = make_report(records(loss=float("nan")))
    st = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB)).to_json()
    assert st["training"]["loss"] is None and st["verdict"] == "CRITICAL"
    assert "loss is nan at step 120" in st["reasons"]
    json.dumps(st, allow_nan=False)


def test_table_lines():
    report = make_report()
    table = status_output.target_text(status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB)))
    lines = table.splitlines()
    assert lines[0] == "gpu-box (ct200)  probe 0.21 s"
    assert lines[1] == "[0] NVIDIA H200 |  97 % |  70000 / 143771 MiB | target  | python3/4123(69000M)"
    assert lines[2] == "[1] NVIDIA H200 |   N/A |  30000 / 143771 MiB | drafter | ghost(30000M)"
    assert lines[3] == "session dflash (tmux -L dflash): running, pane pid 4100"
    # 4980 s = 1 h 23 min; tokens/s is the median of 45000 and 45400
    assert lines[4] == "step 120/1000  loss 2.3141  45.2 Ktok/s  ETA 1:23  last metrics 12 s ago"
    assert lines[5] == "OK: step 120/1000, loss 2.3141, 45.2 Ktok/s, last step 12 s ago"
    assert "\033" not in table


def test_table_colour_only_when_asked():
    report = make_report(running=False)
    st = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB))
    plain, coloured = status_output.target_text(st), status_output.target_text(st, color=True)
    assert "\033" not in plain
    assert "\033[31mCRITICAL\033[0m: tmux session 'dflash' is gone" in coloured
    assert "session dflash (tmux -L dflash): not running" in plain


def test_no_driver_is_one_line_and_the_job_is_still_reported():
    snapshot = GpuSnapshot((), "nvidia-smi", "no NVIDIA driver (NVIDIA-SMI has failed because it couldn't "
                                             "communicate with the NVIDIA driver.)")
    report = make_report(snapshot=snapshot)
    st = status.build_status("gpu-box", report, Job(workdir="/w", python="/p", config="c"), health.evaluate(report, JOB))
    assert st.to_json()["gpus"] == [] and st.gpu_error.startswith("no NVIDIA driver")
    lines = status_output.target_text(st).splitlines()
    assert [line for line in lines if "GPU" in line or line.startswith("[")] == [
        f"GPUs: {snapshot.error}", f"WARNING: GPUs 0,1 are assigned but the GPU query failed: {snapshot.error}"]
    assert lines[2].startswith("session dflash") and lines[3].startswith("step 120/1000")


def test_unreachable_target_still_has_a_row():
    verdict = health.unknown("[gpu-box] ssh: connection refused")
    st = status.build_status("gpu-box", None, JOB, verdict)
    assert st.verdict.level == "UNKNOWN" and st.gpus == () and st.session.running is None
    assert st.training.step is None
    assert status_output.target_text(st) == ("gpu-box\n"
                                       "session dflash (tmux -L dflash): unknown\n"
                                       "step -  loss -  - Ktok/s  ETA -  no metrics yet\n"
                                       "UNKNOWN: [gpu-box] ssh: connection refused\n")


def test_a_status_reads_back_from_its_json():
    report = make_report()
    st = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB))
    assert TargetStatus.from_json(json.loads(json.dumps(st.to_json()))) == st
    unprobed = status.build_status("gpu-box", None, JOB, health.unknown("unreachable"))
    assert "eval_search" not in unprobed.to_json() and TargetStatus.from_json(unprobed.to_json()) == unprobed


def test_health_json_is_the_status_json_with_what_auto_relaunch_did():
    report = make_report()
    up = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB))
    down = status.build_status("gpu-2", None, JOB, health.unknown("unreachable"))
    assert json.loads(status_output.status_json([up], relaunched=None)) == json.loads(status_output.status_json([up]))
    assert json.loads(status_output.status_json([up, down], relaunched={"gpu-2": "auto-relaunch skipped"})) == [
        dict(up.to_json(), auto_relaunch=None), dict(down.to_json(), auto_relaunch="auto-relaunch skipped")]


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (22.4, "22 s"), (90, "1m30s"), (3599, "59m59s"), (4980, "1:23"),
                                           (90000, "25:00"), (None, "-")])
def test_format_eta(seconds, text):
    assert status_output.format_eta(seconds) == text


@pytest.mark.parametrize("seconds, text", [(12.4, "12 s"), (600, "10 min"), (9000, "2.5 h"), (None, "-")])
def test_format_age(seconds, text):
    assert status_output.format_age(seconds) == text


# --------------------------------------------------------------------------- from a real probe


def test_status_of_a_live_session_from_a_real_probe(tmp_path, monkeypatch):
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"gpus": [{"name": "NVIDIA H200", "memory_total_mib": 143771, "utilization_pct": 64}],
                                 "compute_apps": [{"pid": 912345, "gpu_index": 0, "used_memory_mib": 50000}]}))
    monkeypatch.setenv("PATH", f"{SIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(state))
    socket = f"dflash-status-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train-0001.log").write_text("starting\n")
    t = time.time()
    (logs / "train-0001.metrics.jsonl").write_text(
        metrics_format.encode("start", time=t - 30, total_steps=50, config={}, devices=[], compile_lock="x", pid=1)
        + metrics_format.encode("step", time=t - 2, step=5, total_steps=50, loss=4.0, tokens_per_s=800.0,
                                eta_s=90.0, lr=1e-4, grad_norm=1.0))
    job = Job(workdir=str(tmp_path), python=sys.executable, config="tiny-cpu", tmux_socket=socket, drafter_gpus=(0,))
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", job.session, "sleep 120"], check=True, timeout=30)
    try:
        report = probe.run_probe(LocalTransport("local"), job)
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
    st = status.build_status("local", report, job, health.evaluate(report, job))
    assert st.session.running is True
    assert st.gpus[0].memory_used_mib == 50000 and st.gpus[0].processes[0].pid == 912345
    assert st.training.step == 5 and st.training.eta_s == 90.0
    assert 0 <= st.training.last_update_age_s < 30
    assert st.verdict.level == "OK"
    table = status_output.target_text(st)
    assert "[0] NVIDIA H200 |  64 % |  50000 / 143771 MiB | drafter | python3/912345(50000M)" in table
    assert "step 5/50  loss 4.0000  0.8 Ktok/s  ETA 1m30s" in table


def test_status_shows_the_runs_data_source_from_its_start_record():
    start = metrics_format.encode("start", time=NOW - 500, total_steps=1000, devices=[], compile_lock="lock", pid=1,
                                  config={"data": {"source": "features", "path": "/data/feat cache", "seq_len": 3072}})
    report = make_report(tuple(metrics_format.parse_lines(start)) + records()[1:])
    st = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB))
    assert st.to_json()["data_source"] == "features /data/feat cache"
    assert status_output.target_text(st).splitlines()[4].endswith("last metrics 12 s ago  data features /data/feat cache")
    synthetic = metrics_format.encode("start", time=NOW, total_steps=1, devices=[], compile_lock="lock", pid=1,
                                      config={"data": {"source": "synthetic", "path": None}})
    assert status.data_source(metrics_format.parse_lines(synthetic)) == "synthetic"
    assert status.data_source(records()) is None  # an older trainer's start record: nothing shown
    assert status.build_status("gpu-box", None, JOB, health.unknown("unreachable")).to_json()["data_source"] is None


@pytest.mark.parametrize("state", ["stopped", "finished"])
def test_no_eta_for_a_stopped_or_finished_job(state):
    report = make_report(running=False)
    report = dataclasses.replace(report, job_state={"state": state, "run": 3, "log": report.log.path})
    st = status.build_status("gpu-box", report, JOB, health.evaluate(report, JOB))
    assert st.training.step == 120 and st.training.eta_s is None
    assert "ETA -" in status_output.target_text(st)


def test_no_eta_once_the_trainer_said_done():
    recs = records() + tuple(metrics_format.parse_lines(
        metrics_format.encode("done", time=NOW - 5, step=120, reason="interrupted")))
    st = status.build_status("gpu-box", make_report(recs), JOB, health.evaluate(make_report(recs), JOB))
    assert st.training.eta_s is None
