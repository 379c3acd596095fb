"""What every benchmark records next to its numbers, and the fresh compile caches of its children."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Qwen3-8B's shape (random weights: a cost question needs no trained target)
QWEN3_8B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def doc_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its module docstring, laid out as written, is the --help text."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def fresh_compile_env(scratch: str, **extra: str) -> dict:
    """This process's environment with empty inductor and triton caches under `scratch` (a child that
    compiles from nothing, as a new job does) and the repository importable first (sites already on
    PYTHONPATH kept)."""
    return dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"),
        TRITON_CACHE_DIR=os.path.join(scratch, "triton"),
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        **extra,
    )


def versions(device: str) -> dict:
    """torch/CUDA/python/host, plus the GPU name and driver when `device` is a CUDA device."""
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        info["driver"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, IndexError, subprocess.SubprocessError):
        info["driver"] = "n/a (no nvidia-smi)"
    return info


def popen_text(cmd: list[str], env: dict, stderr=subprocess.PIPE, **more) -> subprocess.Popen:
    """`cmd` started in the repository, its output read as text (stderr apart unless told)."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO, **more)


def under_timeout(cmd: list[str], seconds: int) -> list[str]:
    """`cmd` killed by `timeout` after `seconds`, hard 10 s later."""
    return ["timeout", "-k", "10", str(seconds), *cmd]


@contextlib.contextmanager
def built_on(device: str, dtype):
    """Modules made inside are initialised on `device` in `dtype` directly: no host or fp32 copy of
    8B parameters."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def sync(device: str) -> None:
    """Wait for `device`'s queued work, so a wall-clock reading is its own."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def time_cache_write(target, dataset, cache_dir: str, header: dict, device: str) -> dict:
    """The feature-cache writer over `dataset` against the bare feature forward of the same
    auto-sized batches, timed after one warm-up forward at that batch shape: {batch, bare_forward_s,
    write_cache_s, manifest}."""
    import time

    import torch

    from trainer.data.cache_writer import auto_batch_size, write_cache

    ids = dataset.input_ids
    batch = auto_batch_size(ids.shape[1])
    batches = [ids[i : i + batch].to(device) for i in range(0, len(dataset), batch)]

    def seconds_of(work) -> tuple[float, object]:
        sync(device)
        began = time.perf_counter()
        result = work()
        sync(device)
        return time.perf_counter() - began, result

    def bare_forward():
        return [target.features(x, attention_mask=torch.ones_like(x)) for x in batches]

    with torch.no_grad():
        seconds_of(bare_forward)  # warm-up at the batch shape
        bare_s, _ = seconds_of(bare_forward)
        write_s, manifest = seconds_of(
            lambda: write_cache(target, dataset, cache_dir, header, say=lambda _: None)
        )
    return {"batch": batch, "bare_forward_s": bare_s, "write_cache_s": write_s, "manifest": manifest}


def tiny_train_argv(output_dir, *more: str) -> list[str]:
    """This interpreter training the `tiny-cpu` config into `output_dir` (a child's command line)."""
    return [sys.executable, "-m", "trainer", "--config", "tiny-cpu", "--output-dir", str(output_dir), *more]
