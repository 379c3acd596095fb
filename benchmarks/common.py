"""What every benchmark records next to its numbers."""

from __future__ import annotations

import platform
import subprocess


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
