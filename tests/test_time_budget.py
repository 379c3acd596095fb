"""health and status answer within --timeout even when nvidia-smi hangs: the GPU part says UNKNOWN,
the session and the training progress are still reported (NRPE gives a check 10 s)."""
from __future__ import annotations

import json
import os
import time

import pytest
from test_cli import cli
from trainer import metrics_format

BUDGET_S = 4


@pytest.fixture
def hung_gpus(gpu_state_path):
    gpu_state_path.write_text(json.dumps({"hang": True, "gpus": [{"name": "NVIDIA H200"}]}))
    yield
    gpu_state_path.unlink()


@pytest.fixture
def training_job(tmp_path, pct_target, pct_cli):
    """In container 200: a live tmux session (its own socket, removed afterwards) and a log with a
    recent step."""
    socket = f"budget-{tmp_path.name}"[:60]
    started = pct_cli("exec", 200, "--", "tmux", "-L", socket, "new-session", "-d", "-s", "job", "sleep 120")
    assert started.returncode == 0, started.stderr
    logs = tmp_path / "w" / "logs"
    logs.mkdir(parents=True)
    (logs / "train-0001.log").write_text("step 7/100 loss 3.2\n")
    (logs / "train-0001.metrics.jsonl").write_text(
        metrics_format.encode("start", total_steps=100)
        + metrics_format.encode("step", step=7, total_steps=100, loss=3.25, tokens_per_s=1000.0, eta_s=93.0))
    yield tmp_path / "w", socket
    pct_cli("exec", 200, "--", "tmux", "-L", socket, "kill-server")


def pct_inventory(path, spec, workdir, socket, gpu_query_on):
    path.write_text(f"""targets:
  ct:
    transport: pct
    ctid: 200
    gpu_query_on: {gpu_query_on}
    host: {spec.host}
    port: {spec.port}
    identity_file: {spec.identity_file}
    known_hosts_file: {spec.known_hosts_file}
    job: {{workdir: {workdir}, python: /usr/bin/python3, config: tiny-cpu, session: job, tmux_socket: {socket}}}
""")
    return path


@pytest.mark.parametrize("gpu_query_on", ["container", "host"])
@pytest.mark.parametrize("command", ["health", "status"])
def test_a_hung_nvidia_smi_is_unknown_for_the_gpus_only_and_ends_within_the_budget(
        pct_target, ssh_spec, hung_gpus, training_job, tmp_path, gpu_query_on, command):
    workdir, socket = training_job
    inventory = pct_inventory(tmp_path / "inv.yaml", ssh_spec, workdir, socket, gpu_query_on)
    start = time.monotonic()
    result = cli("--inventory", str(inventory), command, "-t", "ct", "--timeout", str(BUDGET_S), timeout=60)
    took = time.monotonic() - start
    out = result.stdout
    assert took <= BUDGET_S + 1, f"{command} took {took:.1f}s with --timeout {BUDGET_S}: {out}"
    assert "Traceback" not in result.stderr
    assert "nvidia-smi" in out and "UNKNOWN" in out, out
    assert "step 7" in out, out  # the training part is still reported
    if command == "health":
        assert result.returncode == 3 and out.startswith("DFLASH UNKNOWN: ct: GPUs UNKNOWN"), out
    else:
        assert "session job (tmux -L " in out and ": running" in out, out


def test_a_silent_ssh_server_is_unknown_within_the_budget(silent_server, ssh_spec, tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"""targets:
  box:
    transport: ssh
    host: 127.0.0.1
    port: {silent_server}
    known_hosts_file: {ssh_spec.known_hosts_file}
    job: {{workdir: {tmp_path}/w, python: /usr/bin/python3, config: tiny-cpu}}
""")
    start = time.monotonic()
    result = cli("--inventory", str(inventory), "health", "-t", "box", "--timeout", "3", timeout=60)
    took = time.monotonic() - start
    assert took <= 4, f"took {took:.1f}s"
    assert result.returncode == 3 and "sent no SSH banner" in result.stdout, result.stdout
    assert result.stderr == ""


def test_a_hung_tmux_is_unknown_not_a_dead_job(local_target, tmp_path, monkeypatch):
    from dflash_ops.observe import check as check_lib

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tmux").write_text("#!/bin/sh\nexec sleep 60\n")
    (fake / "tmux").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    start = time.monotonic()
    checked = check_lib.check(local_target, timeout_s=3)
    assert time.monotonic() - start <= 3.5
    assert checked.verdict.level == "UNKNOWN", checked.verdict
    assert checked.verdict.reasons[0].startswith("tmux session UNKNOWN: tmux gave no answer within")
    assert checked.status.session.running is None
