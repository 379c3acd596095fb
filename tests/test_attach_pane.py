"""`dflash-ops attach` shows the job's tmux pane: the trainer's output goes to the log, so the pane
says where it goes instead of staying blank. Real tmux, the stand-in trainer on the local target."""
from __future__ import annotations

import subprocess

from dflash_ops import commands

try:
    from tests.test_ops_e2e import cleanup, quick, standin  # noqa: F401 (cleanup: a fixture)
    from tests.ops_helpers import wait_for
    from tests.test_unattended_e2e import job_state
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_ops_e2e import cleanup, quick, standin  # noqa: F401
    from ops_helpers import wait_for
    from test_unattended_e2e import job_state


def pane_text(job) -> str:
    return subprocess.run(["tmux", "-L", job.tmux_socket, "capture-pane", "-p", "-t", f"={job.session}:"],
                          capture_output=True, text=True).stdout


def test_the_pane_says_where_the_trainers_output_goes(local_target, cleanup):
    target = standin(local_target)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    log = job_state(target)["log"]
    shown = wait_for(lambda: pane_text(target.job).strip(), what="text in the pane")
    assert "run 0001: the trainer writes to" in shown and "dflash-ops tail-log -f" in shown, shown
    assert log.split("/")[-1] in shown.replace("\n", "")
