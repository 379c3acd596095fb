"""A command imports what it needs when it needs it: fabric/paramiko only for targets reached over
ssh, the playbook engine only for commands that run playbooks (speed itself: benchmarks/startup.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs the CLI in-process and prints the modules it ended with, whatever its exit code.
RUN_AND_LIST = """
import atexit, sys
atexit.register(lambda: print("MODULES", " ".join(sorted(sys.modules)), file=sys.stderr))
from dflash_ops.cli import main
main(sys.argv[1:])
"""

SSH_MODULES = {"fabric", "paramiko", "invoke", "dflash_ops.transport.ssh", "dflash_ops.transport.pct"}
PLAYBOOK_MODULES = {"dflash_ops.playbook", "dflash_ops.act.steps", "dflash_ops.act.runner", "dflash_ops.playbook.user"}


def modules_after(tmp_path, *argv: str) -> set[str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home)}
    env.pop("DFLASH_OPS_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-c", RUN_AND_LIST, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("MODULES ")]
    assert lines, proc.stderr
    return set(lines[-1].split()[1:])


def test_importing_the_cli_loads_neither_ssh_nor_the_playbook_engine(tmp_path):
    loaded = modules_after(tmp_path, "--help")
    assert not loaded & (SSH_MODULES | PLAYBOOK_MODULES)
    assert "dflash_ops.observe.check" not in loaded and "dflash_ops.observe.health" not in loaded


@pytest.mark.parametrize("command", [["status"], ["health"], ["status", "--json"]])
def test_status_and_health_on_local_load_neither_ssh_nor_the_playbook_engine(tmp_path, command):
    loaded = modules_after(tmp_path, *command)
    assert "dflash_ops.observe.probe" in loaded  # the check did run
    assert not loaded & (SSH_MODULES | PLAYBOOK_MODULES)


def test_a_playbook_on_local_loads_the_engine_but_not_ssh(tmp_path):
    loaded = modules_after(tmp_path, "relaunch", "--dry-run")
    assert "dflash_ops.act.steps" in loaded
    assert not loaded & SSH_MODULES
