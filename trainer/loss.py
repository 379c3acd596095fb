"""Block labels and the DFlash loss.

Position k of a block anchored at a predicts token a+k (k = 0 is the anchor itself and is never
trained). Positions 1..B-1 are weighted exp(-(k-1)/gamma): early positions matter most, because a
draft is accepted only up to its first wrong token. The loss is normalised by the weight sum of the
positions that actually count, so sequences with few trainable positions are not down-weighted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Rows of logits computed at once by the fused loss: ~2^27 fp32 values (512 MiB) per chunk.
_FUSED_CHUNK_ELEMENTS = 1 << 27


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, N, block] (IGNORE_INDEX where not trained) and label_mask [B, N, block].

    A position counts when its block is valid, k >= 1, anchor+k lies inside the sequence and the
    loss mask is on there.
    """
    batch, seq_len = input_ids.shape
    num_blocks = anchors.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets                      # [B, N, block]
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
    ce = F.cross_entropy(_at_least_fp32(logits.reshape(-1, vocab)), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none")
    loss = (ce.view_as(targets) * _row_weights(label_mask, gamma)).sum()
    correct = logits.argmax(dim=-1) == targets
    return loss, _accuracy(correct, label_mask)


class _FrozenHeadCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T + b, y_i) with W frozen, computed in row chunks.

    The gradient w.r.t. h is produced chunk by chunk during the forward (the loss is linear in the
    upstream gradient), so neither the full logits nor their gradient are ever held in memory and
    the lm_head matmul is not recomputed: exactly one forward and one input-gradient matmul.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weights, chunk_rows: int):
        need_grad = ctx.needs_input_grad[0]
        loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32),
                           device=hidden.device)
        correct = torch.empty(targets.shape, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        safe_targets = targets.clamp_min(0).unsqueeze(1)
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            logits = _at_least_fp32(F.linear(hidden[start:stop], weight, bias))
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_targets[start:stop]).squeeze(1)
            w = row_weights[start:stop]
            loss += ((lse - target_logit) * w).sum()
            correct[start:stop] = logits.argmax(dim=-1) == targets[start:stop]
            if need_grad:
                # d/dlogits of w*CE = w * (softmax - onehot(target))
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                probs.scatter_add_(1, safe_targets[start:stop],
                                   torch.full_like(target_logit, -1.0).unsqueeze(1))
                probs.mul_(w.unsqueeze(1))
                grad[start:stop] = probs.to(weight.dtype) @ weight
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def dflash_loss_fused(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    gamma: float,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as dflash_loss(F.linear(hidden, W, b), ...) from drafter hidden [B, N*block, H].

    Only positions 1..block-1 go through the lm_head (position 0 is never trained), in chunks.
    """
    batch, num_blocks, block_size = labels.shape
    hidden_size = hidden.shape[-1]
    rows = hidden.view(batch, num_blocks, block_size, hidden_size)[:, :, 1:].reshape(-1, hidden_size)
    targets = labels[:, :, 1:].reshape(-1)
    row_weights = _row_weights(label_mask, gamma).reshape(-1)
    if chunk_rows is None:
        chunk_rows = max(1, _FUSED_CHUNK_ELEMENTS // lm_head_weight.shape[0])
    weight = lm_head_weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    loss, correct = _FrozenHeadCE.apply(rows, weight, bias, targets, row_weights, int(chunk_rows))
    return loss, _accuracy(correct.view(batch, num_blocks, block_size - 1), label_mask)

