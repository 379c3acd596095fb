"""Which Gated DeltaNet path a hybrid (Qwen3.5/3.6) target runs: the field's kernels or the fallback.

Transformers runs a Gated DeltaNet layer's delta rule through `flash-linear-attention` (import `fla`,
Triton kernels; the `kernels` extra installs it) and its short causal conv through `causal-conv1d`
(a CUDA extension, sdist-only on the package index: it builds with nvcc, so no extra installs it)
when they import, and otherwise through a PyTorch reference that is "correct but much slower".
Transformers resolves each function once, when its model module is imported; this module reads
that resolution back from the model's own module, so the answer is the path that runs.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from trainer.target_family import LINEAR_ATTENTION, is_hybrid, text_config

INSTALL_HINT = "pip install 'dflash-ops[kernels]' (flash-linear-attention)"
# The functions transformers picks for a Gated DeltaNet layer: (module attribute, what it does, owner package)
FUNCTIONS = (
    ("torch_chunk_gated_delta_rule", "delta rule", "fla"),
    ("causal_conv1d_fn", "conv", "causal_conv1d"),
)
DISTRIBUTIONS = ("flash-linear-attention", "fla-core", "causal-conv1d")


def installed() -> dict[str, str | None]:
    """Installed versions of the kernel packages (None: not installed), without importing them."""
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _resolved(function: Any) -> Any:
    """The implementation transformers' fallback decorator chose for `function` (itself if none)."""
    code = getattr(function, "__code__", None)
    if code is not None and "implementation" in code.co_freevars and function.__closure__:
        return function.__closure__[code.co_freevars.index("implementation")].cell_contents
    return function


def gated_deltanet_path(model) -> dict[str, str] | None:
    """None for a dense target; else {"delta rule": "fla"|"torch", "conv": "causal_conv1d"|"torch"}:
    the package whose code runs each part of a Gated DeltaNet layer."""
    if not is_hybrid(model.config):
        return None
    suffix = f"layers.{text_config(model.config).layer_types.index(LINEAR_ATTENTION)}.linear_attn"
    layer = next((module for name, module in model.named_modules() if name.endswith(suffix)), None)
    home = sys.modules.get(type(layer).__module__) if layer is not None else None
    path = {}
    for attribute, part, package in FUNCTIONS:
        function = getattr(home, attribute, None)
        owner = getattr(_resolved(function), "__module__", "") or ""
        path[part] = package if owner.split(".")[0] == package else "torch"
    return path


def describe(path: dict[str, str] | None) -> str | None:
    """One line for the start log: which Gated DeltaNet path runs (None for a dense target)."""
    if path is None:
        return None
    versions = installed()
    if path["delta rule"] == "fla":
        rule = f"fla kernels (flash-linear-attention {versions['flash-linear-attention'] or '?'})"
    else:
        rule = f"PyTorch fallback (slow; install the kernels: {INSTALL_HINT})"
    conv = "causal-conv1d" if path["conv"] == "causal_conv1d" else "PyTorch"
    return f"Gated DeltaNet: delta rule {rule}; conv {conv}"
