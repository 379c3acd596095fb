"""The phases of a whole job (act/phases.py) on real tmux panes on this machine: two local 'nodes'."""

from __future__ import annotations

import os
import subprocess
import sys

from dflash_ops.act import phases, steps
from dflash_ops.act.nodes import JobContext, Node
from dflash_ops.errors import StepFailed
from dflash_ops.job import model
from dflash_ops.transport.local import LocalTransport


def node(tmp_path, index: int) -> Node:
    socket = f"phases-{os.getpid()}-{index}"
    job = model.Job(workdir=str(tmp_path / f"w{index}"), python=sys.executable, config="tiny-cpu",
                    session="job", tmux_socket=socket)
    return Node(index, model.Target(name=f"box-{index}", transport="local", job=job), LocalTransport(f"box-{index}"))


def test_a_node_whose_trainer_is_gone_ends_the_wait_for_node_0s_first_step(tmp_path):
    nodes = (node(tmp_path, 0), node(tmp_path, 1))
    first = nodes[0].target.job
    subprocess.run(["tmux", "-L", first.tmux_socket, "new-session", "-d", "-s", "job", "sleep 60"], check=True)
    try:
        ctx = JobContext(nodes[0].target, nodes[0].transport, job_name="pair", nodes=nodes, step="wait_first_step")
        logs = [steps.Launched(log=str(tmp_path / f"train-{i}.log")) for i in range(2)]
        launched = phases.JobLaunched("", run="0001", rdzv_id="pair-0001-x", nodes=logs)
        try:
            phases.wait_first_step(ctx, launched, timeout_s=60, grace_s=30)
        except StepFailed as exc:
            message = str(exc)
        else:
            raise AssertionError("the wait went on without node 1's trainer")
        assert message.startswith("[box-1] wait_first_step: node 1 box-1: "), message
        assert f"last lines of {tmp_path}/train-1.log" in message, message
        # node 0 alone still runs its part: a job runs on all its nodes or none
        assert "stopped the job again on node 0 box-0" in message, message
    finally:
        subprocess.run(["tmux", "-L", first.tmux_socket, "kill-server"], capture_output=True)
