"""The target's forward with an HF KV cache, the same way in every transformers version the trainer
supports: the cache argument's name changed (`past_key_values` -> `cache`), DynamicCache did not."""

from __future__ import annotations

import functools
import inspect

import torch


def new_cache():
    from transformers import DynamicCache

    return DynamicCache()


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type[torch.nn.Module]) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward(model: torch.nn.Module, ids: torch.Tensor, cache, hidden: bool = False):
    """The model's forward over `ids` [B, T], appending to `cache`."""
    # mypy does not see a class as Hashable, as lru_cache's arguments must be (python/mypy#11470)
    argument = _cache_argument(type(model))  # type: ignore[arg-type]
    return model(input_ids=ids, use_cache=True, output_hidden_states=hidden, **{argument: cache})


def crop(cache, length: int) -> None:
    """Keep the first `length` positions (a negative crop removes tokens in every transformers
    version that has DynamicCache.crop)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
