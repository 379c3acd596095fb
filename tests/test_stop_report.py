"""What stop says about GPU processes that are not the job's."""
from __future__ import annotations

import dataclasses
import json
import os

from conftest import SIM_DIR

from dflash_ops import steps
from dflash_ops.playbook import StepContext
from dflash_ops.transport.local import LocalTransport


def test_a_dead_gpu_pid_on_a_plain_host_is_not_called_a_host_pid(local_target, tmp_path, monkeypatch):
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"gpus": [{"name": "NVIDIA H200", "memory_total_mib": 143771}],
                                 "compute_apps": [{"pid": 4_000_000, "gpu_index": 0, "used_memory_mib": 900}]}))
    monkeypatch.setenv("PATH", f"{SIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(state))
    job = dataclasses.replace(local_target.job, tmux_socket=f"deadpid-{tmp_path.name}"[:60], target_gpus=(0,))
    ctx = StepContext(target=dataclasses.replace(local_target, job=job), transport=LocalTransport("local"), job=job,
                      step="stop_session")
    outcome = steps.stop_session(ctx, session=job.session, grace_s=1)
    assert "pid 4000000 on GPU 0" in outcome.message and "exited" in outcome.message, outcome.message
    assert "host pid" not in outcome.message
