"""What every benchmark records next to its numbers, and the fresh compile caches of its children."""

from __future__ import annotations

import os
import platform
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
