"""Checks of a loaded config against this machine's file system, made before torch is imported,
so a path the run cannot write is reported in well under a second, naming the flag and the fix."""

from __future__ import annotations

import os

from trainer.train.checkpoint import resolve_resume
from trainer.config import ConfigError, TrainConfig


def check_output_paths(cfg: TrainConfig) -> None:
    """The output dir and the metrics file's directory exist (created if needed) and are writable."""
    places = [("output dir", "--output-dir / run.output_dir", cfg.run.output_dir)]
    metrics_dir = os.path.dirname(cfg.metrics_path)
    if metrics_dir and os.path.abspath(metrics_dir) != os.path.abspath(cfg.run.output_dir):
        places.append(("metrics file directory", "--metrics-file / run.metrics_file", metrics_dir))
    for what, flag, directory in places:
        try:
            os.makedirs(directory, exist_ok=True)
            problem = None if os.access(directory, os.W_OK | os.X_OK) else "not writable by this user"
        except OSError as exc:
            problem = "is a file" if os.path.isfile(directory) else f"cannot create it ({exc.strerror})"
        if problem:
            raise ConfigError(
                f"{what} {directory!r} ({flag}): {problem}. "
                f"Fix: pass a directory you can write to, e.g. runs/my-run"
            )
    if os.path.isdir(cfg.metrics_path):
        raise ConfigError(
            f"metrics file {cfg.metrics_path!r} (--metrics-file / run.metrics_file): is a directory. "
            f"Fix: name a file, e.g. {os.path.join(cfg.metrics_path, 'metrics.jsonl')}"
        )


def check_resume(cfg: TrainConfig) -> None:
    """--resume names a checkpoint that exists (raises CheckpointError naming it and the fix)."""
    if cfg.run.resume:
        resolve_resume(cfg.run.resume, cfg.run.output_dir)
