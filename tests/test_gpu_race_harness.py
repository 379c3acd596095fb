"""The end-to-end race harness (benchmarks/gpu_race.py) classifies what the real trainer does.

On CPU the trainer refuses flex_attention training with a config error, which the harness must
count as an "other" failure (not clean, not FX), and it must write its table with versions."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_failing_trial_is_counted_and_tabulated(tmp_path):
    out = tmp_path / "race.md"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_race.py"), "--modes", "lock", "--trials", "1",
                           "--parallel", "1", "--device", "cpu", "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fx=0 mask=0 other=1 hang=0 clean=0" in done.stdout
    table = out.read_text()
    assert "| lock | 1 | 0 | 0 | 1 | 0 | 0 |" in table and "torch 2." in table and "flex" in table
