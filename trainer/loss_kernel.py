"""One chunk of the fused DFlash loss as a Triton kernel: the contract of trainer.loss.ce_chunk
(weighted cross entropy, argmax == target, the gradient of the logits) in two passes over a row
of logits instead of the compiled chunk's three.

Pass 1 keeps a running max, the sum of exponentials scaled to it and the first argmax (online
softmax); pass 2 writes (softmax - onehot) * weight in the logits' dtype. A row is one program:
the vocabulary (151,936 for Qwen) is read in BLOCK-wide steps, so no logit is held twice. The
vocabulary is a compile-time constant: one kernel per model, and loop bounds Triton's interpreter
reads as numbers in every version.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch ships without Triton
    triton = None

# measured at paper dims on the H200 (benchmarks/fused_loss_check.py --tiles)
TILES = {"BLOCK": 8192, "num_warps": 8}


def available(x: torch.Tensor) -> bool:
    """The kernel runs on logits of x's device and dtype: 16-bit on CUDA, anything under
    TRITON_INTERPRET=1."""
    if triton is None:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or (
        x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    )


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, tiles: dict | None = None):
    """(sum_i w_i CE_i, argmax == target [R], d(sum)/d(logits) in the logits' dtype) of logits [R, V],
    targets [R] (negative: ignored, its weight is 0) and row weights [R]."""
    rows, vocab = logits.shape
    row_loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    correct = torch.empty(rows, device=logits.device, dtype=torch.int8)
    grad = torch.empty_like(logits)
    _ce_rows[(rows,)](
        logits, grad, targets.contiguous(), weights.float().contiguous(), row_loss, correct,
        logits.stride(0), grad.stride(0), vocab, **(tiles or TILES),
    )  # fmt: skip
    return row_loss.sum(), correct.bool(), grad


if triton is not None:

    @triton.jit
    def _ce_rows(
        logits_ptr, grad_ptr, targets_ptr, weights_ptr, loss_ptr, correct_ptr,
        stride_logits, stride_grad, vocab: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        x_row = logits_ptr + row.to(tl.int64) * stride_logits
        g_row = grad_ptr + row.to(tl.int64) * stride_grad
        target = tl.load(targets_ptr + row)
        weight = tl.load(weights_ptr + row)
        safe = tl.maximum(target, 0)
        cols = tl.arange(0, BLOCK)
        peak = -float("inf")
        total = 0.0
        best = 0
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(x_row + idx, mask=idx < vocab, other=-float("inf")).to(tl.float32)
            top, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best = tl.where(top > peak, start + where, best)  # strict: the first maximum wins, as torch
            new_peak = tl.maximum(peak, top)
            total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), axis=0)
            peak = new_peak
        lse = peak + tl.log(total)
        target_logit = tl.load(x_row + safe).to(tl.float32)
        tl.store(loss_ptr + row, (lse - target_logit) * weight)
        tl.store(correct_ptr + row, (best == target).to(tl.int8))
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            inside = idx < vocab
            x = tl.load(x_row + idx, mask=inside, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - (idx == safe).to(tl.float32)) * weight
            tl.store(g_row + idx, g.to(grad_ptr.dtype.element_ty), mask=inside)
