"""What stop says about GPU processes that are not the job's."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from conftest import SIM_DIR

from dflash_ops.act import steps
from dflash_ops.errors import StepFailed
from dflash_ops.act.context import StepContext
from dflash_ops.transport.local import LocalTransport
from trainer import stop_timing


def test_a_dead_gpu_pid_on_a_plain_host_is_not_called_a_host_pid(local_target, tmp_path, monkeypatch):
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"gpus": [{"name": "NVIDIA H200", "memory_total_mib": 143771}],
                                 "compute_apps": [{"pid": 4_000_000, "gpu_index": 0, "used_memory_mib": 900}]}))
    monkeypatch.setenv("PATH", f"{SIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(state))
    job = dataclasses.replace(local_target.job, tmux_socket=f"deadpid-{tmp_path.name}"[:60], target_gpus=(0,))
    ctx = StepContext(target=dataclasses.replace(local_target, job=job), transport=LocalTransport("local"),
                      step="stop_session")
    outcome = steps.stop_session(ctx, job, grace_s=stop_timing.ops_grace_floor(stop_timing.DEFAULT_STOP_GRACE_S))
    assert "pid 4000000 on GPU 0" in outcome.message and "exited" in outcome.message, outcome.message
    assert "host pid" not in outcome.message


def _gpu_ctx(local_target, tmp_path, monkeypatch, state: dict):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(state))
    monkeypatch.setenv("PATH", f"{SIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(path))
    job = dataclasses.replace(local_target.job, target_gpus=(0,))
    return StepContext(target=dataclasses.replace(local_target, job=job), transport=LocalTransport("local"),
                       step="wait_gpu_free")


def test_wait_gpu_free_waits_for_all_but_the_processes_it_is_told_to_ignore(local_target, tmp_path, monkeypatch):
    ctx = _gpu_ctx(local_target, tmp_path, monkeypatch, {
        "gpus": [{"name": "NVIDIA H200", "memory_total_mib": 143771}],
        "compute_apps": [{"pid": 4_000_000, "gpu_index": 0, "used_memory_mib": 7000, "process_name": "sleep"}]})
    wait = dict(timeout_s=0.3, max_used_mib=1024, poll_s=0.1)
    with pytest.raises(StepFailed, match="still busy after 0.3s: .*4000000"):
        steps.wait_gpu_free(ctx, ctx.target.job, None, **wait)
    outcome = steps.wait_gpu_free(ctx, ctx.target.job, steps.Ended(foreign=[{"pid": 4_000_000, "owner": ""}]), **wait)
    assert outcome.message == "GPUs 0 free of this job's processes (foreign processes left alone: 1)"


def test_wait_gpu_free_passes_a_failing_gpu_query_only_after_the_processes_ended(local_target, tmp_path,
                                                                                 monkeypatch):
    ctx = _gpu_ctx(local_target, tmp_path, monkeypatch, {"driver_error": True})
    wait = dict(timeout_s=0.3, max_used_mib=1024, poll_s=0.1)
    with pytest.raises(StepFailed, match="nvidia-smi failed"):
        steps.wait_gpu_free(ctx, ctx.target.job, None, **wait)  # nothing saw the job's processes end
    outcome = steps.wait_gpu_free(ctx, ctx.target.job, steps.Ended(foreign=[]), **wait)
    assert outcome.message.startswith("the job's processes are gone; GPUs not checked: nvidia-smi failed")
