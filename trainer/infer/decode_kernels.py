"""Triton kernels for the static decode loop, where a step (one row per prompt) or a verify (a block of
rows) is bound by bytes read and by kernels launched, not by FLOPs:

- `attention`: attention of a few query rows over a long static cache, split over the key positions
  (flash-decoding) so every SM reads part of the cache; cuDNN's SDPA runs such a call on a few SMs.
- `linear`: a product with the residual add fused in, for the products where it beats cuBLAS.

Both agree with their PyTorch `reference_*` up to the order of the fp32 sums. Off CUDA, in fp32, past
MAX_ROWS rows or without Triton, the reference runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Triton and where its kernels run (16-bit on CUDA, or any tensor under TRITON_INTERPRET=1): the loss
# kernel's rule is these kernels' too
from trainer.loss_kernel import available, triton

if triton is not None:
    import triton.language as tl

MAX_ROWS = 64  # more rows re-read the weight per row block: the matmul is the better kernel then
# measured on the H200 for Qwen3-8B's products (benchmarks/decode_kernels.py); one tiling for every row
# count, so a step and a verify sum in the same order
LINEAR_TILES = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
KEYS_PER_SPLIT = 64


def _rows_contiguous(*tensors) -> bool:
    """Each tensor's last dimension is contiguous: the kernels step through it by 1."""
    return all(t is None or t.stride(-1) == 1 for t in tensors)


def reference_linear(x, weight, bias=None, residual=None):
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def linear(x, weight, bias=None, residual=None, tiles: dict | None = None):
    """residual + x W^T (+ bias) in one kernel launch. tiles: the kernel's tiling (the benchmark's sweep)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    width = weight.shape[0]
    res = residual.reshape(rows, width) if residual is not None else None
    usable = available(x) and rows <= MAX_ROWS and x.dtype == weight.dtype
    if not usable or not _rows_contiguous(flat, weight, bias, res):
        return reference_linear(x, weight, bias, residual)
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    res = out if res is None else res
    tiles = tiles or LINEAR_TILES
    _linear_kernel[(triton.cdiv(width, tiles["BLOCK_N"]),)](
        flat, weight, out, bias if bias is not None else out, res,
        rows, width, x.shape[-1], flat.stride(0), weight.stride(0), out.stride(0), res.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), **tiles,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], width)


def grouped_visibility(horizon: torch.Tensor, keys: int, group: int) -> torch.Tensor:
    """[B, 1, G*T, keys]: query row g*T + t of a batch row b sees the keys at positions <= horizon[b, t]."""
    batch, length = horizon.shape
    visible = torch.arange(keys, device=horizon.device) <= horizon.unsqueeze(-1)  # [B, T, keys]
    return visible.unsqueeze(1).expand(batch, group, length, keys).reshape(batch, 1, group * length, keys)


def reference_attention(q, keys, values, horizon, new_keys, new_values, where):
    """Write new_keys/new_values [B, T, Hkv, D] at positions where [B, T] of keys/values [B, Hkv, S, D],
    then attend: q [B, Hkv, G*T, D] (the G query heads of a kv head, each over T positions) against
    the cache, each query seeing what grouped_visibility says."""
    rows = torch.arange(q.shape[0], device=q.device).unsqueeze(1)
    keys[rows, :, where] = new_keys
    values[rows, :, where] = new_values
    visible = grouped_visibility(horizon, keys.shape[2], q.shape[2] // horizon.shape[1])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)


def attention(q, keys, values, horizon, new_keys, new_values, where):
    """`reference_attention` where each row's T positions are consecutive: split over KEYS_PER_SPLIT key
    positions per program (each writing the new keys of its own run), then combined."""
    dim = q.shape[-1]
    usable = available(q) and q.shape[2] <= MAX_ROWS and not dim & (dim - 1)
    if not usable or not _rows_contiguous(q, keys, values, new_keys, new_values):
        return reference_attention(q, keys, values, horizon, new_keys, new_values, where)
    batch, kv_heads, rows, _ = q.shape
    splits = triton.cdiv(keys.shape[2], KEYS_PER_SPLIT)
    partial = torch.empty(batch * kv_heads, splits, rows, dim, device=q.device, dtype=torch.float32)
    peak = torch.empty(batch * kv_heads, splits, rows, device=q.device, dtype=torch.float32)
    total = torch.empty_like(peak)
    _attention_split[(batch * kv_heads, splits)](
        q, keys, values, horizon, new_keys, new_values, where, partial, peak, total,
        kv_heads, rows, horizon.shape[1], keys.shape[2], 1.0 / math.sqrt(dim),
        *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *horizon.stride(),
        *new_keys.stride()[:3], *new_values.stride()[:3], where.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_S=KEYS_PER_SPLIT, D=dim,
    )  # fmt: skip
    out = torch.empty_like(q)
    _attention_combine[(batch * kv_heads, rows)](
        partial, peak, total, out, kv_heads, rows, splits, *out.stride()[:3], D=dim
    )
    return out


if triton is not None:

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, stride_x, stride_w, stride_out, stride_res,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x_at = x_ptr + rows[:, None] * stride_x + ks[None, :]
            xs = tl.load(x_at, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_at = w_ptr + cols[:, None] * stride_w + ks[None, :]
            acc += tl.dot(xs, tl.trans(tl.load(w_at, mask=col_ok[:, None] & k_ok[None, :], other=0.0)))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        y = acc.to(dtype)  # rounded as F.linear rounds, then added as `residual + y` adds
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0)
            y = (res.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y, mask=ok)

    @triton.jit
    def _attention_split(
        q_ptr, k_ptr, v_ptr, horizon_ptr, new_k_ptr, new_v_ptr, where_ptr, partial_ptr, peak_ptr, total_ptr,
        HKV, R, T, S, scale, stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_hb, stride_ht, stride_nkb, stride_nkt, stride_nkh,
        stride_nvb, stride_nvt, stride_nvh, stride_wb,
        BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        """One (row of the batch, kv head) against one run of BLOCK_S keys: the unnormalised output,
        the running max and the sum of exponentials of each query row. The run's new keys come from
        new_k/new_v (and are written to the cache here, which no other program reads them from)."""
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = bh // HKV, bh % HKV
        rows, dims = tl.arange(0, BLOCK_R), tl.arange(0, D)
        row_ok = rows < R
        horizon = tl.load(horizon_ptr + b * stride_hb + (rows % T) * stride_ht, mask=row_ok, other=-1)
        keys_at = split * BLOCK_S + tl.arange(0, BLOCK_S)
        slot = bh * tl.num_programs(1) + split
        out_rows = partial_ptr + (slot * R + rows[:, None]) * D + dims[None, :]
        if split * BLOCK_S > tl.max(horizon, axis=0):  # no row sees these keys yet (nor are new ones here)
            tl.store(peak_ptr + slot * R + rows, tl.full([BLOCK_R], float("-inf"), tl.float32), mask=row_ok)
            tl.store(total_ptr + slot * R + rows, tl.zeros([BLOCK_R], tl.float32), mask=row_ok)
            tl.store(out_rows, tl.zeros([BLOCK_R, D], tl.float32), mask=row_ok[:, None])
        else:
            q_at = q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qr + dims[None, :]
            q = tl.load(q_at, mask=row_ok[:, None], other=0.0)
            key_ok = keys_at < S
            step = keys_at - tl.load(where_ptr + b * stride_wb)  # which new token a position holds
            new = key_ok & (step >= 0) & (step < T)
            cached = key_ok & ~new
            k_at = k_ptr + b * stride_kb + h * stride_kh + keys_at[:, None] * stride_ks + dims[None, :]
            new_k_at = (
                new_k_ptr + b * stride_nkb + h * stride_nkh + step[:, None] * stride_nkt + dims[None, :]
            )
            k = _cached_run(k_at, new_k_at, new, cached)
            scores = tl.dot(q, tl.trans(k)) * scale
            visible = (keys_at[None, :] <= horizon[:, None]) & key_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            peak = tl.max(scores, axis=1)
            safe_peak = tl.where(peak == float("-inf"), 0.0, peak)
            weights = tl.exp(scores - safe_peak[:, None])
            v_at = v_ptr + b * stride_vb + h * stride_vh + keys_at[:, None] * stride_vs + dims[None, :]
            new_v_at = (
                new_v_ptr + b * stride_nvb + h * stride_nvh + step[:, None] * stride_nvt + dims[None, :]
            )
            v = _cached_run(v_at, new_v_at, new, cached)
            acc = tl.dot(weights.to(v.dtype), v)
            tl.store(peak_ptr + slot * R + rows, peak, mask=row_ok)
            tl.store(total_ptr + slot * R + rows, tl.sum(weights, axis=1), mask=row_ok)
            tl.store(out_rows, acc, mask=row_ok[:, None])

    @triton.jit
    def _cached_run(cache_at, new_at, new, cached):
        """A run of keys (or values) from the cache, the new ones from new_at, written to the cache."""
        fresh = tl.load(new_at, mask=new[:, None], other=0.0)
        tl.store(cache_at, fresh, mask=new[:, None])
        return tl.where(new[:, None], fresh, tl.load(cache_at, mask=cached[:, None], other=0.0))

    @triton.jit
    def _attention_combine(
        partial_ptr, peak_ptr, total_ptr, out_ptr, HKV, R, SPLITS, stride_ob, stride_oh, stride_or,
        D: tl.constexpr,
    ):  # fmt: skip
        """One query row of one (row of the batch, kv head): its splits rescaled to their common max
        and summed."""
        bh, row = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, D)
        slots = bh * SPLITS * R + row  # + split * R
        peak = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for split in range(0, SPLITS):
            at = slots + split * R
            part_peak = tl.load(peak_ptr + at + tl.zeros([1], tl.int32))
            new_peak = tl.maximum(peak, part_peak)
            safe = tl.where(new_peak == float("-inf"), 0.0, new_peak)
            old_scale, part_scale = tl.exp(peak - safe), tl.exp(part_peak - safe)
            total = total * old_scale + tl.load(total_ptr + at + tl.zeros([1], tl.int32)) * part_scale
            acc = acc * old_scale + tl.load(partial_ptr + at * D + dims) * part_scale
            peak = new_peak
        b, h = bh // HKV, bh % HKV
        out_at = out_ptr + b * stride_ob + h * stride_oh + row * stride_or + dims
        tl.store(out_at, (acc / total).to(out_ptr.dtype.element_ty))
