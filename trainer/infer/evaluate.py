"""Acceptance length tau: decode prompts speculatively and with the target alone, and compare.

Greedy decoding runs on the static loop (trainer.infer.static_decode), sampling (or
`loop="reference"`) on the HF-eager reference (trainer.infer.speculative). Reported: tau pooled over
all rounds and as the mean of per-prompt means (the public benchmark's convention); acceptance[k-1],
the share of rounds that accepted at least k drafts; tokens/s of both (same loop, device, prompts);
and losslessness: at temperature 0 a differing token is a bug unless the target's fp32 logits call
it a rounding tie (trainer.infer.lossless).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, cast

import torch

from trainer.infer.speculative import speculative_generate, target_generate

LOOPS = ("static", "reference")


@dataclasses.dataclass
class Mismatch:
    prompt_index: int  # among the evaluated prompts (0-based)
    position: int  # 0-based index among the new tokens
    expected: int  # the target's own token (-1: its output had ended)
    got: int  # the speculative output's token (-1: its output had ended)
    prompt: list[int]
    expected_logit: float  # the target's fp32 logits at that position, for both tokens
    got_logit: float
    tie_bound: float  # the gap to the top a floating-point tie could have (trainer.infer.lossless.tie_bound)
    top: int  # the fp32 argmax there, which may be neither token
    top_logit: float


@dataclasses.dataclass
class EvalResult:
    tau: float  # pooled over all rounds
    tau_per_prompt_mean: float  # mean over prompts of each prompt's tau
    tau_per_prompt: dict  # min / median / max of the per-prompt taus
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
    batch: int  # prompts decoded together
    loop: str  # "static+graphs", "static+graphs+compile(+triton)", "static" (eager, CPU) or "reference"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def tau_summary(accepted_per_prompt: list[list[int]]) -> dict:
    """tau pooled over rounds, the mean of per-prompt means, and the per-prompt min/median/max.
    Prompts without a round (the first token ended them) have no tau of their own."""
    pooled = [n for rounds in accepted_per_prompt for n in rounds]
    per_prompt = [sum(n + 1 for n in rounds) / len(rounds) for rounds in accepted_per_prompt if rounds]
    nan = math.nan
    return {
        "tau": sum(n + 1 for n in pooled) / len(pooled) if pooled else nan,
        "tau_per_prompt_mean": statistics.fmean(per_prompt) if per_prompt else nan,
        "tau_per_prompt": {
            "min": min(per_prompt, default=nan),
            "median": statistics.median(per_prompt) if per_prompt else nan,
            "max": max(per_prompt, default=nan),
        },
    }


def stop_token_ids(model, tokenizer=None) -> set[int]:
    """End-of-sequence ids from the tokenizer, the model config and its generation config."""
    found = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            found.add(source)
        elif isinstance(source, (list, tuple)):
            found.update(int(s) for s in source)
    return found


@dataclasses.dataclass
class _Decodings:
    """Per prompt: the target's own tokens, the speculative tokens and accepted drafts; and timings."""

    own: list[list[int]]
    spec: list[list[int]]
    accepted: list[list[int]]
    target_tokens: int = 0
    target_seconds: float = 0.0
    spec_tokens: int = 0
    spec_seconds: float = 0.0


def make_decoder(
    model,
    layer_ids,
    drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids,
    batch: int,
    compile: bool = False,
):
    """A StaticDecoder sized for `prompts` decoded `batch` at a time (reuse it across evaluations)."""
    from trainer.infer.static_decode import StaticDecoder

    return StaticDecoder(
        model,
        layer_ids,
        drafter,
        rows=max(1, min(batch, len(prompts))),
        max_prompt=max(len(p) for p in prompts),
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        compile=compile,
    )


@dataclasses.dataclass
class _Job:
    """What both loops decode: the prompts that fit, how far, and how."""

    prompts: list[list[int]]
    max_new_tokens: int
    stops: tuple[int, ...]
    temperature: float
    seed: int
    reference: dict | None  # the target's own greedy outputs by key_of, across calls
    progress: Callable[[int, int], None] | None
    warmup: bool

    def key_of(self, prompt: list[int]) -> tuple:
        return tuple(prompt), self.max_new_tokens, self.stops


def _decode(job: _Job, rows: int, decode) -> _Decodings:
    """Both decodings of job.prompts, `rows` at a time: decode(chunk, speculative) gives (results,
    seconds); the target's own greedy outputs come from job.reference where it has them."""
    cache = job.reference if job.temperature <= 0 else None  # it holds greedy outputs only
    found = _Decodings([], [], [])
    for lo in range(0, len(job.prompts), rows):
        chunk = job.prompts[lo : lo + rows]
        cached = [cache.get(job.key_of(p)) if cache is not None else None for p in chunk]
        own = cast("list[list[int]]", cached)  # all cached, unless one is missing
        if any(c is None for c in cached):
            results, seconds = decode(chunk, False)
            own = [r.tokens for r in results]
            found.target_tokens += sum(len(t) for t in own)
            found.target_seconds += seconds
            if cache is not None:
                cache.update({job.key_of(p): t for p, t in zip(chunk, own, strict=True)})
        spec, seconds = decode(chunk, True)
        found.own += own
        found.spec += [r.tokens for r in spec]
        found.accepted += [r.accepted for r in spec]
        found.spec_tokens += sum(len(r.tokens) for r in spec)
        found.spec_seconds += seconds
        if job.progress is not None:
            job.progress(lo + len(chunk), len(job.prompts))
    return found


def _decode_static(decoder, job: _Job) -> _Decodings:
    if job.warmup:
        decoder.prepare(job.prompts)

    def decode(chunk: list[list[int]], speculative: bool):
        batch = decoder.decode(chunk, job.max_new_tokens, speculative=speculative)
        return batch.results, batch.seconds

    return _decode(job, decoder.rows, decode)


def _decode_reference(model, layer_ids, drafter, job: _Job) -> _Decodings:
    if job.warmup and job.prompts:
        target_generate(model, job.prompts[0], 4)
        speculative_generate(model, layer_ids, drafter, job.prompts[0], 4)
    generator = torch.Generator(device=model.get_input_embeddings().weight.device).manual_seed(job.seed)

    def decode(chunk: list[list[int]], speculative: bool):
        args = (chunk[0], job.max_new_tokens, job.stops, job.temperature, generator)
        run = (
            speculative_generate(model, layer_ids, drafter, *args)
            if speculative
            else target_generate(model, *args)
        )
        return [run], run.seconds

    return _decode(job, 1, decode)


def evaluate(
    model,
    layer_ids,
    drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids=(),
    seed: int = 0,
    reference: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    warmup: bool = False,
    batch: int = 1,
    loop: str = "static",
    decoder=None,
    compile: bool = False,
) -> EvalResult:
    """Decode every prompt both ways. `reference` caches the target's own greedy outputs across calls
    (the target is frozen); `decoder`: a StaticDecoder to reuse (make_decoder); `warmup`: capture the
    graphs (and compile) before timing."""
    if loop not in LOOPS:
        raise ValueError(f"loop {loop!r}: use one of {', '.join(LOOPS)}")
    t0 = time.perf_counter()
    block = drafter.cfg.block_size
    limit = getattr(model.config, "max_position_embeddings", None)
    # a block may reach block_size positions past the last token
    usable = [p for p in prompts if limit is None or len(p) + max_new_tokens + block <= limit]
    stops = tuple(sorted({int(s) for s in stop_ids}))
    job = _Job(usable, max_new_tokens, stops, temperature, seed, reference, progress, warmup)
    was_training = drafter.training
    drafter.eval()
    static = loop == "static" and temperature <= 0 and bool(usable)
    decoder = _static_decoder(decoder, model, layer_ids, drafter, job, batch, compile) if static else None
    try:
        if decoder is not None:
            found = _decode_static(decoder, job)
        else:
            found = _decode_reference(model, layer_ids, drafter, job)
        ties, mismatch = _judge(model, layer_ids, decoder, job, found)
    finally:
        drafter.train(was_training)
    return _result(found, job, block, len(prompts), ties, mismatch, time.perf_counter() - t0, decoder)


def _static_decoder(decoder, model, layer_ids, drafter, job: _Job, batch: int, compile: bool):
    """`decoder` if it fits the job, else a new one; None for an architecture the static loop does
    not implement (the reference loop decodes then)."""
    from trainer.infer.static_decode import Unsupported

    if (
        decoder is not None
        and decoder.drafter is not None
        and decoder.drafter.drafter is drafter
        and decoder.max_prompt >= max(len(p) for p in job.prompts)
        and decoder.max_new_tokens >= job.max_new_tokens
        and set(decoder.stop_ids.tolist()) - {-1} == set(job.stops)
    ):
        return decoder
    try:
        return make_decoder(
            model, layer_ids, drafter, job.prompts, job.max_new_tokens, job.stops, batch, compile
        )
    except Unsupported:
        return None


def _loop_name(decoder) -> str:
    """The result's `loop`: the static loop with what it runs on, or the reference loop (None)."""
    if decoder is None:
        return "reference"
    kernels = decoder.kernels
    parts = [("graphs", decoder.graphs), ("compile", kernels.compiled), ("triton", kernels.triton)]
    return "+".join(["static"] + [name for name, used in parts if used])


def _judge(model, layer_ids, decoder, job: _Job, found: _Decodings) -> tuple[int, Mismatch | None]:
    """(ties, the first bug) over all prompts: each difference is judged in fp32 (trainer.infer.lossless)
    by the static loop's target (a new one after the reference loop)."""
    from trainer.infer.lossless import Verdict, judge
    from trainer.infer.static_decode import StaticTarget, Unsupported

    if job.temperature > 0:
        return 0, None
    try:
        target = decoder.target if decoder is not None else StaticTarget(model, layer_ids, 1, 1)
    except Unsupported:
        target = None  # no fp32 referee for this architecture: every difference is a bug
    no_referee = Verdict(False, math.nan, math.nan, 0.0)
    ties, bug = 0, None
    for index, (prompt, a, b) in enumerate(zip(job.prompts, found.own, found.spec, strict=True)):
        if a == b:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        expected = a[at] if at < len(a) else -1
        got = b[at] if at < len(b) else -1
        v = judge(target, prompt + a[:at], expected, got) if target is not None else no_referee
        ties += v.tie
        if not v.tie and bug is None:
            bug = Mismatch(
                index, at, expected, got, prompt, v.expected_logit, v.got_logit, v.bound, v.top, v.top_logit
            )
    return ties, bug


def _result(
    found: _Decodings, job: _Job, block: int, prompts: int, ties: int, mismatch, seconds: float, decoder
) -> EvalResult:
    """The evaluation's numbers from what both decodings of `prompts` (job.prompts fit) found."""
    rounds = [n for row in found.accepted for n in row]
    target_tps = found.target_tokens / found.target_seconds if found.target_seconds > 0 else None
    spec_tps = found.spec_tokens / found.spec_seconds if found.spec_seconds > 0 else 0.0
    return EvalResult(
        **tau_summary(found.accepted),
        acceptance=[
            sum(n >= k for n in rounds) / len(rounds) if rounds else math.nan for k in range(1, block)
        ],
        rounds=len(rounds),
        prompts=len(job.prompts),
        skipped_too_long=prompts - len(job.prompts),
        new_tokens=int(found.spec_tokens),
        target_tokens_per_s=target_tps,
        speculative_tokens_per_s=spec_tps,
        speedup=spec_tps / target_tps if target_tps else None,
        lossless=None if job.temperature > 0 else mismatch is None,
        ties=ties,
        mismatch=mismatch,
        seconds=seconds,
        batch=decoder.rows if decoder is not None else 1,
        loop=_loop_name(decoder),
    )
