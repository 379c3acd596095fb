"""Training precision (`train.precision`): fp32, or bf16-mixed.

bf16-mixed keeps fp32 master weights and fp32 AdamW state, and computes forward and backward in
bf16. bf16 has 8 mantissa bits: near 1.0 its spacing is 2^-7, so an AdamW step of ~lr applied to
a bf16 weight rounds to nothing (RMSNorm weights, initialised to 1, would never move).

It is autocast over fp32 parameters rather than bf16 working copies: the optimizer, the
checkpoints, --resume and the replica gradient averaging all keep seeing plain fp32 parameters,
and nothing has to copy weights back after each step. Autocast caches the bf16 cast of every
weight for the whole forward, so each weight is cast once per step (at paper dims ~1 ms on an
H200). Autocast state is thread-local: `autocast()` is entered inside each drafter thread.

The frozen target embedding and lm_head keep the target's own dtype (bf16 on GPU): they are
never updated, and an fp32 copy of a 150k-row lm_head would cost memory and bandwidth per step.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.config import PRECISIONS

MASTER_DTYPE = torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls and attention run in."""
    _check(precision)
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float32


def place(model: torch.nn.Module, device: str, precision: str) -> torch.nn.Module:
    """Move a freshly built drafter to its device with fp32 (master) parameters."""
    _check(precision)
    if precision == "fp32":
        return model.to(device=device, dtype=MASTER_DTYPE)  # the frozen target tensors too
    model.to(device=device)  # the frozen target tensors keep the target's dtype
    for name, param in model.named_parameters():
        if param.dtype != MASTER_DTYPE:
            raise AssertionError(f"{name} is {param.dtype}: bf16-mixed needs fp32 master weights")
    return model


def autocast(device: str, precision: str):
    """The compute context of one forward (enter it in the thread that runs the forward)."""
    if compute_dtype(precision) == MASTER_DTYPE:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=compute_dtype(precision))


def loss_input(hidden: torch.Tensor, precision: str) -> torch.Tensor:
    """The drafter's hidden states as the fused loss should see them: in the compute dtype, so the
    frozen lm_head matmul runs in bf16 without an fp32 copy of the lm_head."""
    return hidden.to(compute_dtype(precision))


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q/k/v in one dtype: under autocast the autocast dtype (RMSNorm and RoPE give fp32 q/k while
    v comes out of a bf16 matmul; flex_attention and SDPA need them equal)."""
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def upcast_note(weights: dict, path: str) -> str | None:
    """One log line when a checkpoint's weights are not fp32 (written before fp32 master weights)."""
    stored = sorted({str(t.dtype).replace("torch.", "") for t in weights.values() if t.dtype != MASTER_DTYPE})
    if not stored:
        return None
    return (
        f"resume: {path} holds {'/'.join(stored)} weights; continuing with them upcast to fp32 "
        f"master weights (the AdamW state is upcast too)"
    )


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; use one of {', '.join(PRECISIONS)}")


def resolve(cfg) -> str:
    from trainer.config import default_precision

    return cfg.train.precision or default_precision(cfg.run.drafter_devices)
