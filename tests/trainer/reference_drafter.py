"""An inference-side DFlash drafter over an export directory: the float64 oracle of test_export.

`ReferenceDrafter` is deliberately written apart from trainer.model (plain tensors and loops, no
nn.Module, float64): it computes a block's logits the way an inference engine does after a verify
step: the cache holds the target features of every position before the anchor, the block is
[anchor, MASK...] at the next positions, and nothing is masked. If trainer logits for a training
block equal these, the export, the positions and the training mask all match inference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.infer.export import ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE


class ReferenceDrafter:
    """Inference-side DFlash drafter over an export directory, in float64, one block at a time."""

    def __init__(self, export_dir, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        export_dir = Path(export_dir)
        self.config = json.loads((export_dir / CONFIG_FILE).read_text())
        if self.config.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"{export_dir}: architectures is {self.config.get('architectures')}, "
                             f"expected [{ARCHITECTURE!r}]")
        self.w = {k: v.double() for k, v in load_file(str(export_dir / WEIGHTS_FILE)).items()}
        c = self.config
        self.num_layers = c["num_hidden_layers"]
        self.n_q, self.n_kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps = c["rms_norm_eps"]
        self.theta = c["rope_parameters"]["rope_theta"] if "rope_parameters" in c else c["rope_theta"]
        self.block_size = c["block_size"]
        self.mask_token_id = c["dflash_config"]["mask_token_id"]
        self.embed = embed_weight.detach().double().cpu()
        self.lm_head = lm_head_weight.detach().double().cpu()
        self._check_names()

    def _check_names(self):
        expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                               "q_norm", "k_norm")}
            expected |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
        if set(self.w) != expected:
            raise ValueError(f"export weights differ from the DFlash layout: missing "
                             f"{sorted(expected - set(self.w))}, unexpected {sorted(set(self.w) - expected)}")

    def _rms(self, x, name):
        return self.w[name] * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + self.eps))

    def _rotate(self, x, positions):
        # x [heads, L, d]; pairs (i, i + d/2) rotate by position * theta^(-2i/d)
        half = self.d // 2
        freq = torch.tensor([self.theta ** (-2.0 * i / self.d) for i in range(half)], dtype=torch.float64)
        angle = torch.tensor(positions, dtype=torch.float64)[:, None] * freq[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _attention(self, i, block, ctx, positions_q, positions_kv):
        p = f"layers.{i}.self_attn."
        both = torch.cat([ctx, block], dim=0)
        q = (block @ self.w[p + "q_proj.weight"].T).view(-1, self.n_q, self.d).transpose(0, 1)
        k = (both @ self.w[p + "k_proj.weight"].T).view(-1, self.n_kv, self.d).transpose(0, 1)
        v = (both @ self.w[p + "v_proj.weight"].T).view(-1, self.n_kv, self.d).transpose(0, 1)
        q = self._rotate(self._rms(q, p + "q_norm.weight"), positions_q)
        k = self._rotate(self._rms(k, p + "k_norm.weight"), positions_kv)
        heads = []
        group = self.n_q // self.n_kv
        for h in range(self.n_q):
            scores = q[h] @ k[h // group].T / math.sqrt(self.d)  # no mask: inference sees it all
            heads.append(torch.softmax(scores, dim=-1) @ v[h // group])
        out = torch.cat(heads, dim=-1)
        return out @ self.w[p + "o_proj.weight"].T

    def block_logits(self, context_features: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """[block_size, V] logits for the block after a cache of len(context_features) positions.

        context_features: [T, K*H] target features of positions 0..T-1; the anchor sits at T.
        """
        ctx_len = context_features.shape[0]
        ctx = self._rms(context_features.double().cpu() @ self.w["fc.weight"].T, "hidden_norm.weight")
        tokens = [int(anchor_token)] + [self.mask_token_id] * (self.block_size - 1)
        x = self.embed[tokens]
        positions_q = list(range(ctx_len, ctx_len + self.block_size))
        positions_kv = list(range(ctx_len)) + positions_q
        for i in range(self.num_layers):
            p = f"layers.{i}."
            x = x + self._attention(i, self._rms(x, p + "input_layernorm.weight"), ctx,
                                    positions_q, positions_kv)
            h = self._rms(x, p + "post_attention_layernorm.weight")
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return self._rms(x, "norm.weight") @ self.lm_head.T
