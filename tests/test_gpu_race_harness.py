"""The end-to-end race harness (benchmarks/gpu_race.py) classifies what the real trainer does.

On CPU the trainer refuses flex_attention training with a config error, which the harness must
count as an "other" failure (not clean, not FX); a trial past its time limit is a hang (and the
harness says whether SIGTERM ended it); an sdpa trial with checkpointed layers comes out clean."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RACE = [sys.executable, str(REPO / "benchmarks" / "gpu_race.py"), "--device", "cpu", "--steps", "1", "--trials", "1"]


@pytest.mark.slow  # two harness runs (each imports torch), ~35 s on two busy cores
def test_failing_and_hung_trials_are_counted_per_mode_and_checkpointing(tmp_path):
    out = tmp_path / "race.md"
    done = subprocess.run([*RACE, "--modes", "none,lock", "--trials-none", "1", "--parallel", "4",
                           "--label", "cpu smoke", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lock  ckpt=layers trials=1/1 fx=0 mask=0 other=1 hang=0" in done.stdout, done.stdout
    table = out.read_text()
    for mode in ("none", "lock"):
        for ckpt in ("none", "layers"):
            assert f"| {mode} | {ckpt} | 1 | 0 | 0 | 1 | 0 (0 / 0 / 0) | 0 |" in table, table
    assert "5 layers, head_dim 64, intermediate 512" in table and "torch 2." in table and "flex" in table

    hung = subprocess.run([*RACE, "--modes", "lock", "--checkpointing", "layers", "--attention", "sdpa",
                           "--timeout", "2", "--kill-after", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert hung.returncode == 0, hung.stderr
    assert "| lock | layers | 1 | 0 | 0 | 0 | 1 (1 / 0 / 0) | 0 |" in out.read_text(), out.read_text()


@pytest.mark.slow  # one real (CPU) training start, ~30 s on two busy cores
def test_a_clean_trial_with_checkpointed_layers(tmp_path):
    out = tmp_path / "race.md"
    done = subprocess.run([*RACE, "--modes", "lock", "--checkpointing", "layers", "--attention", "sdpa",
                           "--timeout", "240", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| lock | layers | 1 | 0 | 0 | 0 | 0 (0 / 0 / 0) | 1 |" in out.read_text(), done.stdout[-3000:]


def test_a_trial_that_ignores_sigterm_is_a_hang_that_needed_sigkill():
    """GNU `timeout -k` SIGKILLs its own process group, itself included: the trial's exit is -9."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_race
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    stubborn = subprocess.Popen(["timeout", "-k", "0.5", "0.5", "bash", "-c", "trap '' TERM; sleep 30"],
                                start_new_session=True)
    returncode = stubborn.wait(timeout=20)
    assert gpu_race.classify(returncode, "") == "hang"
    assert gpu_race.hang_exit_of(returncode, "") == "SIGKILL"
    ended = "dflash-train watchdog: pid 7 still running 19 s after SIGTERM: ... ending it with SIGKILL\n"
    assert gpu_race.hang_exit_of(137, ended) == "watchdog" and gpu_race.hang_exit_of(124, "") == "SIGTERM"
