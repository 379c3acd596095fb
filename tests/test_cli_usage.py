"""Command-line conventions every command shares: where -t/--target may stand, and output piped
into a reader that stops early."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest


def run(tmp_path, *args, env=None, **kwargs):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    full_env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_TARGET")}
    full_env.update({"HOME": str(home), **(env or {})})
    return subprocess.run([sys.executable, "-m", "dflash_ops", *args], capture_output=True, text=True,
                          env=full_env, cwd=tmp_path, timeout=120, **kwargs)


@pytest.mark.parametrize("args", [
    ["-t", "nosuch", "status"], ["status", "-t", "nosuch"], ["--target", "nosuch", "health", "--json"],
    ["-t", "nosuch", "relaunch", "--dry-run"], ["tail-log", "--target", "nosuch"], ["-t", "nosuch", "deploy", "--list"],
])
def test_the_target_may_stand_before_or_after_the_subcommand(tmp_path, args):
    proc = run(tmp_path, *args)
    assert "unknown target or group 'nosuch'" in (proc.stderr + proc.stdout)
    assert proc.returncode in (2, 3)  # health reports a check it could not run as UNKNOWN (3)


def test_two_different_targets_are_refused_and_either_place_beats_the_environment(tmp_path):
    proc = run(tmp_path, "-t", "local", "status", "-t", "other")
    assert proc.returncode == 2 and "give the target once" in proc.stderr
    for args in (["-t", "local", "status", "--json"], ["status", "--json", "-t", "local"]):
        proc = run(tmp_path, *args, env={"DFLASH_OPS_TARGET": "nosuch"})
        assert '"target": "local"' in proc.stdout, proc.stderr
    proc = run(tmp_path, "status", env={"DFLASH_OPS_TARGET": "nosuch"})
    assert proc.returncode == 2 and "'nosuch'" in proc.stderr


def test_output_into_a_pipe_whose_reader_leaves_ends_quietly(tmp_path):
    """`dflash-ops relaunch --dry-run | head -2`, made deterministic: a one-page pipe fills long
    before the dry run's ~200 lines are written, so the writes after the reader left fail."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_INVENTORY"}
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops", "relaunch", "--dry-run"], cwd=tmp_path,
                            env={**env, "HOME": str(home)}, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        head = [reader.readline(), reader.readline()]
    err = proc.stderr.read()
    assert proc.wait(timeout=120) in (0, 1)
    assert head[0].startswith("relaunch: ran ") and head[1].startswith("[1/")
    assert "Broken pipe" not in err and "Exception ignored" not in err and "Traceback" not in err, err


def test_rollback_to_a_release_that_is_not_kept_is_one_line_and_exit_2(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  local:\n    transport: local\n    job: {{workdir: {tmp_path}/w, "
                         "python: /usr/bin/python3, config: tiny-cpu, session: job}\n")
    assert run(tmp_path, "--inventory", str(inventory), "deploy").returncode == 0
    kept = run(tmp_path, "--inventory", str(inventory), "deploy", "--list").stdout.split()[1]
    proc = run(tmp_path, "--inventory", str(inventory), "deploy", "--rollback", "nosuchrelease")
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("nosuchrelease") == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"kept: {kept}" in proc.stderr and "exit code" not in proc.stderr
    assert f"* {kept}" in run(tmp_path, "--inventory", str(inventory), "deploy", "--list").stdout  # unchanged


@pytest.mark.parametrize("name", ["--first-step-timeout", "--timeout"])
def test_relaunchs_wait_for_the_first_step_is_named_for_what_it_bounds(tmp_path, name):
    """`status --timeout` bounds an answer; relaunch's bounds the wait for step 1, and says so
    (the short name stays for crontabs that use it)."""
    proc = run(tmp_path, "relaunch", "--dry-run", name, "77")
    assert proc.returncode == 0, proc.stderr
    assert "would wait up to 77s for the first step" in proc.stdout
    refused = run(tmp_path, "relaunch", "--dry-run", name, "0")
    assert refused.returncode == 2 and "'--first-step-timeout'" in refused.stderr
