"""Acceptance length tau: decode prompts speculatively and with the target alone, and compare.

For each prompt: the target alone decodes (the reference output and the baseline speed), then
DFlash speculative decoding (trainer.speculative) decodes the same prompt. Reported:
- tau: mean tokens accepted per target forward (accepted drafts + the bonus token), over all rounds;
- acceptance[k-1]: share of rounds whose drafts were accepted at least up to block position k;
- tokens/s of both and the speedup;
- lossless: at temperature 0 the two outputs must be equal token for token. A difference where the
  target's own top-2 logits were within floating-point noise is counted as a tie, not a failure.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch

from .data import DataError, ROLES, jsonl_records
from .speculative import speculative_generate, target_generate, tie_tolerance


@dataclasses.dataclass
class Mismatch:
    prompt_index: int  # among the evaluated prompts (0-based)
    position: int  # 0-based index among the new tokens
    expected: int  # the target's own token
    got: int  # the speculative output's token
    prompt: list[int]


@dataclasses.dataclass
class EvalResult:
    tau: float
    acceptance: list[float]
    rounds: int
    prompts: int
    skipped_too_long: int
    new_tokens: int
    target_tokens_per_s: float | None
    speculative_tokens_per_s: float
    speedup: float | None
    lossless: bool | None  # None: sampled (temperature > 0), nothing to compare
    ties: int
    mismatch: Mismatch | None
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_prompts(path: str, tokenizer=None, vocab_size: int | None = None) -> list[list[int]]:
    """Prompts from JSONL: `{"input_ids": [...]}` (used as is) or `{"messages": [...]}` rendered with
    the target's chat template and a generation prompt (a final assistant turn, the reference
    answer, is left out). Raises DataError naming file:line."""
    prompts = []
    for where, record in jsonl_records(path, "prompts", "pass an existing .jsonl file to --prompts."):
        if isinstance(record, dict) and "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DataError(where, "input_ids must be a non-empty list of integers.")
        elif isinstance(record, dict) and "messages" in record:
            ids = _render_messages(record["messages"], tokenizer, where)
        else:
            raise DataError(where, 'expected {"messages": [...]} or {"input_ids": [...]}.')
        bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise DataError(where, f"token {bad[0]} is outside the target's vocabulary "
                                   f"(0..{vocab_size - 1}). Fix: tokenize with the target's tokenizer.")
        prompts.append(ids)
    if not prompts:
        raise DataError(path, "no prompts. Fix: one JSON object per line.")
    return prompts


def _render_messages(messages, tokenizer, where: str) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(where, "record has messages, but the target has no tokenizer with a chat template. "
                               "Fix: give prompts as {\"input_ids\": [...]}.")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
        raise DataError(where, f"messages must be a non-empty list of {{\"role\": one of {'/'.join(ROLES)}, "
                               f"\"content\": string}}.")
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise DataError(where, "only an assistant turn: nothing to prompt with.")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def stop_token_ids(model, tokenizer=None) -> set[int]:
    """End-of-sequence ids from the tokenizer, the model config and its generation config."""
    found = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            found.add(source)
        elif isinstance(source, (list, tuple)):
            found.update(int(s) for s in source)
    return found


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def fits(prompt: list[int], max_new_tokens: int, block_size: int, limit: int | None) -> bool:
    """A block may reach block_size positions past the last token."""
    return limit is None or len(prompt) + max_new_tokens + block_size <= limit


def evaluate(model, layer_ids, drafter, prompts: list[list[int]], *, max_new_tokens: int,
             temperature: float = 0.0, stop_ids=(), seed: int = 0, reference: dict | None = None,
             progress: Callable[[int, int], None] | None = None, warmup: bool = False) -> EvalResult:
    """Decode every prompt both ways (see the module docstring). `reference` caches the target's
    own greedy outputs by prompt across calls (the target is frozen, so they never change).
    `warmup`: decode a few tokens both ways first, so one-time setup (CUDA context, kernels,
    allocator) is not billed to the first timed prompt."""
    t0 = time.perf_counter()
    block = drafter.cfg.block_size
    limit = max_positions(model)
    usable = [p for p in prompts if fits(p, max_new_tokens, block, limit)]
    dtype = model.get_input_embeddings().weight.dtype
    generator = torch.Generator(device=model.get_input_embeddings().weight.device).manual_seed(seed)
    was_training = drafter.training
    drafter.eval()
    if warmup and usable:
        target_generate(model, usable[0], 4)
        speculative_generate(model, layer_ids, drafter, usable[0], 4)
    accepted, ties, mismatch = [], 0, None
    target_tokens = target_seconds = spec_tokens = spec_seconds = 0.0
    try:
        for index, prompt in enumerate(usable):
            key = (tuple(prompt), max_new_tokens, tuple(sorted(stop_ids)))
            own = reference.get(key) if reference is not None and temperature <= 0 else None
            if own is None:
                own = target_generate(model, prompt, max_new_tokens, stop_ids, temperature, generator)
                target_tokens += len(own.tokens)
                target_seconds += own.seconds
                if reference is not None and temperature <= 0:
                    reference[key] = own
            spec = speculative_generate(model, layer_ids, drafter, prompt, max_new_tokens, stop_ids,
                                        temperature, generator)
            accepted += spec.accepted
            spec_tokens += len(spec.tokens)
            spec_seconds += spec.seconds
            if temperature <= 0 and spec.tokens != own.tokens:
                at = next((i for i, (a, b) in enumerate(zip(own.tokens, spec.tokens)) if a != b),
                          min(len(own.tokens), len(spec.tokens)))
                near_tie = at < len(own.margins) and own.margins[at] <= tie_tolerance(dtype)
                if near_tie:
                    ties += 1
                elif mismatch is None:
                    mismatch = Mismatch(index, at, own.tokens[at] if at < len(own.tokens) else -1,
                                        spec.tokens[at] if at < len(spec.tokens) else -1, prompt)
            if progress is not None:
                progress(index + 1, len(usable))
    finally:
        drafter.train(was_training)
    rounds = len(accepted)
    target_tps = target_tokens / target_seconds if target_seconds > 0 else None
    spec_tps = spec_tokens / spec_seconds if spec_seconds > 0 else 0.0
    return EvalResult(
        tau=sum(n + 1 for n in accepted) / rounds if rounds else math.nan,
        acceptance=[sum(n >= k for n in accepted) / rounds if rounds else math.nan for k in range(1, block)],
        rounds=rounds, prompts=len(usable), skipped_too_long=len(prompts) - len(usable),
        new_tokens=int(spec_tokens), target_tokens_per_s=target_tps, speculative_tokens_per_s=spec_tps,
        speedup=spec_tps / target_tps if target_tps else None,
        lossless=None if temperature > 0 else mismatch is None, ties=ties, mismatch=mismatch,
        seconds=time.perf_counter() - t0)
