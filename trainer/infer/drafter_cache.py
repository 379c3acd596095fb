"""The drafter at inference: the projected context's keys/values cached once, one block per call.

Re-projecting the growing context every round would cost O(length) per round, so `DrafterContext`
keeps each layer's context keys (RoPE at their true positions) and values, and `draft` runs the
block [anchor, MASK...] after them unmasked (what the training mask reproduces). It reuses the
drafter's own submodules; a test checks it against the training forward.
"""

from __future__ import annotations

from typing import Iterable, cast

import torch
import torch.nn.functional as F

from trainer.model import DFlashDrafter, DrafterLayer, apply_rope, rope_cos_sin


class DrafterContext:
    """Per-layer cached context keys/values of one sequence (batch 1)."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        cfg, weight = drafter.cfg, drafter.fc.weight
        empty = torch.empty(1, cfg.num_kv_heads, 0, cfg.head_dim, device=weight.device, dtype=weight.dtype)
        self.keys = [empty] * len(drafter.layers)
        self.values = [empty] * len(drafter.layers)
        self.length = 0  # context positions cached: 0..length-1

    def _rope(self, start: int, count: int, dtype, device):
        positions = torch.arange(start, start + count, device=device).unsqueeze(0)
        return rope_cos_sin(positions, self.drafter.cfg.head_dim, self.drafter.cfg.rope_theta, dtype)

    def _with_context(self, i: int, attn, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's cached keys/values followed by those of x [1, T, hidden] (RoPE from cos/sin)."""
        cfg, count = self.drafter.cfg, x.shape[1]
        k = attn.k_norm(attn.k_proj(x).view(1, count, cfg.num_kv_heads, cfg.head_dim))
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(1, count, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)

    @torch.no_grad()
    def extend(self, features: torch.Tensor) -> None:
        """Append the target features [T, K*H] of the next T positions."""
        d, count = self.drafter, features.shape[0]
        if count == 0:
            return
        dtype = d.fc.weight.dtype
        ctx = d.hidden_norm(d.fc(features.to(device=d.fc.weight.device, dtype=dtype))).unsqueeze(0)
        cos, sin = self._rope(self.length, count, dtype, ctx.device)
        for i, layer in enumerate(cast("Iterable[DrafterLayer]", d.layers)):
            self.keys[i], self.values[i] = self._with_context(i, layer.self_attn, ctx, cos, sin)
        self.length += count

    @torch.no_grad()
    def draft_logits(self, anchor_token: int) -> torch.Tensor:
        """[B, V] logits of the block [anchor, MASK x (B-1)] placed right after the cached context (the
        anchor at position `length`): row k predicts position length+k."""
        d, cfg = self.drafter, self.drafter.cfg
        block, dtype, device = cfg.block_size, d.fc.weight.dtype, d.fc.weight.device
        ids = torch.full((1, block), cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = int(anchor_token)
        x = F.embedding(ids, d.embed_weight).to(dtype)
        cos, sin = self._rope(self.length, block, dtype, device)
        for i, layer in enumerate(cast("Iterable[DrafterLayer]", d.layers)):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(1, block, cfg.num_heads, cfg.head_dim))
            q = apply_rope(q.transpose(1, 2), cos, sin)
            k, v = self._with_context(i, attn, h, cos, sin)
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, block, cfg.num_heads * cfg.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.logits(d.norm(x)[0])
