"""The DFlash drafter: a few Qwen3-style decoder layers conditioned on target hidden states.

Queries come from the blocks [anchor, MASK x (block-1)], keys/values from [target features ; blocks],
RoPE over true positions. The target's frozen embedding and lm_head stay out of state_dict, so it
holds exactly the weights inference engines load (trainer.infer.export).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer import compile_modes
from trainer.block_size import DEFAULT_BLOCK_SIZE, block_size_problem
from trainer.config import ATTENTION_BACKENDS

# training builds its layers from the export's own classes, so the served drafter computes what was trained
from trainer.hf_modeling.modeling_dflash import DFlashAttention, DFlashDecoderLayer
from trainer.hf_modeling.modeling_dflash import DFlashRMSNorm as RMSNorm
from trainer.hf_modeling.modeling_dflash import apply_rope as apply_rope  # trainer.infer.static_decode's
from trainer.precision import attention_inputs
from trainer.target_family import is_hybrid

# An attention the trainer does not offer, (q, k, v, attn_mask) -> out, as `attend` calls it (benchmarks)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# export-only DrafterConfig fields: restore does not compare them when a checkpoint lacks them
EXPORT_METADATA = ("max_position_embeddings", "rope_scaling")
POSITIVE_DIMS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "num_layers")


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    block_size: int = DEFAULT_BLOCK_SIZE
    num_target_layers: int | None = None  # written to the export: inference engines read it
    # the target's context length and RoPE scaling, copied into the export (EXPORT_METADATA)
    max_position_embeddings: int | None = None
    rope_scaling: dict | None = None

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        problems = []
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty: list the target layers to read, e.g. [1, 9, 17]")
        if self.num_heads % max(self.num_kv_heads, 1) != 0:
            problems.append(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if block_problem := block_size_problem(self.block_size):
            problems.append(f"block_size {block_problem}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        problems += [
            f"{name}={getattr(self, name)} must be >= 1" for name in POSITIVE_DIMS if getattr(self, name) < 1
        ]
        if problems:
            raise ValueError("bad drafter config: " + "; ".join(problems))

    @property
    def num_attention_heads(self) -> int:  # the export's (Qwen3) name, as its layer classes read it
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def context_size(self) -> int:
        """Width of the concatenated target features: K * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def for_target(cls, target, **overrides) -> "DrafterConfig":
        """Drafter dims copied from a TargetModel (the paper's choice); hidden/vocab size must match it."""
        hf = target.config
        values = {
            "hidden_size": target.hidden_size,
            "intermediate_size": hf.intermediate_size,
            **_attention_dims(hf, target.hidden_size),
            "vocab_size": target.vocab_size,
            "mask_token_id": target.mask_token_id,
            "target_layer_ids": list(target.layer_ids),
            "rms_norm_eps": getattr(hf, "rms_norm_eps", 1e-6),
            "rope_theta": _rope_theta_of(hf),
            "num_target_layers": target.num_layers,
            "max_position_embeddings": getattr(hf, "max_position_embeddings", None),
            "rope_scaling": _rope_scaling_of(hf),
        }
        return cls(**(values | overrides))


def _attention_dims(hf_config, hidden_size: int) -> dict:
    """The target's attention shape; for a hybrid target, that of its published drafters (plain Qwen3
    layers: head_dim 128, 32 heads, 8 KV heads at 27B), scaled down for smaller targets."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if is_hybrid(hf_config):
        head_dim = min(128, head_dim)
        heads = max(1, min(32, hidden_size // head_dim))
        kv_heads = max(1, heads // 4)
    return {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim}


def _rope_theta_of(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(hf_config, "rope_theta", 1e6))


def _rope_scaling_of(hf_config) -> dict | None:
    """The target's RoPE scaling (rope_type and its parameters, without rope_theta); None if plain."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(params, dict) or params.get("rope_type", params.get("type", "default")) == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, L, head_dim] for integer positions [B, L] (HF Qwen3 layout)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    freqs = positions.float().unsqueeze(-1) * (1.0 / theta**exponents)
    angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


_compiled_flex = None
_compiled_flex_init = threading.Lock()


def compiled_flex_attention():
    """The ONE compiled flex_attention of the process, made lazily: after the startup compile-lock patch."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        options = compile_modes.compile_options()
        with _compiled_flex_init:
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention, **options)
    return _compiled_flex


def use_compiled_flex_attention(compiled) -> None:
    """Install `compiled` as the process's flex_attention before first use (a race harness's cheaper one)."""
    global _compiled_flex
    with _compiled_flex_init:
        _compiled_flex = compiled


def attend(q, k, v, attn_mask, backend: str | AttentionFn) -> torch.Tensor:
    """Masked GQA attention. q [B, Hq, L, D]; k, v [B, Hkv, S, D]; backend: a name or an AttentionFn."""
    q, k, v = attention_inputs(q, k, v)
    if backend == "flex":
        if torch.compiler.is_compiling():  # inside a compiled layer: inductor compiles flex with it
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)
        return compiled_flex_attention()(q, k, v, block_mask=attn_mask, enable_gqa=True)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    if callable(backend):
        return backend(q, k, v, attn_mask)
    raise ValueError(f"attention backend {backend!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}")


class DrafterAttention(DFlashAttention):
    """The export's attention weights, with the training forward (many blocks, a mask, a backend)."""

    def forward(self, x, ctx, rope_q, rope_k, attn_mask, backend):
        # One projection over [context ; block] instead of two smaller matmuls.
        k, v = self.context_kv(torch.cat([ctx, x], dim=1), *rope_k)
        out = attend(self.query(x, *rope_q), k, v, attn_mask, backend)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DrafterLayer(DFlashDecoderLayer):
    attention_class = DrafterAttention  # its forward takes ctx, rope_q, rope_k, attn_mask, backend


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.cfg = cfg
        for name, frozen in (("embedding", embed_tokens), ("lm_head", lm_head)):
            if frozen.weight.shape != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"target {name} is {tuple(frozen.weight.shape)}, drafter config wants "
                    f"({cfg.vocab_size}, {cfg.hidden_size}): build the config from the same target"
                )
        self.fc = nn.Linear(cfg.context_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Plain (detached) tensors, not Parameters or buffers: frozen, and absent from state_dict.
        self.embed_weight = embed_tokens.weight.detach()
        self.lm_head_weight = lm_head.weight.detach()
        self.lm_head_bias = None if lm_head.bias is None else lm_head.bias.detach()
        self.checkpoint_layers = False  # trainer.activation_checkpoint
        # "auto": layers compiled for flex on CUDA; loss kernel from trainer.loss.LOSS_KERNELS
        self.compile_layers: bool | str = "auto"
        self.loss_kernel = "auto"
        self._layers_compiled = False
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda() move the frozen target weights too; fn returns new tensors, the target's stay
        super()._apply(fn, recurse)
        tied = self.lm_head_weight is self.embed_weight
        self.embed_weight = fn(self.embed_weight)
        self.lm_head_weight = self.embed_weight if tied else fn(self.lm_head_weight)
        if self.lm_head_bias is not None:
            self.lm_head_bias = fn(self.lm_head_bias)
        return self

    def block_token_ids(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[B, N, block]: the anchor token followed by block-1 mask tokens."""
        batch, num_blocks = anchors.shape
        anchor_tokens = input_ids.gather(1, anchors).unsqueeze(-1)
        masks = input_ids.new_full((batch, num_blocks, self.cfg.block_size - 1), self.cfg.mask_token_id)
        return torch.cat([anchor_tokens, masks], dim=-1)

    def forward(self, context, input_ids, anchors, attn_mask, backend: str | AttentionFn = "flex"):
        cfg = self.cfg
        batch, ctx_len, _ = context.shape
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(context.to(dtype)))
        x = F.embedding(self.block_token_ids(input_ids, anchors), self.embed_weight).to(dtype).flatten(1, 2)

        offsets = torch.arange(cfg.block_size, device=anchors.device)
        block_pos = (anchors.unsqueeze(-1) + offsets).view(batch, -1)
        ctx_pos = torch.arange(ctx_len, device=anchors.device).expand(batch, ctx_len)
        cos, sin = self.rope(torch.cat([ctx_pos, block_pos], dim=1))
        rope_q, rope_k = (cos[:, :, ctx_len:], sin[:, :, ctx_len:]), (cos, sin)  # queries: the blocks

        from trainer.activation_checkpoint import run_layer

        self._compile_layers_if_wanted(backend, x.device)
        for layer in self.layers:
            x = run_layer(
                layer, x, ctx, rope_q, rope_k, attn_mask, backend, checkpointed=self.checkpoint_layers
            )
        return self.norm(x)

    def rope(self, position_ids: torch.Tensor):
        """cos, sin [B, 1, N, head_dim] for positions [B, N], in the weights' dtype (as the export's)."""
        return rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.fc.weight.dtype)

    def _compile_layers_if_wanted(self, backend, device: torch.device) -> None:
        """Compile each layer in place (state_dict unchanged) at the first forward, after the compile-lock
        patch; all layers share one graph, so it costs one layer's compile."""
        want = self.compile_layers
        if want == "auto":
            want = backend == "flex" and device.type == "cuda"
        if want and not self._layers_compiled:
            options = compile_modes.compile_options()
            for layer in self.layers:
                layer.compile(**options)
            self._layers_compiled = True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits through the frozen target lm_head (tests, evaluation)."""
        return F.linear(hidden, self.lm_head_weight.to(hidden.dtype), self.lm_head_bias)

    def loss(self, hidden, labels, label_mask, gamma: float, chunk_rows: int | None = None):
        """dflash_loss without materialising the full logits (see trainer.loss.dflash_loss_fused)."""
        from trainer.loss import dflash_loss_fused

        return dflash_loss_fused(
            hidden,
            self.lm_head_weight,
            labels,
            label_mask,
            gamma,
            bias=self.lm_head_bias,
            chunk_rows=chunk_rows,
            kernel=self.loss_kernel,
        )
