"""Failure signatures in training logs, and training progress from metrics records."""
from __future__ import annotations

import math

import pytest

from dflash_ops.observe import logs
from trainer import metrics_format

FX_LOG = """\
2025-06-01 10:00:00 worker drafter-0 compiling
Exception in thread drafter-1:
Traceback (most recent call last):
  File "/usr/lib/python3.12/threading.py", line 1075, in _bootstrap_inner
    self.run()
  File "/opt/dflash/current/trainer/workers.py", line 88, in run
    loss = self.step(batch)
           ^^^^^^^^^^^^^^^^
  File "/opt/venv/lib/python3.12/site-packages/torch/_dynamo/eval_frame.py", line 574, in _fn
    raise RuntimeError(
RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function. This is not supported at the moment.
"""

OOM_LOG = """\
step 12 loss 3.1
Traceback (most recent call last):
  File "/opt/dflash/current/trainer/train.py", line 140, in main
    hidden = target(batch)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 139.81 GiB of which 1.06 GiB is free.
"""

BLOCK_MASK_LOG = """\
Traceback (most recent call last):
  File "/opt/venv/lib/python3.12/site-packages/torch/nn/attention/flex_attention.py", line 870, in create_block_mask
    mod_type = _get_mod_type(mask_mod)
KeyError: 'custom'
"""

PLAIN_TRACEBACK = """\
loading data
Traceback (most recent call last):
  File "/opt/dflash/current/trainer/data.py", line 31, in load
    raise ValueError(f"bad shard {path}")
ValueError: bad shard /data/shard-7.jsonl
"""


def names(text):
    return [f.name for f in logs.find_failures(text)]


def test_fx_tracing_race_is_named_and_not_also_a_generic_traceback():
    (failure,) = logs.find_failures(FX_LOG)
    assert failure.name == "fx_tracing" and failure.title == "FX-tracing race"
    assert failure.line.startswith("RuntimeError: Detected that you are using FX")
    assert failure.line_no == 11  # counted in FX_LOG above
    assert "compile lock" in failure.explanation


def test_cuda_oom_matches_once():
    (failure,) = logs.find_failures(OOM_LOG)
    assert failure.name == "cuda_oom" and failure.line_no == 5
    assert failure.describe().startswith("CUDA out of memory: torch.OutOfMemoryError: CUDA out of memory.")


@pytest.mark.parametrize("line", [
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB",
    "torch.cuda.OutOfMemoryError: CUDA out of memory.",
    "RuntimeError: CUDA error: out of memory",
])
def test_cuda_oom_variants(line):
    assert names(line) == ["cuda_oom"]


def test_block_mask_race():
    (failure,) = logs.find_failures(BLOCK_MASK_LOG)
    assert failure.name == "block_mask_race" and failure.line == "KeyError: 'custom'"


def test_generic_traceback_names_the_exception_line():
    (failure,) = logs.find_failures(PLAIN_TRACEBACK)
    assert failure.name == "traceback"
    assert failure.line == "ValueError: bad shard /data/shard-7.jsonl" and failure.line_no == 5


def test_chained_exceptions_report_the_last_one():
    text = PLAIN_TRACEBACK + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nOSError: disk full\n"
    (failure,) = logs.find_failures(text)
    assert failure.line == "OSError: disk full"


def test_keyboard_interrupt_is_an_operator_stop_not_a_failure():
    text = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nKeyboardInterrupt\n"
    assert logs.find_failures(text) == []


def test_truncated_traceback_still_reported():
    # the tail cut the log after the header: the header itself is the evidence
    (failure,) = logs.find_failures("step 3\nTraceback (most recent call last):\n")
    assert failure.name == "traceback" and failure.line == "Traceback (most recent call last):"


@pytest.mark.parametrize("text, expected", [
    ("start_training.sh: line 3: 48213 Killed                  python3 -m trainer.cli.main", ["killed"]),
    ("Killed", ["killed"]),
    ("Killed 3 stale processes before launch", []),
    ("Segmentation fault (core dumped)", ["native_crash"]),
    ("bash: line 1:   812 Aborted                 (core dumped) python3 train.py", ["native_crash"]),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error", ["nccl"]),
    ("[E ProcessGroupNCCL.cpp:475] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)", ["nccl"]),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", ["cuda_error"]),
    ("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:", ["compile_failed"]),
    ("step 120 loss 2.31 tokens/s 45210 eta 1:23", []),
    ("UserWarning: TypedStorage is deprecated", []),
])
def test_other_signatures(text, expected):
    assert names(text) == expected


def test_most_specific_first_regardless_of_position():
    text = PLAIN_TRACEBACK + OOM_LOG + FX_LOG
    assert names(text) == ["fx_tracing", "cuda_oom", "traceback"]


def test_failures_from_metrics_error_events():
    records = metrics_format.parse_lines(
        metrics_format.encode("error", time=5, kind="fx_tracing", message="Detected that you are using FX")
        + metrics_format.encode("error", time=6, kind="exception", message="ValueError: bad shard"))
    found = {f.name: f.line for f in logs.failures_from_records(records)}
    assert found == {"fx_tracing": "Detected that you are using FX", "traceback": "ValueError: bad shard"}


# --------------------------------------------------------------------------- progress


def run_records(start_time=1000.0, steps=8, interval=10.0, tokens=None, total=100):
    """A run as the trainer writes it: start, then one step record every `interval` seconds."""
    text = metrics_format.encode("start", time=start_time, total_steps=total, config={}, devices=[],
                                 compile_lock="first_step", pid=1)
    for i in range(1, steps + 1):
        tps = tokens[i - 1] if tokens else 40000.0
        text += metrics_format.encode("step", time=start_time + 30 + i * interval, step=i, total_steps=total,
                                      loss=5.0 - 0.1 * i, tokens_per_s=tps, eta_s=(total - i) * interval,
                                      lr=1e-4, grad_norm=1.0)
    return metrics_format.parse_lines(text)


def test_progress_of_a_running_job():
    tokens = [1000.0, 38000.0, 41000.0, 39000.0, 40000.0, 52000.0, 40500.0, 39500.0]
    p = logs.progress(run_records(tokens=tokens))
    assert (p.step, p.total_steps) == (8, 100)
    assert p.loss == pytest.approx(4.2)
    assert p.eta_s == pytest.approx(920.0)
    assert p.start_time == 1000.0 and p.last_step_time == 1000.0 + 30 + 80
    # median of the last five: 39000, 40000, 52000, 40500, 39500 -> 40000
    assert p.tokens_per_s == 40000.0
    assert p.done_reason is None and p.loss_is_finite


def test_progress_before_first_step_and_after_a_restart():
    only_start = logs.progress(run_records(steps=0))
    assert only_start.step is None and only_start.start_time == 1000.0 and only_start.total_steps == 100
    restarted = run_records(start_time=1000.0, steps=5) + run_records(start_time=5000.0, steps=1)
    p = logs.progress(restarted)
    assert p.step == 1 and p.start_time == 5000.0


def test_progress_nan_loss_and_done():
    text = metrics_format.encode("step", time=10, step=3, total_steps=3, loss=float("nan"), tokens_per_s=5.0,
                                 eta_s=0.0, lr=0.0, grad_norm=float("nan"))
    text += metrics_format.encode("done", time=11, step=3, reason="max_steps")
    p = logs.progress(metrics_format.parse_lines(text))
    assert math.isnan(p.loss) and not p.loss_is_finite
    assert p.done_reason == "max_steps"


def test_empty_metrics():
    p = logs.progress([])
    assert p == logs.TrainingProgress()
