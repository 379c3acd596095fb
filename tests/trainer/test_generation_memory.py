"""What one generated sequence costs (trainer/data/generation_memory.py), checked against the bytes a
real HF cache holds after a forward, and the batches `split_by_memory` cuts checked as a greedy
partition: in order, every batch fits, and none could have taken the next prompt."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.data import generation_memory as gm
from trainer.data import kv_cache
from trainer.data.target import load_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tiny-random", "tiny-random-hybrid"])
def model(request):
    return load_target(request.param, "cpu", torch.float32, seed=0).model.eval()


def cache_bytes(cache) -> tuple[int, int]:
    """(bytes of attention K/V, bytes of conv + recurrent states) a cache holds."""
    attention = states = 0
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            for kind in (layer.conv_states, layer.recurrent_states):
                states += sum(t.numel() * t.element_size() for t in kind.values() if t is not None)
        else:
            attention += layer.keys.numel() * layer.keys.element_size()
            attention += layer.values.numel() * layer.values.element_size()
    return attention, states


@pytest.mark.parametrize("length", [3, 11])
@torch.no_grad()
def test_the_per_position_and_state_bytes_are_what_the_models_cache_holds(model, length):
    cache = kv_cache.new_cache(model)
    kv_cache.forward(model, torch.arange(1, length + 1).unsqueeze(0), cache)
    attention, states = cache_bytes(cache)
    assert attention == length * gm.kv_bytes_per_position(model.config, 4)
    assert states == gm.state_bytes(model.config, 4)
    assert (states > 0) == any(t == "linear_attention" for t in model.config.layer_types)


def test_a_sequence_costs_more_with_every_position_and_every_prompt_token(model):
    config = model.config
    base = gm.sequence_bytes(config, 40, 20, 2)
    assert gm.sequence_bytes(config, 41, 20, 2) - base == gm.kv_bytes_per_position(config, 2)
    working = gm.sequence_bytes(config, 40, 21, 2) - base
    assert (
        working > 0 and gm.sequence_bytes(config, 90, 31, 2) - gm.sequence_bytes(config, 90, 30, 2) == working
    )
    assert working >= config.intermediate_size * 2, (
        "a prompt token holds at least its MLP row while prefilled"
    )
    assert gm.sequence_bytes(config, 40, 20, 4) > base


def test_a_multimodal_wrapper_is_read_through_its_text_config(model):
    class Wrapper:
        def get_text_config(self, decoder=False):
            assert decoder
            return model.config

    assert gm.kv_bytes_per_position(Wrapper(), 2) == gm.kv_bytes_per_position(model.config, 2)
    assert gm.sequence_bytes(Wrapper(), 30, 9, 2) == gm.sequence_bytes(model.config, 30, 9, 2)


def fits(config, batch: list[int], new_tokens: int, free: int) -> int:
    widest = max(batch)
    return gm.batch_that_fits(config, widest + new_tokens, widest, free, 2)


@pytest.mark.parametrize("seed", range(6))
def test_split_by_memory_is_an_ordered_greedy_partition_of_batches_that_fit(model, seed):
    rng = random.Random(seed)
    config = model.config
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    new_tokens = rng.randint(1, 64)
    each = gm.sequence_bytes(config, 300 + new_tokens, 300, 2)
    free = int(each * rng.uniform(0.5, 12) / gm.FREE_SHARE)
    batches = gm.split_by_memory(lengths, new_tokens, config, free, 2)
    assert [i for s in batches for i in range(s.start, s.stop)] == list(range(len(lengths)))
    for s, after in zip(batches, batches[1:] + [None]):
        batch = lengths[s]
        assert len(batch) == 1 or len(batch) <= fits(config, batch, new_tokens, free)
        if after is not None:
            grown = batch + [lengths[after.start]]
            assert len(grown) > fits(config, grown, new_tokens, free), "the batch could have taken one more"


def test_split_by_memory_edges(model):
    config = model.config
    assert gm.split_by_memory([], 8, config, 1 << 30, 2) == []
    assert gm.split_by_memory([5, 6, 7], 8, config, 0, 2) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    plenty = gm.split_by_memory([5] * (gm.MAX_BATCH + 3), 8, config, 1 << 60, 2)
    assert plenty == [slice(0, gm.MAX_BATCH), slice(gm.MAX_BATCH, gm.MAX_BATCH + 3)]
