"""Block speculative decoding with a DFlash drafter, and the target-only decoding it must equal.

One sequence at a time. After a prefill (the first new token is the target's own), each round: the
drafter runs ONE forward over [last token, MASK x (B-1)] against its cached context and proposes
B-1 tokens; the target runs ONE forward over [last token, proposals]; the longest prefix where the
proposals equal the target's tokens is accepted, plus the target's next token. The target cache keeps
the accepted length (a recurrent state cannot be cropped: it is restored and advanced again), and the
accepted positions' features extend the drafter's context. At temperature 0 the output is exactly
the target's greedy output; above it, every emitted token is a target sample given the right prefix.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from trainer.data import kv_cache
from trainer.hf_modeling.modeling_dflash import finish, pick, target_features
from trainer.infer.drafter_cache import DrafterContext


@dataclasses.dataclass
class Decoded:
    tokens: list[int]  # new tokens after the prompt (a stop token, when hit, is the last one)
    seconds: float
    accepted: list[int] = dataclasses.field(default_factory=list)  # per round: drafts accepted (0..B-1)


def _clock(device) -> float:
    """Now, once `device` has finished its queued work (so a decode's time is its own)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _start(model, stop_ids):
    """(the target's device, `stop_ids` as a set, the start time, a new KV cache)."""
    device = model.get_input_embeddings().weight.device
    return device, set(stop_ids), _clock(device), kv_cache.new_cache(model)


@torch.no_grad()
def target_generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids=(),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target alone, one token per forward with its KV cache (the baseline and the reference)."""
    device, stop_ids, t0, cache = _start(model, stop_ids)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = kv_cache.forward(model, ids, cache).logits[0, -1:]
        token = int(pick(logits, temperature, generator=generator)[0])
        tokens.append(token)
        if token in stop_ids:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
    return Decoded(tokens=tokens, seconds=_clock(device) - t0)


@torch.no_grad()
def speculative_generate(
    model,
    layer_ids,
    drafter,
    prompt: list[int],
    max_new_tokens: int,
    stop_ids=(),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Decoded:
    """DFlash block speculative decoding of `prompt` on the HF target `model` (see the module docstring)."""
    device, stop_ids, t0, cache = _start(model, stop_ids)
    context = DrafterContext(drafter)
    out = kv_cache.forward(model, torch.tensor([prompt], dtype=torch.long, device=device), cache, hidden=True)
    tokens = [int(pick(out.logits[0, -1:], temperature, generator=generator)[0])]
    context.extend(target_features(out.hidden_states, layer_ids)[0])
    start = len(prompt)  # position of the last accepted token (the next block's anchor)
    accepted: list[int] = []
    stopped = tokens[-1] in stop_ids
    while len(tokens) < max_new_tokens and not stopped:
        # row k of the block predicts position start+k; row 0 is the anchor itself
        proposals = context.draft_logits(tokens[-1])[1:].argmax(dim=-1)
        verify = torch.cat([torch.tensor([tokens[-1]], device=device), proposals.to(device)]).unsqueeze(0)
        saved = kv_cache.checkpoint(cache)  # a hybrid target's recurrent states before the pass
        out = kv_cache.forward(model, verify, cache, hidden=True)
        target_tokens = pick(out.logits[0], temperature, generator=generator).tolist()  # for start+1..start+B
        agree = [d == t for d, t in zip(proposals.tolist(), target_tokens, strict=False)] + [False]
        n = agree.index(False)  # drafts accepted: those before the first that differs
        accepted.append(n)
        tokens += target_tokens[: n + 1]  # n accepted drafts (equal to the target's) + the bonus
        stopped = bool(stop_ids.intersection(target_tokens[: n + 1]))  # a stop token anywhere ends it
        kv_cache.keep(model, cache, verify, start, n + 1, saved)
        context.extend(target_features(out.hidden_states, layer_ids)[0, : n + 1])
        start += n + 1
    seconds = _clock(device) - t0
    return Decoded(tokens=finish(tokens, max_new_tokens, stop_ids), seconds=seconds, accepted=accepted)
