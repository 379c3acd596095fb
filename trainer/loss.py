"""Block labels and the DFlash loss.

Position k of a block anchored at a predicts token a+k (k = 0 is the anchor itself and is never
trained). Positions 1..B-1 are weighted exp(-(k-1)/gamma): early positions matter most, because a
draft is accepted only up to its first wrong token. The loss is normalised by the weight sum of the
positions that actually count, so sequences with few trainable positions are not down-weighted.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from trainer import compile_modes, loss_kernel

IGNORE_INDEX = -100
# Rows of logits computed at once by the fused loss: ~2^27 fp32 values (512 MiB) per chunk.
_FUSED_CHUNK_ELEMENTS = 1 << 27
# The compiled chunk keeps only bf16 logits and their bf16 gradient: ~2^27 values (256 MiB) each.
# It runs when the forward's activations peak, so its size adds to the step's peak memory.
_KERNEL_CHUNK_ELEMENTS = 1 << 27


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, N, block] (IGNORE_INDEX where not trained) and label_mask [B, N, block]. A position
    counts when its block is valid, k >= 1, anchor+k is inside the sequence and the loss mask is on."""
    batch, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets  # [B, N, block]
    inside = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).view(batch, num_blocks * block_size)
    tokens = input_ids.gather(1, flat).view(batch, num_blocks, block_size)
    trained = loss_mask.bool().gather(1, flat).view(batch, num_blocks, block_size)
    label_mask = valid.unsqueeze(-1) & inside & trained & (offsets >= 1)
    labels = torch.where(label_mask, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return labels, label_mask


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[block-1] weights exp(-(k-1)/gamma) for k = 1..block-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Softmax/CE precision: bf16/fp16 logits are upcast, fp64 ones are kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _row_weights(label_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, N, block-1] per-position weights already divided by the total weight that counts."""
    block_size = label_mask.shape[-1]
    mask = label_mask[:, :, 1:].float()
    weights = position_weights(block_size, gamma, label_mask.device) * mask
    # clamp: a batch with nothing to train gives loss 0, not NaN (and no host sync to check).
    return weights / weights.sum().clamp_min(1e-12)


def _accuracy(correct: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """[block-1] fraction of counted positions predicted right, per block position 1..B-1."""
    mask = label_mask[:, :, 1:]
    hits = (correct & mask).sum(dim=(0, 1)).float()
    return hits / mask.sum(dim=(0, 1)).clamp_min(1).float()


def dflash_loss(
    logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE scalar, acc_per_position [block-1]) from full logits [B, N*block, V]."""
    batch, num_blocks, block_size = labels.shape
    vocab = logits.shape[-1]
    logits = logits.view(batch, num_blocks, block_size, vocab)[:, :, 1:]
    targets = labels[:, :, 1:]
    ce = F.cross_entropy(
        _at_least_fp32(logits.reshape(-1, vocab)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    loss = (ce.view_as(targets) * _row_weights(label_mask, gamma)).sum()
    correct = logits.argmax(dim=-1) == targets
    return loss, _accuracy(correct, label_mask)


def _ce_chunk_eager(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, need_grad: bool):
    """(sum_i w_i CE_i, argmax == target [R], d(sum)/d(logits) or None) of one chunk of rows, eagerly
    and in place over the upcast logits (the reference, and the CPU path)."""
    logits = _at_least_fp32(logits)
    lse = torch.logsumexp(logits, dim=-1)
    safe_targets = targets.clamp_min(0).unsqueeze(1)
    target_logit = logits.gather(1, safe_targets).squeeze(1)
    loss = ((lse - target_logit) * weights).sum()
    correct = logits.argmax(dim=-1) == targets
    if not need_grad:
        return loss, correct, None
    # d/dlogits of w*CE = w * (softmax - onehot(target))
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, safe_targets, torch.full_like(target_logit, -1.0).unsqueeze(1))
    return loss, correct, probs.mul_(weights.unsqueeze(1))


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
    """The same chunk as _ce_chunk_eager with the gradient, written for torch.compile: no in-place
    ops, the one-hot as a comparison, the gradient returned in the logits' dtype. Compiled it is a
    reduction pass (max, sum of exp, argmax, target logit) and one pointwise pass over the logits,
    with the fp32 upcast and the softmax never stored."""
    x = _at_least_fp32(logits)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    safe_targets = targets.clamp_min(0).unsqueeze(1)
    target_logit = x.gather(1, safe_targets)
    loss = ((lse - target_logit).squeeze(1) * weights).sum()
    correct = x.argmax(dim=-1) == targets
    onehot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == safe_targets
    grad = ((x - lse).exp() - onehot.to(x.dtype)) * weights.unsqueeze(1)
    return loss, correct, grad.to(logits.dtype)


_compiled_ce_chunk = None
_compiled_ce_chunk_init = threading.Lock()


def compiled_ce_chunk():
    """ce_chunk compiled once per process (static shapes: every chunk has the same row count)."""
    global _compiled_ce_chunk
    if _compiled_ce_chunk is None:
        with _compiled_ce_chunk_init:
            if _compiled_ce_chunk is None:
                _compiled_ce_chunk = torch.compile(ce_chunk, **compile_modes.compile_options())
    return _compiled_ce_chunk


class _FrozenHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T + b, y_i) with W frozen, in row chunks. The gradient w.r.t. h is made
    chunk by chunk in the forward (the loss is linear in the upstream gradient), so neither the full
    logits nor their gradient are ever held and the lm_head matmul is not recomputed. `chunk_fn` is
    ce_chunk (compiled), trainer.loss_kernel.ce_chunk (Triton) or None for _ce_chunk_eager."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, chunk_rows: int, chunk_fn):
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        correct = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            logits = F.linear(hidden[start:stop], weight, bias)
            y, w = targets[start:stop], row_weights[start:stop]
            if need_grad and chunk_fn is not None:
                part, correct[start:stop], dlogits = chunk_fn(logits, y, w)
            else:
                part, correct[start:stop], dlogits = _ce_chunk_eager(logits, y, w, need_grad)
            loss += part
            if grad is not None:
                grad[start:stop] = dlogits.to(weight.dtype) @ weight
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


LOSS_KERNELS = ("auto", "eager", "compiled", "triton")


def loss_kernel_for(device: torch.device | str, kernel: str = "auto") -> str:
    """The kernel for "auto": on CUDA the Triton chunk (the compiled one without Triton), the eager one
    elsewhere (CPU compiles cost more than they save)."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {kernel!r} is unknown; use one of {', '.join(LOSS_KERNELS)}")
    if kernel != "auto":
        return kernel
    if torch.device(device).type != "cuda":
        return "eager"
    return "compiled" if loss_kernel.triton is None else "triton"


def even_chunks(rows: int, max_rows: int, multiple: int = 16) -> tuple[int, int]:
    """(chunk_rows, chunks): chunks of at most ~max_rows rows, all the same size (a multiple of
    `multiple`) so that one compiled graph serves them all; chunk_rows * chunks >= rows. Among the
    fewest chunks and up to three more, the first that needs no padding rows wins (padding rows
    are lm_head work for nothing), else the fewest."""
    fewest = max(1, math.ceil(rows / max(1, max_rows)))
    options = []
    for chunks in range(fewest, fewest + 4):
        chunk_rows = math.ceil(math.ceil(rows / chunks) / multiple) * multiple
        options.append((chunk_rows, math.ceil(rows / chunk_rows)))
    return next((o for o in options if o[0] * o[1] == rows), options[0])


def dflash_loss_fused(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    gamma: float,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """dflash_loss(F.linear(hidden, W, b), ...) from drafter hidden [B, N*block, H], only positions
    1..block-1 through the lm_head, in chunks ("compiled" pads them equal: padding rows weigh 0)."""
    batch, num_blocks, block_size = labels.shape
    hidden_size = hidden.shape[-1]
    rows = hidden.view(batch, num_blocks, block_size, hidden_size)[:, :, 1:].reshape(-1, hidden_size)
    targets = labels[:, :, 1:].reshape(-1)
    row_weights = _row_weights(label_mask, gamma).reshape(-1)
    vocab = lm_head_weight.shape[0]
    weight = lm_head_weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    chunk_fn = None
    chosen = loss_kernel_for(hidden.device, kernel)
    if chosen == "triton" and not loss_kernel.available(rows):
        chosen = "compiled"  # fp32 logits: the Triton kernel takes 16-bit ones
    if chosen == "triton":
        chunk_rows, _ = even_chunks(rows.shape[0], chunk_rows or _KERNEL_CHUNK_ELEMENTS // vocab)
        chunk_fn = loss_kernel.ce_chunk
    elif chosen == "compiled":
        chunk_rows, chunks = even_chunks(rows.shape[0], chunk_rows or _KERNEL_CHUNK_ELEMENTS // vocab)
        if pad := chunk_rows * chunks - rows.shape[0]:
            rows = F.pad(rows, (0, 0, 0, pad))
            targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
            row_weights = F.pad(row_weights, (0, pad))
        chunk_fn = compiled_ce_chunk()
    elif chunk_rows is None:
        chunk_rows = max(1, _FUSED_CHUNK_ELEMENTS // vocab)
    loss, correct = _FrozenHeadCE.apply(rows, weight, bias, targets, row_weights, int(chunk_rows), chunk_fn)
    correct = correct[: batch * num_blocks * (block_size - 1)]
    return loss, _accuracy(correct.view(batch, num_blocks, block_size - 1), label_mask)
