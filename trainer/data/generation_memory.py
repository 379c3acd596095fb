"""How many conversations `data regenerate` generates at once: as many as free memory holds, from
one sequence's cost: attention K/V, recurrent states (hybrids), prefill intermediates and logits."""

from __future__ import annotations

from trainer.target_family import LINEAR_ATTENTION, text_config

CPU_BATCH = 8  # no memory query on the CPU: a batch that keeps generation responsive there
MAX_BATCH = 1024
FREE_SHARE = 0.85  # of the free memory: allocator fragmentation and what generate allocates besides
FP32 = 4


def _layer_counts(config) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    linear = sum(1 for t in types if t == LINEAR_ATTENTION)
    return len(types) - linear, linear


def kv_bytes_per_position(config, dtype_bytes: int) -> int:
    """K + V of every full-attention layer for one position of one sequence."""
    config = text_config(config)
    full, _ = _layer_counts(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return full * 2 * kv_heads * head_dim * dtype_bytes


def state_bytes(config, dtype_bytes: int) -> int:
    """The conv and delta-rule states of every linear-attention layer, one sequence (0 if dense)."""
    config = text_config(config)
    _, linear = _layer_counts(config)
    if not linear:
        return 0
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim * dtype_bytes
    recurrent = (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * FP32
    )
    return linear * (conv + recurrent)


def sequence_bytes(config, positions: int, prompt: int, dtype_bytes: int) -> int:
    """What one sequence of `positions` tokens, `prompt` of them prefilled at once, costs to generate."""
    config = text_config(config)
    working = (3 * config.intermediate_size + 4 * config.hidden_size) * dtype_bytes
    logits = 3 * config.vocab_size * FP32
    cache = positions * kv_bytes_per_position(config, dtype_bytes) + state_bytes(config, dtype_bytes)
    return cache + prompt * working + logits


def batch_that_fits(config, positions: int, prompt: int, free_bytes: int, dtype_bytes: int) -> int:
    """Sequences of this shape that fit in FREE_SHARE of `free_bytes` (1 .. MAX_BATCH)."""
    each = sequence_bytes(config, positions, prompt, dtype_bytes)
    return max(1, min(MAX_BATCH, int(free_bytes * FREE_SHARE) // each))


def split_by_memory(
    lengths: list[int], new_tokens: int, config, free_bytes: int, dtype_bytes: int
) -> list[slice]:
    """Consecutive batches of prompts (left-padded to their longest) that each fit in free memory."""
    batches, begin, width = [], 0, 0
    for i, length in enumerate(lengths):
        wider = max(width, length)
        fits = batch_that_fits(config, wider + new_tokens, wider, free_bytes, dtype_bytes)
        if i > begin and i - begin + 1 > fits:
            batches.append(slice(begin, i))
            begin, wider = i, length
        width = wider
    if begin < len(lengths):
        batches.append(slice(begin, len(lengths)))
    return batches
