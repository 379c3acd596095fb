"""Checkpoints: `<output_dir>/checkpoints/step-NNNNNNN/`, written whole or not at all.

Built in a `.tmp-*` sibling, every file fsynced, then renamed into place: a kill -9 at any moment
leaves the new checkpoint or none of it. Only `step-*` directories count; leftovers are swept.
Files: REQUIRED (weights, optimizer/scheduler/data position/RNG, run config, drafter config).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from trainer.atomic import fsync_dir
from trainer.config import in_one_line
from trainer.files import follow_umask

# torch and safetensors are imported where tensors are read or written: argument and path errors
# (export --checkpoint, --resume) are reported before torch is loaded.

CHECKPOINTS = "checkpoints"
WEIGHTS = "drafter.safetensors"
STATE = "trainer_state.pt"
CONFIG = "config.json"
DRAFTER_CONFIG = "drafter_config.json"
REQUIRED = (WEIGHTS, STATE, CONFIG, DRAFTER_CONFIG)
_STEP_DIR = re.compile(r"^step-(\d{7,})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be found or read; the message says which and what to do."""

    exit_code = 2


@dataclasses.dataclass
class Checkpoint:
    path: str
    step: int
    weights: dict  # name -> tensor (cpu)
    optimizer: dict
    scheduler: dict
    data_position: dict
    rng: dict
    config: dict
    drafter_config: dict


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / CHECKPOINTS


def list_checkpoints(output_dir: str) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir() and not _missing(entry):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return str(found[-1][1]) if found else None


def resolve_resume(resume: str, output_dir: str) -> str:
    """`latest` -> the newest checkpoint of output_dir; a run directory -> its newest checkpoint;
    otherwise `resume` must be a checkpoint directory itself."""
    if resume != "latest" and not checkpoints_root(resume).is_dir():
        _require_complete(resume)
        return resume
    where = output_dir if resume == "latest" else resume
    if (path := latest_checkpoint(where)) is None:
        raise CheckpointError(
            f"--resume {resume}: no checkpoint in {checkpoints_root(where)}. "
            f"Fix: start without --resume, or pass --resume PATH to a step-NNNNNNN directory."
        )
    return path


def resolve_export_source(path: str) -> str:
    """`export --checkpoint PATH`: a step directory, or a run's output dir (its newest checkpoint)."""
    fix = (
        "Fix: pass a checkpoints/step-NNNNNNN directory, or a training run's output directory "
        "(its latest checkpoint)"
    )
    if not os.path.exists(path):
        raise CheckpointError(f"--checkpoint {path}: no such file or directory. {fix}.")
    if checkpoints_root(path).is_dir():
        if (latest := latest_checkpoint(path)) is None:
            raise CheckpointError(
                f"--checkpoint {path}: no complete checkpoint in {checkpoints_root(path)} yet. {fix}."
            )
        return latest
    if missing := _missing(path):
        raise CheckpointError(f"--checkpoint {path}: not a checkpoint (missing {', '.join(missing)}). {fix}.")
    return path


def _missing(path) -> list[str]:
    return [name for name in REQUIRED if not (Path(path) / name).is_file()]


def _require_complete(path: str) -> None:
    if missing := _missing(path):
        raise CheckpointError(
            f"{path}: not a complete checkpoint (missing {', '.join(missing)}). "
            f"Fix: pass a checkpoints/step-NNNNNNN directory, or --resume latest."
        )


def rng_state(devices: list[str]) -> dict:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": {}}
    for dev in sorted(set(devices)):
        if dev.startswith("cuda") and torch.cuda.is_available():
            state["cuda"][dev] = torch.cuda.get_rng_state(torch.device(dev))
    return state


def set_rng_state(state: dict) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # exactly a tuple: a reload may give lists
    torch.set_rng_state(state["torch"])
    for dev, cuda_state in state.get("cuda", {}).items():
        index = torch.device(dev).index
        if torch.cuda.is_available() and index is not None and index < torch.cuda.device_count():
            torch.cuda.set_rng_state(cuda_state, torch.device(dev))


def save_checkpoint(
    output_dir: str,
    step: int,
    *,
    weights: dict,
    optimizer: dict,
    scheduler: dict,
    data_position: dict,
    rng: dict,
    config: dict,
    drafter_config: dict,
    keep_last: int,
) -> str:
    """Write checkpoint `step` atomically, then drop all but the newest `keep_last`; returns its absolute
    path (it goes into the metrics file, read from other working directories)."""
    import torch
    from safetensors.torch import save_file

    root = checkpoints_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():  # half-written directories of a killed save (only one trainer writes here)
        if entry.name.startswith((".tmp-", ".old-")) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    tmp.mkdir()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"step": str(step)})
    follow_umask(tmp / WEIGHTS)
    resumed = {"optimizer": optimizer, "scheduler": scheduler, "data_position": data_position, "rng": rng}
    torch.save({"step": step, **resumed}, tmp / STATE)
    for name, payload in ((CONFIG, config), (DRAFTER_CONFIG, drafter_config)):
        (tmp / name).write_text(json.dumps(payload, indent=2, sort_keys=True), encoding="utf-8")
    for name in REQUIRED:
        _fsync_file(tmp / name)
    fsync_dir(tmp)
    old = root / f".old-{final.name}-{os.getpid()}"
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)
    for _, stale in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    return os.path.abspath(final)


def mark_finished(output_dir: str, step: int) -> None:
    """Leave metrics_format.RUN_FINISHED in the run's directory: this run is complete."""
    from trainer.metrics_format import RUN_FINISHED

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, RUN_FINISHED).write_text(f"{step}\n", encoding="utf-8")


def load_checkpoint(path: str) -> Checkpoint:
    import torch
    from safetensors.torch import load_file

    _require_complete(path)
    try:
        weights = load_file(os.path.join(path, WEIGHTS))
        state = torch.load(os.path.join(path, STATE), map_location="cpu", weights_only=True)
        config = json.loads(Path(path, CONFIG).read_text(encoding="utf-8"))
        drafter_config = json.loads(Path(path, DRAFTER_CONFIG).read_text(encoding="utf-8"))
        step = int(state["step"])
        resumed = {key: state[key] for key in ("optimizer", "scheduler", "data_position", "rng")}
    except Exception as exc:  # corrupt or foreign files: say which checkpoint, in one line
        raise _unreadable(path, exc) from exc
    return Checkpoint(path, step, weights, config=config, drafter_config=drafter_config, **resumed)


def drafter_config_of(state: Checkpoint):
    """The checkpoint's DrafterConfig, for a command that reads its configs (eval, export): a damaged
    config.json or drafter_config.json (not an object, a key missing or mistyped) is a CheckpointError."""
    from trainer.model import DrafterConfig

    try:
        if not (isinstance(state.config, dict) and all(isinstance(v, dict) for v in state.config.values())):
            raise ValueError(f"{CONFIG} is not a JSON object of config sections")
        if not isinstance(state.drafter_config, dict):
            raise ValueError(f"{DRAFTER_CONFIG} is not a JSON object")
        return DrafterConfig.from_dict(state.drafter_config)
    except (TypeError, ValueError) as exc:
        raise _unreadable(state.path, exc) from exc


def load_weights(model, weights: dict, whose: str, fix: str) -> None:
    """model.load_state_dict(weights); tensors missing, unexpected or reshaped are one CheckpointError line,
    "{whose} weights do not fit its drafter config (which tensors). {fix}"."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        said = f"Error(s) in loading state_dict for {type(model).__name__}: "
        mismatch = " ".join(str(exc).split()).removeprefix(said)[:300].rstrip(".")
        raise CheckpointError(f"{whose} weights do not fit its drafter config ({mismatch}). {fix}") from exc


def _unreadable(path: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read checkpoint {path}: {in_one_line(exc)}. "
        f"Fix: pass another checkpoint (e.g. an earlier checkpoints/step-NNNNNNN dir)"
    )


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
