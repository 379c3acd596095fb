"""The torch.compile modes the trainer offers for its compiled regions, and why not the others.

Every drafter thread runs the ONE compiled flex_attention, and every replica's backward on a GPU
runs in that GPU's one autograd thread; a mode must work under exactly that. CUDA graph trees do
not (REFUSED_COMPILE_MODES), and every drafter's backward would replay into their one memory pool
from the shared autograd thread (pytorch #113809). max-autotune-no-cudagraphs compiles longer, each
compile still exclusive under the compile lock.
"""

from __future__ import annotations

import threading

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
REFUSED_COMPILE_MODES = {
    "reduce-overhead": "it records CUDA graph trees, which assert in the trainer's drafter threads "
    "on torch <= 2.11 (pytorch #123177)",
    "max-autotune": "it also records CUDA graph trees (see reduce-overhead); use max-autotune-no-cudagraphs",
}


def torch_compile_kwargs(mode: str) -> dict:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    return {} if mode == "default" else {"mode": mode}


_lock = threading.Lock()
_mode = "default"
_used = False  # something was compiled with _mode


def set_compile_mode(mode: str) -> None:
    """torch.compile mode of the process's compiled regions; set before their first use."""
    global _mode
    torch_compile_kwargs(mode)  # refuses unknown modes
    with _lock:
        if _used and mode != _mode:
            raise RuntimeError(
                f"the trainer's regions are already compiled with mode {_mode!r}; "
                f"set the compile mode before the first step"
            )
        _mode = mode


def compile_options() -> dict:
    """torch.compile keywords of every compiled region. dynamic=False: automatic dynamic shapes
    would recompile mid-run (the FX-tracing race again); fullgraph=True: a graph break would run
    flex eagerly, which poisons compiled calls."""
    global _used
    with _lock:
        _used = True
        return dict(dynamic=False, fullgraph=True, **torch_compile_kwargs(_mode))
