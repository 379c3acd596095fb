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


@torch.no_grad()
def test_keep_feeds_again_only_what_a_recurrent_cache_must_relearn(model, monkeypatch):
    fed = []
    real = kv_cache.forward

    def counted(m, ids, cache, hidden=False):
        fed.append(ids.tolist())
        return real(m, ids, cache, hidden)

    monkeypatch.setattr(kv_cache, "forward", counted)
    for kept in (len(DRAFT), 2, 0):
        cache = kv_cache.new_cache(model)
        real(model, torch.tensor([PROMPT]), cache)
        saved = kv_cache.checkpoint(cache)
        real(model, torch.tensor([DRAFT]), cache)
        fed.clear()
        kv_cache.keep(model, cache, torch.tensor([DRAFT]), len(PROMPT), kept, saved)
        again = [[DRAFT[:kept]]] if saved is not None and 0 < kept < len(DRAFT) else []
        assert fed == again, f"kept {kept}: a dense cache only crops; all kept needs nothing"
        assert cache.get_seq_length() == len(PROMPT) + kept


@torch.no_grad()
def test_a_dense_cache_has_no_recurrent_state_to_save_and_crop_cuts_it(model):
    cache = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT]), cache)
    saved = kv_cache.checkpoint(cache)
    if saved is not None:
        live = [states[i] for layer in cache.layers if hasattr(layer, "recurrent_states")
                for states, i in kv_cache._states(layer)]  # fmt: skip
        assert len(live) == len(saved) and all(torch.equal(a, b) for a, b in zip(live, saved))
        live[0].add_(1.0)
        assert not torch.equal(live[0], saved[0]), "checkpoint copies the states, it does not alias them"
        pytest.skip("crop is for dense caches")
    kv_cache.rewind(cache, 3, None)  # a dense cache crops
    assert cache.get_seq_length() == 3
    kv_cache.rewind(cache, 10, None)  # longer than what it holds: nothing to cut
    assert cache.get_seq_length() == 3
    fresh = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.tensor([PROMPT[:3]]), fresh)
    assert torch.allclose(_next_logits(model, cache, 11), _next_logits(model, fresh, 11), atol=1e-5, rtol=1e-5)
