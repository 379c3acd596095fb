"""Tau while training: every `eval.every` steps, decode the evaluation prompts speculatively.

Runs in the main thread between steps, with the lead replica's weights copied into an evaluation
drafter on the target's device. The prompts decode as one batch on the static loop, whose caches
and CUDA graphs are built once; the frozen target's greedy outputs are computed once too.
"""

from __future__ import annotations

import time

import torch

from trainer.config import TrainConfig
from trainer.infer.evaluate import evaluate, make_decoder, stop_token_ids
from trainer.data.heldout import eval_prompts, eval_split
from trainer.train.metrics import MetricsWriter
from trainer.model import DFlashDrafter, DrafterConfig

# what an evaluation during training records of its EvalResult, in this order
RECORDED = ("tau", "tau_per_prompt_mean", "tau_per_prompt", "acceptance", "lossless", "prompts", "new_tokens")


class TrainingEval:
    def __init__(self, cfg: TrainConfig, target, dcfg: DrafterConfig, prompts: list[list[int]], dtype):
        self.every = cfg.eval.every
        self.max_new_tokens = cfg.eval.max_new_tokens
        self.target = target
        self.prompts = prompts[: cfg.eval.num_prompts]
        self.split = eval_split(cfg)
        self.stop_ids = stop_token_ids(target.model, target.tokenizer)
        self.reference: dict = {}
        self.decoder = None  # built at the first evaluation, reused by the others
        self.started = time.monotonic()
        self.eval_seconds = 0.0
        with torch.random.fork_rng(devices=[]):  # leave the training RNG stream as it was
            self.drafter = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
        self.drafter.to(device=target.device, dtype=dtype).eval()

    @classmethod
    def create(
        cls, cfg: TrainConfig, target, dcfg: DrafterConfig, heldout, dtype, say=print
    ) -> "TrainingEval | None":
        """The evaluator, or None when eval.every is 0 or there is nothing unseen to prompt with
        (then `say` tells why: a run does not fail for want of evaluation prompts)."""
        if not cfg.eval.every:
            return None
        if getattr(target, "model", None) is None:  # data.source features: no decoder was loaded
            say(
                "eval: tau evaluation off: data.source features loads no target decoder to decode with. "
                "Fix: run dflash-train eval --checkpoint on the run's output dir, or eval.every: 0"
            )
            return None
        if not (cfg.eval.path or heldout is not None or cfg.data.source == "synthetic"):
            say(
                "eval: tau evaluation off: no unseen prompts. Fix: set data.eval_fraction (e.g. 0.01) "
                "or eval.path, or eval.every: 0 to silence this"
            )
            return None
        return cls(cfg, target, dcfg, eval_prompts(cfg, target, heldout, cfg.eval.num_prompts), dtype)

    def due(self, step: int, total: int) -> bool:
        """Every `every` steps, and after the last one (runs shorter than `every` never evaluate)."""
        return step % self.every == 0 or (step == total and step > self.every)

    def run(self, model: torch.nn.Module, step: int, metrics: MetricsWriter):
        t0 = time.monotonic()
        self.drafter.load_state_dict(model.state_dict())
        decoding = (self.target.model, self.target.layer_ids, self.drafter, self.prompts)
        if self.decoder is None and self.prompts:
            self.decoder = make_decoder(
                *decoding, self.max_new_tokens, self.stop_ids, batch=len(self.prompts)
            )
        result = evaluate(
            *decoding,
            max_new_tokens=self.max_new_tokens,
            stop_ids=self.stop_ids,
            reference=self.reference,
            batch=len(self.prompts),
            decoder=self.decoder,
        )
        seconds = time.monotonic() - t0
        self.eval_seconds += seconds
        overhead = self.eval_seconds / max(time.monotonic() - self.started, 1e-9)
        recorded = {name: getattr(result, name) for name in RECORDED}
        metrics.record("eval", step=step, **recorded, seconds=seconds, overhead=overhead, split=self.split)
        if result.lossless:
            verdict = "ok"
        else:  # at temperature 0 (the default here), not lossless means a mismatch was found
            assert result.mismatch is not None
            verdict = f"FAILED at prompt {result.mismatch.prompt_index} token {result.mismatch.position}"
        metrics.say(
            f"eval     step {step}: {self.split} tau {result.tau:.3f} pooled, "
            f"{result.tau_per_prompt_mean:.3f} per-prompt mean  acceptance "
            + " ".join(f"{a:.2f}" for a in result.acceptance)
            + f"  lossless {verdict}  {result.prompts} prompts  {seconds:.2f}s  "
            f"(evaluation {100 * overhead:.1f}% of the run's wall time so far)"
        )
        return result
