"""CLI edges a user meets: no terminal, bad paths, stopped jobs — one line, the right exit code."""
from __future__ import annotations

import os
import subprocess

import pytest
from test_cli import cli


@pytest.fixture
def local_job(tmp_path):
    """An inventory whose local target runs on a tmux socket of its own, removed afterwards."""
    socket = f"edges-{os.getpid()}-{tmp_path.name}"[:60]
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  local:\n    transport: local\n    job: {{workdir: {tmp_path}/w, "
                         f"python: /usr/bin/python3, config: tiny-cpu, session: job, tmux_socket: {socket}}}\n")
    yield inventory, socket
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


def ssh_inventory(path, spec, job_dir, socket):
    path.write_text(f"""targets:
  box:
    transport: ssh
    host: {spec.host}
    port: {spec.port}
    identity_file: {spec.identity_file}
    known_hosts_file: {spec.known_hosts_file}
    connect_timeout_s: 5
    job: {{workdir: {job_dir}, python: /usr/bin/python3, config: tiny-cpu, session: job, tmux_socket: {socket}}}
""")
    return path


def test_attach_without_a_terminal_refuses_at_once(local_job, ssh_spec, tmp_path):
    _, socket = local_job
    inventory = ssh_inventory(tmp_path / "ssh.yaml", ssh_spec, tmp_path / "w", socket)
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "job", "sleep 60"], check=True)
    try:
        # stdin and stdout are pipes here, as under cron or CI
        result = cli("--inventory", str(inventory), "attach", "-t", "box", timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("attach without a terminal hung") from None
    assert result.returncode == 2, result
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "terminal" in result.stderr


def test_deploy_list_and_rollback_by_name(local_job):
    inventory, _ = local_job
    assert cli("--inventory", str(inventory), "deploy", "--list").stdout.startswith("no releases deployed yet")
    assert cli("--inventory", str(inventory), "deploy").returncode == 0
    listed = cli("--inventory", str(inventory), "deploy", "--list")
    assert listed.returncode == 0 and listed.stdout.startswith("* ") and "(current)" in listed.stdout, listed
    release = listed.stdout.split()[1]
    again = cli("--inventory", str(inventory), "deploy", "--rollback", release)
    assert again.returncode == 0 and f"current -> {release}" in again.stdout, again
    bad = cli("--inventory", str(inventory), "deploy", "--rollback", "../etc")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--rollback" in bad.stderr
    previous = cli("--inventory", str(inventory), "deploy", "--rollback")  # the flag alone: the previous one
    assert previous.returncode != 0 and "no earlier release" in previous.stdout + previous.stderr


def test_status_ends_without_a_blank_line(local_job):
    inventory, _ = local_job
    result = cli("--inventory", str(inventory), "status")
    assert result.stdout.endswith("\n") and not result.stdout.endswith("\n\n"), repr(result.stdout[-80:])


def test_stop_on_a_stopped_container_is_a_no_op(stopped_pct_target, ssh_spec, tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"""targets:
  ct:
    transport: pct
    ctid: {stopped_pct_target.ctid}
    host: {ssh_spec.host}
    port: {ssh_spec.port}
    identity_file: {ssh_spec.identity_file}
    known_hosts_file: {ssh_spec.known_hosts_file}
    job: {{workdir: {tmp_path}/w, python: /usr/bin/python3, config: tiny-cpu}}
""")
    result = cli("--inventory", str(inventory), "stop", "-t", "ct")
    assert result.returncode == 0, result
    assert "not running" in result.stdout and "nothing to stop" in result.stdout, result.stdout
    assert "FAILED" not in result.stdout + result.stderr


def test_health_json_and_status_json_have_the_same_shape(tmp_path):
    """One target: one object each, with the same keys. Two targets: a list of such objects, in
    inventory order."""
    import json

    sockets = {name: f"shape-{os.getpid()}-{name}-{tmp_path.name}"[:60] for name in ("a", "b")}
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("targets:\n" + "".join(
        f"  {name}:\n    transport: local\n    job: {{workdir: {tmp_path}/{name}, python: /usr/bin/python3, "
        f"config: tiny-cpu, session: job, tmux_socket: {socket}}}\n" for name, socket in sockets.items())
        + "groups:\n  both: [a, b]\n")

    def both(*args):
        outputs = [cli("--inventory", str(inventory), command, "--json", *args) for command in ("health", "status")]
        assert outputs[0].returncode == outputs[1].returncode, outputs
        return [json.loads(o.stdout) for o in outputs]

    try:
        health, status = both("-t", "a")
        assert isinstance(health, dict) and isinstance(status, dict), (health, status)
        keys = set(status)
        assert set(health) == keys and {"target", "verdict", "reasons", "gpus", "session"} <= keys
        assert health["target"] == status["target"] == "a" and health["verdict"] == status["verdict"]
        for many in both("-t", "both"):
            assert isinstance(many, list) and [o["target"] for o in many] == ["a", "b"], many
            assert all(isinstance(o, dict) and set(o) == keys for o in many), many
    finally:
        for socket in sockets.values():
            subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
