"""Everything the target sends is data: terminal control sequences and newlines planted in the job
state (`by`, `log`) or in the log itself come out of text `status`, `health` and `tail-log` as
visible escapes, never as bytes that act on the operator's terminal, and one-line messages stay one
line. Also what a first look says: a machine where nothing was launched, a directory in place of
the job state. The real CLI on the local target."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TITLE = "\x1b]0;owned\x07"  # sets the terminal window's title
CLEAR = "\x1b[2J"


def cli(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.fixture
def workdir(tmp_path):
    socket = f"t-{uuid.uuid4().hex[:8]}"  # no server: the session is simply gone
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  local:\n    job: {{workdir: {tmp_path}/w, tmux_socket: {socket}}}\n")
    (tmp_path / "w" / "logs").mkdir(parents=True)
    return inventory, tmp_path / "w"


def no_control_bytes(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_escape_sequences_and_newlines_from_the_job_state_are_shown_inert(workdir):
    inventory, work = workdir
    log = work / "logs" / "train-0001.log"
    log.write_text(f"step 1 {TITLE}done\nprogress 10%\rprogress 100% {CLEAR}\n")
    (work / "job-state.json").write_text(json.dumps(
        {"state": "stopped", "by": f"me{TITLE}", "when": 1.0e9, "run": 1, "log": str(log)}))
    status = cli(inventory, "status")
    no_control_bytes(status.stdout + status.stderr)
    assert "job: stopped by me\\x1b]0;owned\\x07" in status.stdout
    health = cli(inventory, "health")
    no_control_bytes(health.stdout + health.stderr)
    assert len(health.stdout.splitlines()) == 1 and "\\x1b]0;owned\\x07" in health.stdout

    tail = cli(inventory, "tail-log", "-n", "5")
    no_control_bytes(tail.stdout + tail.stderr)
    assert tail.stdout.splitlines() == ["step 1 \\x1b]0;owned\\x07done", "progress 100% \\x1b[2J"]


def test_a_newline_in_the_logs_path_keeps_tail_logs_error_one_line(workdir):
    inventory, work = workdir
    (work / "job-state.json").write_text(json.dumps(
        {"state": "running", "run": 1, "log": f"/nowhere/train-0001.log\nfake: line{CLEAR}"}))
    tail = cli(inventory, "tail-log")
    assert tail.returncode == 1
    no_control_bytes(tail.stderr)
    [line] = tail.stderr.strip().splitlines()
    assert "the log of run 0001, /nowhere/train-0001.log\\x0afake: line\\x1b[2J, is missing" in line


def test_where_nothing_was_ever_launched_status_and_health_say_so(workdir):
    inventory, _ = workdir
    health = cli(inventory, "health")
    assert health.returncode == 2, health  # the job is not training: still CRITICAL, said as what it is
    assert health.stdout.startswith("DFLASH CRITICAL: local: no job launched here yet (`dflash-ops relaunch` starts one)")
    assert "no job launched here yet" in cli(inventory, "status").stdout


def test_a_directory_in_place_of_the_job_state_gets_one_advice_everywhere(workdir):
    inventory, work = workdir
    (work / "job-state.json").mkdir()
    said = cli(inventory, "health").stdout
    assert "remove it: no job state can be written in its place" in said
    assert "a relaunch rewrites" not in said  # it cannot: a file is never renamed over a directory
    relaunch = cli(inventory, "relaunch")
    assert "remove it: no job state can be written in its place" in relaunch.stdout + relaunch.stderr
    stop = cli(inventory, "stop")
    assert stop.returncode == 1 and "remove it: no job state can be written in its place" in stop.stdout
