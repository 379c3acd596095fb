"""Which torch.compile modes the trainer offers for its compiled flex_attention, and why not the others.

The drafter threads share one process: every replica runs the ONE compiled flex_attention from its
own Python thread, and the backward of every replica on a GPU runs in that GPU's single autograd
worker thread. A mode must work under exactly that.

Offered:
- default: inductor kernels, no CUDA graphs.
- max-autotune-no-cudagraphs: inductor also benchmarks kernel configs while compiling (longer
  compiles, each still exclusive under the compile lock); no CUDA graphs.

Refused (both turn on `triton.cudagraphs`, i.e. CUDA graph trees):
- reduce-overhead, max-autotune: a CUDA graph tree manager keeps its state in thread-local storage
  and records into a private memory pool. On torch <= 2.11 (the GPU boxes' version) tree state is
  not set up for Python-created threads and asserts there (pytorch issue #123177, fixed only by
  pytorch PR #184357, mid-2026), and the backward graphs of every drafter on one GPU replay from the
  one shared autograd thread into that pool (#113809). The trainer's torch floor is 2.5, so these
  modes cannot be offered. (Activation checkpointing would also re-run each recorded forward graph
  inside the backward, against CUDA graph trees' one-run-at-a-time rule for a pool; not measured.)
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
    """Keyword arguments for torch.compile for a trainer compile mode."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    return {} if mode == "default" else {"mode": mode}


_lock = threading.Lock()
_mode = "default"
_used = False  # something was compiled with _mode


def set_compile_mode(mode: str) -> None:
    """torch.compile mode of the process's compiled regions (flex_attention, layers, loss chunk);
    before their first use."""
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
    """torch.compile keywords of every compiled region of the trainer.

    dynamic=False: training shapes are static, and automatic dynamic shapes would trigger a second
    compile mid-run (reopening the FX-tracing race window). fullgraph=True: a graph break would
    silently run flex eagerly, which poisons compiled calls.
    """
    global _used
    with _lock:
        _used = True
        return dict(dynamic=False, fullgraph=True, **torch_compile_kwargs(_mode))
