"""Rolling a target's cache back after a verify pass, for a dense and a hybrid (Gated DeltaNet) target:
keeping k of the drafted tokens leaves the cache exactly as if only those k had been fed."""

from __future__ import annotations

import pytest
import torch

from trainer.data import kv_cache
from trainer.data.target import load_target

PROMPT = [5, 17, 3, 9, 22, 41, 8]
DRAFT = [12, 30, 2, 7]


@pytest.fixture(scope="module", params=["tiny-random", "tiny-random-hybrid"])
def model(request):
    torch.manual_seed(0)
    return load_target(request.param, "cpu", torch.float32, seed=0).model.eval()


def _next_logits(model, cache, token: int) -> torch.Tensor:
    return kv_cache.forward(model, torch.tensor([[token]]), cache).logits[0, -1]


@pytest.mark.parametrize("kept", [0, 1, 3, len(DRAFT)])
@torch.no_grad()
def test_keeping_k_drafted_tokens_equals_feeding_only_those(model, kept):
    cache = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT]), cache)
    saved = kv_cache.checkpoint(cache)
    hybrid = saved is not None
    assert hybrid == any(hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", []))
    kv_cache.forward(model, torch.tensor([DRAFT]), cache)  # the verify pass over every drafted token
    kv_cache.keep(model, cache, torch.tensor([DRAFT]), len(PROMPT), kept, saved)
    assert cache.get_seq_length() == len(PROMPT) + kept

    fresh = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT + DRAFT[:kept]]), fresh)
    assert torch.allclose(_next_logits(model, cache, 11), _next_logits(model, fresh, 11), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_recurrent_state_is_not_rolled_back_by_cropping_alone(model):
    """Why `keep` rewinds and feeds again: a crop would leave the rejected tokens in a recurrent state."""
    cache = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT]), cache)
    if kv_cache.checkpoint(cache) is None:
        pytest.skip("a dense target has no recurrent state")
    kv_cache.forward(model, torch.tensor([DRAFT]), cache)
    for layer in cache.layers:
        if not hasattr(layer, "recurrent_states"):
            layer.crop(-(len(DRAFT) - 1))
    fresh = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT + DRAFT[:1]]), fresh)
    assert not torch.allclose(_next_logits(model, cache, 11), _next_logits(model, fresh, 11), atol=1e-5)
