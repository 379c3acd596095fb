"""The GPU proof scripts for train.precision, run here at tiny size on the CPU."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from trainer.config import load_config
from trainer.train.loop import train

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)
SMALL = {"data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 30, "train.batch_size": 2, "train.num_anchors": 6,
         "run.torch_threads": 1, "train.precision": "bf16-mixed"}


def run(*args, timeout=200):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=timeout)


def test_precision_check_reports_moved_norms_and_fails_on_weights_left_at_one(tmp_path):
    train(load_config("tiny-cpu", dict(SMALL, output_dir=str(tmp_path / "mixed"), max_steps=3)), out=io.StringIO())
    out = tmp_path / "norms.md"
    proc = run("benchmarks/precision_check.py", "--run", f"bf16-mixed={tmp_path / 'mixed'}",
               "--run", f"again={tmp_path / 'mixed'}", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| bf16-mixed", "| again"))]
    assert len(rows) == 2 and all("| 6/6 | 0/" in row and "float32" in row for row in rows), rows
    assert rows[1].endswith("| +0.00% |")

    # what a pure-bf16 run leaves behind: norm weights exactly 1.0
    step = tmp_path / "mixed" / "checkpoints" / "step-0000003" / "drafter.safetensors"
    weights = load_file(str(step))
    save_file({k: (v * 0 + 1 if k.endswith("norm.weight") else v) for k, v in weights.items()}, str(step))
    proc = run("benchmarks/precision_check.py", "--run", f"stuck={tmp_path / 'mixed'}")
    assert proc.returncode == 1 and "| stuck | 0/6 |" in proc.stdout, proc.stdout


def test_throughput_uses_the_trainer_precision_path_and_reports_master_state(tmp_path):
    out = tmp_path / "throughput.md"
    proc = run("benchmarks/train_throughput.py", "--small", "--precision", "bf16-mixed", "--parts", "compiled",
               "--steps", "2", "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_ = json.loads((tmp_path / "throughput.json").read_text())["runs"]["sdpa"]
    assert run_["precision"] == "bf16-mixed" and run_["param_dtypes"] == ["float32"]
    assert run_["master_and_adam_gib"] * 2**30 == 12 * run_["params"]
    assert "float32 weights + AdamW moments" in out.read_text() and "(12.0 bytes/parameter" in out.read_text()
