"""The launch's shell pieces on their own: the job state JSON built by the shell keeps hostile
paths as data."""
from __future__ import annotations

import json
import subprocess

from dflash_ops import jobstate


def test_shell_json_keeps_hostile_paths_as_data(tmp_path):
    hostile = "/w ö'q\" $(touch PWNED) `x`\\n/logs/train-"
    words = jobstate.shell_json(state="running", run=jobstate.Digits("$((10#$run))"),
                                log=(hostile, jobstate.Digits("$n"), ".log"), pid=jobstate.Digits("$pid"))
    out = subprocess.run(["bash", "-c", f"run=0007; n=0012; pid=42; printf '%s' {words}"], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"state": "running", "run": 7, "log": hostile + "0012.log", "pid": 42}
    assert not list(tmp_path.iterdir())
