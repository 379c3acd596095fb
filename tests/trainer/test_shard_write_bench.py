"""benchmarks/shard_write.py at a tiny size: both writers must agree on the bytes they wrote."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_shard_benchmark_finds_both_writers_wrote_the_same_bytes(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "shard_write.py"), "--dir", str(tmp_path), "--sequences", "2",
         "--tokens", "8", "--width", "16", "--repeats", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert "same bytes both ways: True" in run.stdout, run.stdout + run.stderr
    assert run.returncode == 0
