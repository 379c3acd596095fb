"""An operator's Ctrl-C never leaves a half-told story: a stop is recorded (`stopping`) before
anything is signalled, so a trainer that got the stop signal is never recorded `running` (health
would call it a crash and --auto-relaunch would restart it); health takes `stopping` as a decision
in progress; a relaunch interrupted while it waits for step 1 says the job was launched. Real tmux,
the stand-in trainer on the local target, the real CLI in a child whose SIGINT is the default one
(a child of a non-interactive shell could inherit it ignored, and prove nothing)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.inventory.load import load_inventory
from dflash_ops.observe import health
from trainer import metrics_format

try:
    from tests.test_health import JOB, NOW, make_report, steps
    from tests.test_ops_e2e import STANDIN, quick
    from tests.ops_helpers import ops_argv, wait_for
    from tests.test_unattended_e2e import job_state
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_health import JOB, NOW, make_report, steps
    from test_ops_e2e import STANDIN, quick
    from ops_helpers import ops_argv, wait_for
    from test_unattended_e2e import job_state

REPO = Path(__file__).resolve().parent.parent


def inventory(tmp_path: Path, **env: str) -> Path:
    socket = f"t-{uuid.uuid4().hex[:8]}"
    extra = "".join(f", {k}: '{v}'" for k, v in env.items())
    path = tmp_path / "inv.yaml"
    path.write_text(
        f"targets:\n  local:\n    job: {{workdir: {tmp_path}/w, python: {STANDIN}, config: tiny-cpu, "
        f"tmux_socket: {socket}, env: {{STANDIN_MODE: train{extra}}}, health: {{stall_seconds: 30}}}}\n"
    )
    return path


def default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_cli(path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ops_argv(path, *args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )


@pytest.fixture
def job_inventory(tmp_path):
    made = []

    def make(**env):
        path = inventory(tmp_path, **env)
        made.append(load_inventory(str(path)).targets["local"])
        return path, made[-1]

    yield make
    for target in made:
        subprocess.run(["tmux", "-L", target.job.tmux_socket, "kill-server"], capture_output=True)


def trainer_signalled(target) -> bool:
    """The stand-in trainer wrote its `done … interrupted` record: it got the stop's SIGTERM."""
    metrics = Path(metrics_format.metrics_path_for_log(job_state(target)["log"]))
    return '"reason": "interrupted"' in metrics.read_text()


@pytest.mark.parametrize("when", ["at-start", "after-sigterm", "late"])
def test_sigint_anywhere_in_stop_never_leaves_a_signalled_trainer_recorded_running(job_inventory, when):
    path, target = job_inventory()
    assert commands.relaunch(target, **quick()).ok
    stop = start_cli(path, "stop", "--grace", "35")
    if when == "after-sigterm":  # the window between the signal and the end of the stop
        wait_for(lambda: trainer_signalled(target), seconds=30, what="the trainer to get SIGTERM")
    elif when == "late":
        time.sleep(1.5)
    stop.send_signal(signal.SIGINT)
    stop.communicate(timeout=60)
    state = job_state(target)["state"]
    if trainer_signalled(target):
        assert state in ("stopping", "stopped"), state
        verdict = check_lib.check(target).verdict
        assert verdict.level != "CRITICAL", verdict.reasons  # so --auto-relaunch restarts nothing
    else:
        assert state in ("running", "stopping"), state


def test_relaunch_interrupted_while_waiting_for_step_one_says_the_job_was_launched(job_inventory):
    path, target = job_inventory(STANDIN_FIRST_STEP_S="120")
    relaunch = start_cli(path, "relaunch", "--no-purge")
    wait_for(
        lambda: os.path.exists(os.path.join(target.job.workdir, "job-state.json")),
        seconds=60,
        what="the launch",
    )
    time.sleep(1.0)
    relaunch.send_signal(signal.SIGINT)
    _, err = relaunch.communicate(timeout=60)
    assert relaunch.returncode == 130, err
    assert "the job was launched" in err and f"dflash-ops stop -t {target.name}" in err, err
    assert check_lib.check(target).status.session.running is True  # it trains on


# ------------------------------------------------------------------ health of a stop in progress


def stopping(running: bool, began_s_ago: float, grace_s: float = 30.0):
    return dataclasses.replace(
        make_report(steps(last_step_age=5), running=running),
        job_state={
            "state": "stopping",
            "by": "dflash-ops stop",
            "when": NOW - began_s_ago,
            "grace_s": grace_s,
        },
    )


def test_health_takes_stopping_as_a_decision_in_progress_never_as_a_crash():
    underway = health.evaluate(stopping(running=True, began_s_ago=5), JOB)
    assert underway.level == "OK" and underway.reasons[0].startswith("being stopped: dflash-ops stop began")
    ended = health.evaluate(stopping(running=False, began_s_ago=5), JOB)
    assert ended.level == "OK" and "the stop did not finish" in ended.reasons[0]
    # recorded long ago while the trainer still runs: the stop was cut short before its signal
    stale = health.evaluate(stopping(running=True, began_s_ago=3600), JOB)
    assert stale.level == "WARNING" and any("run `dflash-ops stop` again" in r for r in stale.reasons)
