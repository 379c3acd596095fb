"""A Gated DeltaNet layer (Qwen3.5/3.6 linear attention) over a static state, with deferred commit.

Per row the state is a causal-conv window (the last K-1 inputs) and S [value heads, key dim, value
dim] (fp32). One token (q, k l2-normalised, q scaled by 1/sqrt(key dim)) updates it as

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

A pass over T tokens solves the chunk in closed form (WY form: the new values U solve a unit
lower-triangular system); with gc the cumulative sum of g, the state after the first n tokens is

    S_n = exp(gc_{n-1}) S0 + sum_{j<n} exp(gc_{n-1} - gc_j) k_j u_j^T .

u_j depends only on tokens <= j, so ONE pass over a verify block gives every output AND, once the
target knows how many tokens it keeps, the exact state after that many (`commit`), with static shapes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from trainer.fused_projections import DELTA_INPUTS, INPUTS, fused_rows

CHUNK = 64


@dataclasses.dataclass
class DeltaNetWeights:
    """One Gated DeltaNet layer's tensors (the model's own, not copies) and its shape."""

    in_qkv: torch.Tensor  # with in_z/in_b/in_a None: all four fused (trainer.fused_projections)
    in_z: torch.Tensor | None
    in_b: torch.Tensor | None
    in_a: torch.Tensor | None
    conv: torch.Tensor  # [conv channels, K]
    conv_bias: torch.Tensor | None
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor  # gated RMSNorm weight [value head dim]
    out: torch.Tensor
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    eps: float

    @classmethod
    def of(cls, module) -> "DeltaNetWeights":
        inputs = [getattr(module, name) for name in DELTA_INPUTS]
        whole = fused_rows(module, INPUTS, inputs)
        in_qkv, in_z, in_b, in_a = (
            (whole, None, None, None) if whole is not None else (p.weight for p in inputs)
        )
        conv, norm = module.conv1d, module.norm
        tensors = (conv.weight.squeeze(1), conv.bias, module.A_log, module.dt_bias, norm.weight)
        shape = (module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        eps = float(norm.variance_epsilon)
        return cls(in_qkv, in_z, in_b, in_a, *tensors, module.out_proj.weight, *shape, eps)

    @property
    def kernel(self) -> int:
        return self.conv.shape[-1]

    @property
    def channels(self) -> int:
        return self.conv.shape[0]


def fp32_copy(weights):
    """`weights` with every tensor in float32 (the lossless referee's recomputation)."""
    tensors = {k: v.float() for k, v in vars(weights).items() if isinstance(v, torch.Tensor)}
    return dataclasses.replace(weights, **tensors)


@dataclasses.dataclass
class Pending:
    """What a pass leaves for `commit`: the conv window and the chunk's keys, new values and decays."""

    window: torch.Tensor  # [B, channels, K-1+T]
    keys: torch.Tensor  # [B, Hv, T, dk] (fp32, normalised)
    values: torch.Tensor  # [B, Hv, T, dv] (U, fp32)
    decay: torch.Tensor  # [B, Hv, T] (gc, fp32)


def new_state(w: DeltaNetWeights, rows: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv window [rows, channels, K-1] in the working dtype, S [rows, Hv, dk, dv] in fp32), zeroed."""
    conv = torch.zeros(rows, w.channels, w.kernel - 1, device=device, dtype=dtype)
    recurrent = torch.zeros(rows, w.value_heads, w.key_dim, w.value_dim, device=device, dtype=torch.float32)
    return conv, recurrent


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The output norm: RMSNorm over the value head dim, then times silu(gate) (in fp32)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * x32.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


def _inputs(x: torch.Tensor, w: DeltaNetWeights, conv_state: torch.Tensor):
    """Projections and the causal conv of a pass: (q, k, v [B, H, T, d] fp32, beta, g [B, Hv, T] fp32,
    z [B, T, Hv, dv], the conv window)."""
    batch, length, _ = x.shape
    if w.in_z is None or w.in_b is None or w.in_a is None:
        widths = [w.channels, w.value_heads * w.value_dim, w.value_heads, w.value_heads]
        mixed, z, b, a = F.linear(x, w.in_qkv).split(widths, dim=-1)
    else:
        mixed, z, b, a = (F.linear(x, m) for m in (w.in_qkv, w.in_z, w.in_b, w.in_a))
    mixed = mixed.transpose(1, 2)  # [B, channels, T]
    window = torch.cat([conv_state, mixed], dim=-1)
    conv = F.silu(F.conv1d(window, w.conv.unsqueeze(1), w.conv_bias, groups=w.channels)).transpose(1, 2)
    key_width = w.key_heads * w.key_dim
    q, k, v = torch.split(conv, [key_width, key_width, w.value_heads * w.value_dim], dim=-1)
    repeat = w.value_heads // w.key_heads

    def heads(t, count, dim):
        t = t.reshape(batch, length, count, dim).transpose(1, 2).float()
        return t.repeat_interleave(repeat, dim=1) if count != w.value_heads else t

    q = _l2norm(heads(q, w.key_heads, w.key_dim)) * w.key_dim**-0.5
    k = _l2norm(heads(k, w.key_heads, w.key_dim))
    v = heads(v, w.value_heads, w.value_dim)
    beta = torch.sigmoid(b.float()).transpose(1, 2)
    g = (-w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias)).transpose(1, 2)
    z = z.reshape(batch, length, w.value_heads, w.value_dim)
    return q, k, v, beta, g, z, window


def _chunk(q, k, v, beta, g, state):
    """Outputs [B, Hv, T, dv] and (U, gc) of one chunk from state S0 (see the module docstring)."""
    length = q.shape[2]
    gc = g.cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
    strict = (k @ k.transpose(-1, -2)) * decay * beta.unsqueeze(-1)
    system = torch.eye(length, device=q.device) + strict.tril(-1)
    start = gc.exp().unsqueeze(-1)
    rhs = beta.unsqueeze(-1) * (v - start * (k @ state))
    values = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = start * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ values
    return out, values, gc


def mix_tensors(x: torch.Tensor, w: DeltaNetWeights, conv_state: torch.Tensor, state: torch.Tensor):
    """`mix` as plain tensors (output, window, keys, values, decay): what torch.compile wraps."""
    batch, length, _ = x.shape
    q, k, v, beta, g, z, window = _inputs(x, w, conv_state)
    out, values, gc = _chunk(q, k, v, beta, g, state)
    out = out.transpose(1, 2).to(x.dtype)  # [B, T, Hv, dv]
    out = gated_rms_norm(out, z, w.norm, w.eps).reshape(batch, length, -1)
    return F.linear(out, w.out), window, k, values, gc


def mix(
    x: torch.Tensor, w: DeltaNetWeights, conv_state: torch.Tensor, state: torch.Tensor, kernel=mix_tensors
):
    """The token mixing of x [B, T <= CHUNK, H] (input-normed) from the state, which is NOT changed:
    (output [B, T, H], Pending for commit). `kernel`: mix_tensors or a compiled copy of it."""
    out, window, keys, values, decay = kernel(x, w, conv_state, state)
    return out, Pending(window, keys, values, decay)


def commit(pending: Pending, kept: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> None:
    """Advance the state in place by the first `kept` [B] tokens of the pass (0 leaves a row as it was)."""
    length = pending.keys.shape[2]
    last = (kept - 1).clamp(min=0)
    index = last.view(-1, 1, 1).expand(-1, pending.decay.shape[1], 1)
    end = pending.decay.gather(2, index)  # [B, Hv, 1]: gc at the last kept token
    taken = torch.arange(length, device=kept.device) < kept.view(-1, 1)  # [B, T]
    weight = torch.where(taken.unsqueeze(1), torch.exp(end - pending.decay), torch.zeros_like(pending.decay))
    moved = end.exp().unsqueeze(-1) * state + pending.keys.transpose(-1, -2) @ (
        weight.unsqueeze(-1) * pending.values
    )
    state.copy_(torch.where((kept > 0).view(-1, 1, 1, 1), moved, state))
    span = conv_state.shape[-1]
    where = (kept.view(-1, 1) + torch.arange(span, device=kept.device)).unsqueeze(1)
    conv_state.copy_(pending.window.gather(2, where.expand(-1, conv_state.shape[1], -1)))


def run(x: torch.Tensor, w: DeltaNetWeights, conv_state, state, lengths: torch.Tensor) -> torch.Tensor:
    """The layer over a whole input x [B, T, H] (a prompt), chunk by chunk, the state advanced by the
    first `lengths` [B] tokens of each row (the rest is padding: it changes nothing)."""
    outputs = []
    for begin in range(0, x.shape[1], CHUNK):
        piece = x[:, begin : begin + CHUNK]
        out, pending = mix(piece, w, conv_state, state)
        outputs.append(out)
        commit(pending, (lengths - begin).clamp(0, piece.shape[1]), conv_state, state)
    return torch.cat(outputs, dim=1)
