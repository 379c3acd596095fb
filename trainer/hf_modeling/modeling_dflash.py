"""DFlash drafter for Transformers: a few Qwen3-style layers conditioned on target hidden states.

    target_hidden [B, T, K*H] --fc--> hidden_norm --> ctx [B, T, H]  (the target's features)
    noise_embedding [B, L, H]: the target's embedding of the block [anchor, MASK x (L-1)]
    each layer: queries from the block only; keys/values from [ctx ; block], k_norm on both;
                RoPE over true positions (context first, then the block)
    final norm --> hidden [B, L, H]; logits = the target's lm_head(hidden)

No embedding and no lm_head: the target's are used. At inference the block sees the whole
context and the whole block (attention_mask None); a mask may be given for other uses.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_dflash import DFlashConfig


class DFlashRMSNorm(nn.Module):
    """Normalise in fp32, scale in the input dtype (Qwen3)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_parameters(config):
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params.get("rope_type", params.get("type", "default")), float(theta)


def _inv_freq(config, head_dim, device):
    rope_type, theta = _rope_parameters(config)
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # scaled RoPE variants

    return ROPE_INIT_FUNCTIONS[rope_type](config, device)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask):
        batch, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(kv_in).view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos[:, :, -q_len:] + _rotate_half(q) * sin[:, :, -q_len:]  # queries: the block positions
        k = k * cos + _rotate_half(k) * sin
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, ctx, cos, sin, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.dflash_config["target_layer_ids"]) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.post_init()

    def forward(self, target_hidden, noise_embedding, position_ids=None, attention_mask=None, **kwargs):
        """Hidden states [B, L, H] of the block (apply the target's lm_head for logits).

        target_hidden: [B, T, K*H] target features of the context positions;
        noise_embedding: [B, L, H] target embedding of [anchor, MASK x (L-1)];
        position_ids: [B, T+L] positions of the context, then of the block (default 0..T+L-1);
        attention_mask: None (the block sees everything) or [B, 1, L, T+L], bool or additive.
        """
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        batch, ctx_len, block_len = x.shape[0], ctx.shape[1], x.shape[1]
        if position_ids is None:
            position_ids = torch.arange(ctx_len + block_len, device=x.device).expand(batch, -1)
        head_dim = self.layers[0].self_attn.head_dim
        inv_freq, scaling = _inv_freq(self.config, head_dim, x.device)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq.float()
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        cos, sin = (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask)
        return self.norm(x)
