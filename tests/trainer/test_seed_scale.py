"""benchmarks/seed_scale.py at tiny dims on the CPU: every part of both shapes through the real commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_tiny_run_measures_every_part_of_both_shapes(tmp_path):
    out = tmp_path / "seed-scale.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "seed_scale.py"),
            "--tiny",
            "--out",
            str(out),
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    hybrid, dense = report["shapes"]["qwen3.6-27b"], report["shapes"]["qwen3-32b"]
    assert hybrid["build"]["gated_deltanet"] == {"delta rule": "torch", "conv": "torch"}
    assert dense["build"]["gated_deltanet"] is None
    for shape in (hybrid, dense):
        assert shape["build"]["nonfinite_layers"] == []
        assert shape["train"]["rc"] == 0 and shape["train"]["steps"] == report["sizes"]["steps"]
        assert shape["train"]["steady_step_s"] > 0 and shape["train"]["flops"]["target"] > 0
        assert shape["train"]["flops"]["drafter"] > 0 and 0 < shape["train"]["mfu"]
        assert shape["cache"]["tokens"] > 0 and shape["regenerate"]["new_tokens_per_s"] > 0
        assert shape["regenerate"]["batch_rule"] == "CPU default"
        assert shape["decode"]["target_ms_per_token"] > 0 and shape["decode"]["rounds"] > 0
    assert hybrid["train"]["gated_deltanet"] == {"delta rule": "torch", "conv": "torch"}
    text = out.read_text()
    assert "| qwen3.6-27b | data regenerate |" in text and "context tokens/s" in text
    assert list(tmp_path.glob("seed-scale-*")) == []  # scratch removed


def test_an_unknown_shape_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "seed_scale.py"),
            "--tiny",
            "--shapes",
            "llama-9t",
            "--out",
            str(tmp_path / "x.md"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "unknown llama-9t" in proc.stderr and "Traceback" not in proc.stderr
