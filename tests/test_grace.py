"""--grace must leave the trainer its own stop grace plus its watchdog's margin: a shorter one is
refused before anything is stopped (one line, exit 2)."""
from __future__ import annotations

import os
import subprocess

import pytest
from test_cli import cli

from dflash_ops.act.grace import check_grace, trainer_stop_grace
from dflash_ops.errors import InputError
from dflash_ops.job.model import Job
from trainer import stop_timing


def job(config="tiny-cpu", *train_args):
    return Job(workdir="/w", python="/usr/bin/python3", config=config, train_args=tuple(train_args))


def test_the_trainers_stop_grace_comes_from_set_or_the_bundled_config():
    assert trainer_stop_grace(job()) == stop_timing.DEFAULT_STOP_GRACE_S  # tiny-cpu keeps the default
    assert trainer_stop_grace(job("gpu-paper")) == 20
    assert trainer_stop_grace(job("tiny-cpu", "--set", "run.stop_grace_s=45", "--max-steps", "9")) == 45
    assert trainer_stop_grace(job("tiny-cpu", "--set=run.stop_grace_s=5", "--set", "run.stop_grace_s=7")) == 7
    assert trainer_stop_grace(job("/etc/dflash/my.yaml")) is None  # lives on the target: not read here
    assert trainer_stop_grace(job("tiny-cpu", "--set", "run.stop_grace_s=soon")) is None


def test_a_grace_that_cannot_cover_the_trainers_stop_is_refused():
    floor = stop_timing.ops_grace_floor(45)
    check_grace(job("tiny-cpu", "--set", "run.stop_grace_s=45"), floor)
    with pytest.raises(InputError, match=f"use --grace {floor:g} or more"):
        check_grace(job("tiny-cpu", "--set", "run.stop_grace_s=45"), floor - 0.5)
    check_grace(job("/etc/dflash/my.yaml"), 1)  # unknown: not refused


@pytest.mark.parametrize("command", ["stop", "relaunch"])
def test_the_cli_refuses_a_short_grace_and_touches_nothing(tmp_path, command):
    socket = f"grace-{os.getpid()}-{command}"
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  local:\n    transport: local\n    job: {{workdir: {tmp_path}/w, "
                         f"python: /usr/bin/python3, config: tiny-cpu, session: job, tmux_socket: {socket}}}\n")
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "job", "sleep 60"], check=True)
    try:
        result = cli("--inventory", str(inventory), command, "--grace", "5")
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "--grace 5 s is shorter" in lines[0] and "use --grace 29" in lines[0], lines
        alive = subprocess.run(["tmux", "-L", socket, "has-session", "-t", "=job"])
        assert alive.returncode == 0, "the job's session must be untouched"
        assert not (tmp_path / "w").exists()
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
