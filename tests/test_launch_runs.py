"""The launch's shell pieces on their own: the finished-run pattern against the trainer's real
`done` record, and the job state JSON built by the shell from hostile paths."""
from __future__ import annotations

import json
import subprocess

from dflash_ops import jobstate, launch
from trainer import metrics_format


def grep(pattern: str, text: str) -> bool:
    return subprocess.run(["grep", "-qE", pattern], input=text, text=True).returncode == 0


def test_finished_pattern_matches_only_a_completed_run():
    assert grep(launch.FINISHED_RECORD, metrics_format.encode("done", step=480, reason="max_steps"))
    assert grep(launch.FINISHED_RECORD, json.dumps({"v": 1, "event": "done", "step": 3, "reason": "max_steps"}))
    assert not grep(launch.FINISHED_RECORD, metrics_format.encode("done", step=20, reason="interrupted"))
    assert not grep(launch.FINISHED_RECORD, metrics_format.encode("step", step=5, reason="max_steps"))


def test_shell_json_keeps_hostile_paths_as_data(tmp_path):
    hostile = "/w ö'q\" $(touch PWNED) `x`\\n/logs/train-"
    words = jobstate.shell_json(state="running", run=jobstate.Digits("$((10#$run))"),
                                log=(hostile, jobstate.Digits("$n"), ".log"), pid=jobstate.Digits("$pid"))
    out = subprocess.run(["bash", "-c", f"run=0007; n=0012; pid=42; printf '%s' {words}"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"state": "running", "run": 7, "log": hostile + "0012.log", "pid": 42}
    assert not list(tmp_path.iterdir())
