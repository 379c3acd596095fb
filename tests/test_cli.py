"""The CLI as a user meets it: real subprocesses of `python -m dflash_ops`, exit codes, messages."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args, env=None, cwd=None, timeout=120):
    full_env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_INVENTORY"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dflash_ops", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=timeout)


def write_inventory(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_GPUS = """
targets:
  box:
    transport: ssh
    host: 127.0.0.1
    job: {workdir: /w, python: /usr/bin/python3, config: tiny-cpu, target_gpus: [0], drafter_gpus: [0, 1]}
"""


def test_bad_inventory_is_exit_2_with_one_line_naming_the_field(tmp_path):
    inv = write_inventory(tmp_path / "inv.yaml", BAD_GPUS)
    for command in (["status"], ["relaunch", "--dry-run"], ["tail-log"]):
        result = cli("--inventory", str(inv), *command, "-t", "box")
        assert result.returncode == 2, (command, result.stderr)
        message = result.stderr.strip()
        assert "drafter_gpus" in message and "box" in message and "\n" not in message, message
        assert "Traceback" not in result.stderr


def test_health_with_a_bad_inventory_is_nagios_unknown(tmp_path):
    inv = write_inventory(tmp_path / "inv.yaml", "targets: [not, a, mapping]\n")
    result = cli("--inventory", str(inv), "health")
    assert result.returncode == 3
    assert result.stdout.startswith("DFLASH UNKNOWN: ")


def test_unknown_target_and_bad_args_are_exit_2(tmp_path):
    assert cli("status", "-t", "nope").returncode == 2
    result = cli("tail-log", "-n", "minus-three")
    assert result.returncode == 2 and "-n" in result.stderr
    result = cli("tail-log", "--grep", "(unclosed")
    assert result.returncode == 2 and "--grep" in result.stderr


def test_unreachable_host_is_unknown_for_health_and_named_for_relaunch(tmp_path):
    inv = write_inventory(tmp_path / "inv.yaml", """
targets:
  gone:
    transport: ssh
    host: 127.0.0.1
    port: 1
    connect_timeout_s: 3
    job: {workdir: /w, python: /usr/bin/python3, config: tiny-cpu}
""")
    health = cli("--inventory", str(inv), "health", "-t", "gone")
    assert health.returncode == 3 and health.stdout.startswith("DFLASH UNKNOWN: gone:"), health.stdout
    relaunch = cli("--inventory", str(inv), "relaunch", "-t", "gone")
    assert relaunch.returncode == 1
    assert "[gone]" in relaunch.stderr + relaunch.stdout and "Traceback" not in relaunch.stderr


@pytest.mark.skipif(shutil.which("crontab") is None, reason="cron is not installed (.ci/run installs it)")
def test_cron_install_show_remove_only_touches_our_lines(tmp_path):
    before = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    saved = before.stdout if before.returncode == 0 else None
    try:
        subprocess.run(["crontab", "-"], input="# a line of the user's own\n0 3 * * * /bin/true\n", text=True, check=True)
        installed = cli("cron", "install", "--schedule", "*/10 * * * *", "--log", str(tmp_path / "h.log"))
        assert installed.returncode == 0, installed.stderr
        again = cli("cron", "install", "--auto-relaunch", "--log", str(tmp_path / "h.log"))
        assert again.returncode == 0
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout
        ours = [line for line in table.splitlines() if "dflash-ops-health" in line]
        assert len(ours) == 1 and "--auto-relaunch" in ours[0] and ours[0].startswith("*/5 ")
        assert "0 3 * * * /bin/true" in table
        assert cli("cron", "show").stdout.strip() == ours[0]
        bad = cli("cron", "install", "--schedule", "every five minutes")
        assert bad.returncode == 2 and "--schedule" in bad.stderr
        assert cli("cron", "remove").returncode == 0
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout
        assert "dflash-ops-health" not in table and "0 3 * * * /bin/true" in table
    finally:
        if saved is None:
            subprocess.run(["crontab", "-r"], capture_output=True)
        else:
            subprocess.run(["crontab", "-"], input=saved, text=True)
