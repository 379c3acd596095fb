"""The target's embedding and lm_head alone: all a drafter needs when the features come from a cache
(a model directory's decoder layers are never loaded)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.data.target import (
    MODEL_DIR_ERRORS,
    check_layer_ids,
    default_layer_ids,
    default_mask_token_id,
    hf_config,
    model_dir_error,
    tokenizer_of,
    is_tiny,
    tiny_target,
)
from trainer.target_family import text_config


@dataclass(eq=False)
class TargetHead:
    config: object  # the HF config
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    layer_ids: list[int]
    tokenizer: object | None
    mask_token_id: int
    device: str = "cpu"

    def __post_init__(self):
        self.num_layers = int(self.config.num_hidden_layers)
        self.vocab_size, self.hidden_size = self.embed_tokens.weight.shape
        self.dtype = self.embed_tokens.weight.dtype
        check_layer_ids(self.layer_ids, self.num_layers)


def weight_bytes(config, bytes_per_param: int = 2) -> dict:
    """Bytes of the whole target and of embedding + lm_head alone (counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights are one parameter here
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    kept = embed.numel() + (0 if head is embed else head.numel())
    return {
        "total": total * bytes_per_param,
        "embed_and_lm_head": kept * bytes_per_param,
        "saved": (total - kept) * bytes_per_param,
    }


def _weight_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index or the single model file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise ConfigError(
        f"target.spec: {path!r} has no model.safetensors(.index.json). "
        f"Fix: a feature-cache run reads the embedding and lm_head from safetensors weights"
    )


def _read_tensor(files: dict[str, str], suffix: str):
    from safetensors import safe_open

    name = next((k for k in files if k == suffix or k.endswith("." + suffix)), None)
    if name is None:
        return None
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)


def _hf_head(path: str, dtype):
    if not os.path.isdir(path):
        raise ConfigError(
            f"target.spec: {path!r} is neither a tiny-random spec nor a local directory. "
            f"Fix: point it at a downloaded Hugging Face model directory"
        )
    config = text_config(hf_config(path))
    try:
        files = _weight_files(path)
        embed_w, head_w = _read_tensor(files, "embed_tokens.weight"), _read_tensor(files, "lm_head.weight")
    except MODEL_DIR_ERRORS as exc:
        fix = "check that its safetensors weights (and their index) are complete"
        raise model_dir_error(path, "read the embedding and lm_head from", exc, fix) from exc
    if embed_w is None:
        raise ConfigError(f"target.spec: no *embed_tokens.weight tensor in {path!r}")
    embed = nn.Embedding.from_pretrained(embed_w.to(dtype), freeze=True)
    weight = embed.weight if head_w is None else nn.Parameter(head_w.to(dtype))  # None: tied embeddings
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight
    return config, embed, head, tokenizer_of(path)


def load_target_head(
    spec: str,
    dtype,
    layer_ids: list[int] | None = None,
    seed: int = 0,
    tiny: dict | None = None,
    device: str = "cpu",
) -> TargetHead:
    """A tiny spec built whole on `device` (where `cache-features` built it: the same seeded weights);
    only its embedding and lm_head are kept, on the CPU."""
    if is_tiny(spec):
        model = tiny_target(device, dtype, seed, tiny, spec)
        config, tokenizer = model.config, None
        embed, head = model.get_input_embeddings().cpu(), model.get_output_embeddings().cpu()
        del model
    else:
        config, embed, head, tokenizer = _hf_head(spec, dtype)
    embed.requires_grad_(False)
    head.requires_grad_(False)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(int(config.num_hidden_layers))
    return TargetHead(
        config=config,
        embed_tokens=embed,
        lm_head=head,
        layer_ids=ids,
        tokenizer=tokenizer,
        mask_token_id=default_mask_token_id(tokenizer, embed.weight.shape[0]),
    )
