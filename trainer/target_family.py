"""Which target architectures the trainer supports, and how to read their language model's config.

Two families: dense (Llama/Qwen layout, every layer full attention) and hybrid (Qwen3.5/3.6: Gated
DeltaNet linear-attention layers, a recurrent state + a causal-conv state each, interleaved with a
gated full-attention layer every `full_attention_interval`-th layer, `config.layer_types`). The
multimodal checkpoints keep the language model's settings in `config.text_config`.
"""

from __future__ import annotations

from trainer.config import ConfigError

DENSE_TYPES = ("qwen3", "qwen2", "llama", "mistral")
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LINEAR_ATTENTION = "linear_attention"


def text_config(config):
    """The language model's config (a multimodal wrapper's `text_config`, else the config itself)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def is_hybrid(config) -> bool:
    return LINEAR_ATTENTION in (getattr(text_config(config), "layer_types", None) or [])


def check_supported(config) -> None:
    """One line naming the model_type and the supported ones, for an architecture not supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in DENSE_TYPES + HYBRID_TYPES:
        return
    raise ConfigError(
        f"target.spec: model_type {model_type!r} is not supported. "
        f"Fix: use a dense ({', '.join(DENSE_TYPES)}) or a Qwen3.5/3.6 hybrid "
        f"({', '.join(t for t in HYBRID_TYPES if not t.endswith('_text'))}) target"
    )
