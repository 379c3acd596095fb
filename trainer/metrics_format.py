"""The metrics contract between the trainer (writer) and dflash-ops (reader).

Standard library only, so both sides can import it without depending on each other.
The trainer appends one JSON object per line to `<log stem>.metrics.jsonl` next to its human log.
Every record has `v` (format version), `event` and `time` (unix seconds). Events:

- start:      config (dict), devices (list[str]), compile_lock (str), total_steps (int), pid (int)
              for a hybrid target also gated_deltanet ({"delta rule": "fla"|"torch", "conv":
              "causal_conv1d"|"torch"}: whose code runs its Gated DeltaNet layers, trainer/gdn_kernels.py)
- step:       step (int, 1-based count of optimizer steps done), total_steps, loss (float),
              acc (list[float], per block position 1..B-1), tokens_per_s (float, block tokens trained
              per second over the last interval), eta_s (float), lr, grad_norm, epoch (float);
              on CUDA also gpu_memory_gib (float, peak memory allocated on the process's GPUs in the step)
- compile:    thread (str), duration_s (float), step (int), reason (str)
- checkpoint: step, path
- eval:       step (int), tau (float, mean tokens accepted per target forward, bonus included,
              pooled over all rounds), tau_per_prompt_mean (float, the mean of per-prompt means: the
              public reference benchmark's convention), tau_per_prompt ({min, median, max}),
              acceptance (list[float], per block position 1..B-1: share of rounds whose draft was
              accepted up to there), lossless (bool, or null when sampling), prompts (int),
              new_tokens (int), seconds (float), overhead (float, the evaluations' share of the
              run's wall time so far), split (str: "held-in", unseen records of the training
              distribution, or "held-out", the prompts of eval.path; trainer.tau_diagnosis)
- error:      message (str), kind (str, e.g. "fx_tracing", "cuda_oom", "exception")
- done:       step, reason ("max_steps" | "interrupted")

A run that completed (reason max_steps) also leaves the file RUN_FINISHED in its --output-dir,
written before the `done` record: whoever launches the trainer starts a new run instead of resuming.
"""

from __future__ import annotations

import json
import time

FORMAT_VERSION = 1
EVAL_SPLITS = ("held-in", "held-out")
EVENTS = ("start", "step", "compile", "checkpoint", "eval", "error", "done")
RUN_FINISHED = "FINISHED"
STEP_FIELDS = ("step", "total_steps", "loss", "tokens_per_s", "eta_s", "lr", "grad_norm")
# The torch.compile FX-tracing race's error as it reads in a log (an error record's kind "fx_tracing")
FX_TRACING_ERROR = "Detected that you are using FX to symbolically trace a dynamo-optimized function"


def expected_tau(acc: list[float]) -> float:
    """Acceptance length predicted by per-position accuracy acc[k-1] of block position k:
    1 + sum_k prod_{j<=k} acc_j (a draft is accepted up to its first wrong token)."""
    total, run = 1.0, 1.0
    for value in acc:
        run *= float(value)
        total += run
    return total


def metrics_path_for_log(log_path: str) -> str:
    """`logs/train-0007.log` -> `logs/train-0007.metrics.jsonl`."""
    stem = log_path[:-4] if log_path.endswith(".log") else log_path
    return stem + ".metrics.jsonl"


def encode(event: str, **fields) -> str:
    """One metrics line (with trailing newline)."""
    if event not in EVENTS:
        raise ValueError(f"unknown metrics event {event!r}; known: {', '.join(EVENTS)}")
    record = {"v": FORMAT_VERSION, "event": event, "time": fields.pop("time", time.time()), **fields}
    return json.dumps(record, separators=(",", ":"), allow_nan=True, default=float) + "\n"


def parse_line(line: str) -> dict | None:
    """A record, or None for a blank, partial (still being written) or foreign line."""
    try:
        record = json.loads(line.strip())
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("event") in EVENTS else None


def parse_lines(text: str) -> list[dict]:
    return [r for r in (parse_line(line) for line in text.splitlines()) if r is not None]


def last_of(records: list[dict], event: str) -> dict | None:
    return next((record for record in reversed(records) if record.get("event") == event), None)


# How much earlier than its launch (the launcher's clock, whole seconds) a trainer's start record
# may read and still be that launch's
START_SLACK_S = 2.0


def current_run(records: list[dict], launched_at: float | None = None) -> list[dict]:
    """The records of the newest trainer: its `start` record and what follows it. A file may hold
    an earlier trainer's records before them; with `launched_at` (when the launch that owns the
    file began, on the same clock) a start older than that is an earlier trainer's, and a file
    without a start has none of this launch yet: then nothing is this launch's."""
    start = last_of(records, "start")
    if start is None:
        return [] if launched_at is not None else records
    time_of_start = start.get("time")
    if launched_at is not None and (
        not isinstance(time_of_start, (int, float)) or time_of_start < launched_at - START_SLACK_S
    ):
        return []
    return records[records.index(start) :]
