"""Anchors and the DFlash block attention mask.

Layout of one attention call: queries are the N blocks of `block_size` tokens (block n covers query
rows n*block_size .. (n+1)*block_size-1); keys/values are the `ctx_len` projected target positions
followed by the same N*block_size block tokens.

Visibility (what inference sees, and nothing more):
- a block token sees context positions STRICTLY before its anchor: the target hidden state AT the
  anchor already encodes the target's guess for anchor+1, and at inference it does not exist yet;
- it sees every token of its own block, in both directions (inference runs no causal mask there);
- a padding block (valid=False) sees only itself, one key per query. That keeps SDPA free of
  all-masked rows (which give NaN) and makes the flex and SDPA paths agree exactly; padding blocks
  carry no labels, so nothing they compute reaches the loss.

`mask_mod` is the single source of truth: `dense_mask` evaluates the very same function on a
broadcast grid, so the flex (BlockMask) and SDPA (dense bool) paths cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F

from trainer.block_size import block_size_problem
from trainer.compile_lock import MASK_LOCK


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` random anchor positions per sequence. Position a is eligible when a and
    a+1 are both trained, so every valid block has a label. Valid anchors come first, ascending; the
    rest are anchor 0 with valid=False. Shapes are static ([B, num_anchors]); nothing syncs with the host."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if block_problem := block_size_problem(block_size):
        raise ValueError(f"block_size {block_problem}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq_len], got shape {tuple(loss_mask.shape)}")
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    trained = loss_mask.bool()
    eligible = torch.zeros_like(trained)
    eligible[:, :-1] = trained[:, :-1] & trained[:, 1:]

    # Random scores drawn on the generator's device keep runs reproducible across devices.
    scores = torch.rand((batch, seq_len), generator=generator, device=generator.device).to(device)
    scores = torch.where(eligible, scores, -1.0)
    k = min(num_anchors, seq_len)
    top = scores.topk(k, dim=1)
    # Sort valid picks ascending and push padding (value seq_len) behind them.
    anchors, _ = torch.where(top.values >= 0, top.indices, seq_len).sort(dim=1)
    if k < num_anchors:
        pad = torch.full((batch, num_anchors - k), seq_len, dtype=anchors.dtype, device=device)
        anchors = torch.cat([anchors, pad], dim=1)
    valid = anchors < seq_len
    anchors = torch.where(valid, anchors, 0)
    return anchors, valid


def make_mask_mod(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int) -> Callable:
    """flex_attention mask_mod(b, h, q_idx, kv_idx) -> bool for the visibility rules above."""
    last_block = anchors.shape[1] - 1

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        # Clamp: kernels may evaluate padded query rows past the last block.
        block = torch.clamp(q_idx // block_size, max=last_block)
        anchor = anchors[b, block]
        is_valid = valid[b, block]
        in_context = kv_idx < ctx_len
        sees_context = in_context & (kv_idx < anchor) & is_valid
        block_kv = kv_idx - ctx_len
        own_block = (~in_context) & (block_kv // block_size == block)
        sees_block = own_block & (is_valid | (block_kv == q_idx))
        return sees_context | sees_block

    return dflash_mask_mod


def build_block_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, device):
    """The flex_attention BlockMask for one batch (built fresh each step; serialised). Its tiles come
    from each query row's two visible intervals (the context before its anchor, its own block), not
    from create_block_mask's evaluation of mask_mod at every (q, kv): ~9 ms a paper-dims step."""
    from torch.nn.attention.flex_attention import BlockMask

    anchors, valid = anchors.to(device), valid.to(device)
    q_len = anchors.shape[1] * block_size
    mask_mod = make_mask_mod(anchors, valid, ctx_len, block_size)
    with MASK_LOCK:
        if not _tiles_take_lengths():  # torch < 2.6
            return evaluated_block_mask(anchors, valid, ctx_len, block_size, device)
        partial, full = _tiles(anchors, valid, ctx_len, block_size)
        return BlockMask.from_kv_blocks(
            *_listed(partial),
            *_listed(full),
            BLOCK_SIZE=TILE,
            mask_mod=mask_mod,
            seq_lengths=(q_len, ctx_len + q_len),
        )


def evaluated_block_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, device):
    """The same BlockMask from create_block_mask, which evaluates mask_mod at every (q, kv): torch < 2.6,
    and the benchmarks' baseline. The caller holds MASK_LOCK where threads build masks."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_len = anchors.shape[1] * block_size
    mask_mod = make_mask_mod(anchors.to(device), valid.to(device), ctx_len, block_size)
    return create_block_mask(mask_mod, anchors.shape[0], None, q_len, ctx_len + q_len, device=str(device))


TILE = 128  # flex_attention's default sparse block size, both ways


@functools.cache
def _tiles_take_lengths() -> bool:
    """BlockMask.from_kv_blocks takes the true sequence lengths (torch >= 2.6), asked once."""
    from torch.nn.attention.flex_attention import BlockMask

    return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


def _tiles(anchors, valid, ctx_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, query tiles, kv tiles] bools: tiles some of whose (q, kv) are visible but not all (partial),
    and tiles entirely inside the mask's bounds whose every (q, kv) is visible (full)."""
    batch, num_blocks = anchors.shape
    q_len, device = num_blocks * block_size, anchors.device
    q = torch.arange(q_len, device=device)
    block = q // block_size
    is_valid = valid[:, block]  # [B, Q]
    context_end = torch.where(is_valid, anchors[:, block], 0).unsqueeze(-1)  # sees [0, context_end)
    own_start = torch.where(is_valid, ctx_len + block * block_size, ctx_len + q).unsqueeze(-1)
    own_end = own_start + torch.where(is_valid, block_size, 1).unsqueeze(-1)  # and [own_start, own_end)
    lo = torch.arange(0, ctx_len + q_len, TILE, device=device)
    hi = (lo + TILE).clamp(max=ctx_len + q_len)
    some = (lo < context_end) | ((lo < own_end) & (hi > own_start))  # [B, Q, kv tiles]
    every = (hi <= context_end) | ((lo >= own_start) & (hi <= own_end))
    q_tiles = -(-q_len // TILE)
    padding = (0, 0, 0, q_tiles * TILE - q_len)  # rows past the query length see nothing
    some = F.pad(some, padding).view(batch, q_tiles, TILE, -1).any(2)
    full = F.pad(every, padding).view(batch, q_tiles, TILE, -1).all(2) & (hi - lo == TILE)
    return some & ~full, full


def _listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's form of a tile set: the count per query tile and the kv tile indices, listed first."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.unsqueeze(1), order.unsqueeze(1)  # one head


def dense_mask(
    anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, device
) -> torch.Tensor:
    """The same mask as a dense bool tensor [B, 1, N*block, ctx_len + N*block] for SDPA."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    mask_mod = make_mask_mod(anchors.to(device), valid.to(device), ctx_len, block_size)
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    q_idx = torch.arange(q_len, device=device).view(1, q_len, 1)
    kv_idx = torch.arange(ctx_len + q_len, device=device).view(1, 1, ctx_len + q_len)
    return mask_mod(b, 0, q_idx, kv_idx).unsqueeze(1)
