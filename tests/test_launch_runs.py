"""The launch's shell pieces on their own: the job state JSON the launch scripts complete keeps
hostile paths as data."""
from __future__ import annotations

import json
import subprocess

from dflash_ops.act import jobstate


def test_state_template_keeps_hostile_paths_as_data(tmp_path):
    hostile = "/w ö'q\" $(touch PWNED) `x`\\n @run@ @n@/logs/train-"
    template = jobstate.json_template(state="running", run=jobstate.Slot("run"),
                                      log=(hostile, jobstate.Slot("n"), ".log"), pid=jobstate.Slot("pid"))
    fill = 'run=0007; n=0012; s=${1//@run@/$((10#$run))}; s=${s//@n@/$n}; printf "%s" "${s//@pid@/42}"'
    out = subprocess.run(["bash", "-c", fill, "fill", template], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"state": "running", "run": 7, "log": hostile + "0012.log", "pid": 42}
    assert not list(tmp_path.iterdir())
