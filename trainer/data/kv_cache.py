"""The target's forward with an HF cache built from its config, for dense and hybrid targets alike.

A recurrent layer cannot be cropped (its state mixes every token), so rolling back a verify pass
restores its `checkpoint`ed states and feeds the kept tokens again; attention layers just crop.
"""

from __future__ import annotations

import torch

# the export's own cache handling (trainer/hf_modeling), which the reference decoding shares
from trainer.hf_modeling.modeling_dflash import cache_argument, crop, new_cache as new_cache


def forward(model: torch.nn.Module, ids: torch.Tensor, cache, hidden: bool = False):
    """The model's forward over `ids` [B, T], appending to `cache`."""
    return model(input_ids=ids, use_cache=True, output_hidden_states=hidden, **{cache_argument(model): cache})


def _recurrent_layers(cache) -> list:
    """The cache's layers that hold recurrent/conv states (Gated DeltaNet and the like)."""
    return [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "recurrent_states")]


def _states(layer) -> list[tuple[dict, int]]:
    return [
        (states, i)
        for states in (layer.conv_states, layer.recurrent_states)
        for i, tensor in states.items()
        if tensor is not None
    ]


def checkpoint(cache) -> list[torch.Tensor] | None:
    """Copies of every recurrent layer's states, or None when the cache has no recurrent layer."""
    layers = _recurrent_layers(cache)
    if not layers:
        return None
    return [states[i].clone() for layer in layers for states, i in _states(layer)]


def rewind(cache, length: int, saved: list[torch.Tensor] | None) -> None:
    """Back to `length` positions: attention layers crop, recurrent layers restore `checkpoint`."""
    if saved is None:
        crop(cache, length)
        return
    extra = cache.get_seq_length() - length
    recurrent = _recurrent_layers(cache)
    copies = iter(saved)
    for layer in recurrent:
        for states, i in _states(layer):
            states[i].copy_(next(copies))
        # newer transformers count a recurrent layer's tokens on the layer, and positions follow it
        counter = getattr(layer, "cumulative_length_linear", None)
        if counter is not None:
            counter.fill_(length)
    if extra > 0:
        for layer in cache.layers:
            if not any(layer is r for r in recurrent):
                layer.crop(-extra)


def keep(model, cache, ids: torch.Tensor, length: int, kept: int, saved: list[torch.Tensor] | None) -> None:
    """After a pass over `ids` [1, T] from `length` positions, keep its first `kept` tokens."""
    if saved is None:
        rewind(cache, length + kept, None)
    elif kept < ids.shape[1]:
        rewind(cache, length, saved)
        if kept:
            forward(model, ids[:, :kept], cache)
