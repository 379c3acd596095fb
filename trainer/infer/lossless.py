"""The lossless check's referee: is a differing token a floating-point tie of the target, or a bug?

Target-only and speculative decoding compute a position's logits with different kernels, so in a
low-precision dtype their argmax may differ where the target itself cannot decide. `judge`
recomputes that position in fp32 and calls it a tie only when each of the two tokens is within
`tie_bound` of the fp32 top: a near-tie of three tokens lets both forwards miss the top.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from trainer.infer import decode_kernels, gated_deltanet
from trainer.infer.static_decode import (
    EAGER,
    DeltaLayer,
    StaticTarget,
    grouped_attention,
    grouped_mask,
    model_rope,
    residual_mlp,
    rms_norm,
)


@dataclasses.dataclass
class Verdict:
    tie: bool
    expected_logit: float  # fp32 logit of the target-only token
    got_logit: float  # fp32 logit of the speculative token
    bound: float  # the largest gap to the top a working-dtype forward could flip (tie_bound)
    top: int = -1  # the fp32 argmax there
    top_logit: float = math.nan


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand (bf16 2^-8, fp16 2^-11, fp32 2^-24): |fl(x) - x| <= u|x|."""
    return torch.finfo(dtype).eps / 2


def tie_bound(
    hidden: torch.Tensor,
    w_a: torch.Tensor,
    w_b: torch.Tensor,
    z_a: float,
    z_b: float,
    dtype: torch.dtype,
    num_layers: int,
) -> float:
    """The largest |z_a - z_b| (fp32 logits) that two forwards in `dtype` may order differently.

    d = <h, w_a - w_b>. The final hidden h carries R = 4L + 2 roundings (two per sublayer, one per
    norm), modelled as independent and uniform on [-u, u]: d moves by s = u sqrt(R/3) ||h (.) (w_a - w_b)||
    (6 s bounds it but for < 1e-8); the lm_head rounds each logit once, u (|z_a| + |z_b|). Two forwards
    with independent roundings disagree only if |d| <= 2 (6 s + u (|z_a| + |z_b|)).
    """
    u = unit_roundoff(dtype)
    spread = float((hidden.float() * (w_a.float() - w_b.float())).norm())
    return 2 * (6 * u * math.sqrt((4 * num_layers + 2) / 3) * spread + u * (abs(z_a) + abs(z_b)))


def _fp32(weights: tuple) -> tuple:
    return tuple(None if t is None else t.float() for t in weights)


def _fp32_attention(target: StaticTarget, w, x, cos, sin, mask):
    q, k, v, gate = EAGER.pre(x, _fp32(w.pre), cos, sin, *target.dims, w.centered, w.gated)
    out = grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask)
    return EAGER.post(x, out, gate, _fp32(w.post), target.eps, w.centered)


def _fp32_delta(w, x):
    mixer = gated_deltanet.fp32_copy(w.mixer)
    conv, state = gated_deltanet.new_state(mixer, 1, x.device, torch.float32)
    h = rms_norm(x, w.ln.float(), w.eps, centered=True)
    mixed = gated_deltanet.run(h, mixer, conv, state, torch.tensor([x.shape[1]], device=x.device))
    return residual_mlp(x, mixed, *_fp32(w.mlp), w.eps, centered=True)


@torch.no_grad()
def fp32_last_hidden(target: StaticTarget, prefix: list[int]) -> torch.Tensor:
    """The target's final normed hidden state [H] at the end of `prefix`, in fp32 and without a cache
    (weights upcast one layer at a time)."""
    device = target.device
    where = torch.arange(len(prefix), device=device).unsqueeze(0)
    x = torch.nn.functional.embedding(torch.tensor([prefix], device=device), target.embed.float())
    cos, sin = model_rope(target.model.get_decoder(), x, len(prefix))  # fp32, like x
    visible = decode_kernels.grouped_visibility(where, len(prefix), target.heads // target.kv_heads)
    mask = grouped_mask(visible, torch.float32)
    for w in target.layers:
        x = _fp32_delta(w, x) if isinstance(w, DeltaLayer) else _fp32_attention(target, w, x, cos, sin, mask)
    return rms_norm(x[0, -1], target.norm_weight.float(), target.norm_eps, target.centered)


def judge(target: StaticTarget, prefix: list[int], expected: int, got: int) -> Verdict:
    """Recompute the target at the end of `prefix` (prompt + the tokens both decodings agreed on) in
    fp32: a tie if each token's gap to the fp32 top is within the tie_bound of that pair."""
    hidden = fp32_last_hidden(target, prefix)
    weight = target.head_weight
    bias = None if target.head_bias is None else target.head_bias.float()
    logits = torch.nn.functional.linear(hidden, weight.float(), bias)
    top = int(logits.argmax())
    valid = 0 <= expected < logits.shape[0] and 0 <= got < logits.shape[0]
    if not valid:  # one side ended where the other did not: no logit to compare
        return Verdict(False, math.nan, math.nan, 0.0)
    z_top = float(logits[top])

    def logit_and_bound(token: int) -> tuple[float, float]:
        """The token's fp32 logit and the largest gap below the top a working-dtype forward could flip."""
        z = float(logits[token])
        return z, tie_bound(hidden, weight[top], weight[token], z_top, z, target.dtype, len(target.layers))

    (z_a, bound_a), (z_b, bound_b) = logit_and_bound(expected), logit_and_bound(got)
    near_a, near_b = z_top - z_a <= bound_a, z_top - z_b <= bound_b
    # the bound said is the one a token went past, so "a gap beyond the bound" reads true
    bound = max(bound_a, bound_b) if near_a and near_b else (bound_b if near_a else bound_a)
    return Verdict(near_a and near_b, z_a, z_b, bound, top, z_top)
