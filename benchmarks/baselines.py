"""Baselines the benchmarks measure the trainer against. A training config cannot select them.

- "first-step" compile lock (FirstStepGuard): one exclusive lock around each thread's first step and
  nothing after it, the fix that preceded the full compile lock. Recompiles after step 0 race again,
  which is what the race harness shows.
- "flex_eager" attention (eager_flex_attention): flex_attention without torch.compile, to price the
  compile. It saves and restores the global FX flag around its own internal compile: never mix it
  into a run that also calls compiled code (trainer.compile_lock.assert_fx_flag_clear).
"""

from __future__ import annotations

from trainer.compile_lock import COMPILE_LOCK_MODES, CompileGuard

FIRST_STEP = "first-step"
FLEX_EAGER = "flex_eager"
# Every compile-lock mode a benchmark or race trial may name
GUARD_MODES = (*COMPILE_LOCK_MODES, FIRST_STEP)


class FirstStepGuard(CompileGuard):
    modes = {FIRST_STEP: "one lock around each thread's first step only (baseline)"}

    def exclusive_reason(self, context) -> str | None:
        return None if self.has_completed_a_step(context.thread) else "first_step"


def compile_guard(mode: str, **kwargs) -> CompileGuard:
    """The guard for any of GUARD_MODES (not installed yet)."""
    return FirstStepGuard(mode, **kwargs) if mode == FIRST_STEP else CompileGuard(mode, **kwargs)


def eager_flex_attention(q, k, v, attn_mask):
    """trainer.model.AttentionFn: flex_attention without torch.compile."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)


def attention_backend(name: str):
    """What trainer.model.DFlashDrafter.forward takes for an attention name: the trainer's own
    names pass through, FLEX_EAGER is eager_flex_attention."""
    return eager_flex_attention if name == FLEX_EAGER else name
