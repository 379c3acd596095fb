"""Batched greedy decoding over pre-allocated caches, target-only and DFlash speculative (the fast path;
trainer.infer.speculative is its reference).

- A forward WRITES its K/V at its positions and attends only to keys at positions <= its own, so a
  rejected draft needs no crop: its stale entries are overwritten before any query can see them.
- A whole round (extend, draft, verify, accept, stop, log) is tensor ops on state buffers with no host
  value in between, so on CUDA it is captured once as a graph and replayed; the host reads one flag
  per round. On the CPU the same functions run eagerly.
- Rows are prompts, each with its own position and output (ragged acceptance).
- The target is an HF Qwen3-family causal LM, its weights used in place; target-only and speculative
  decoding run on the same StaticTarget, so their tokens/s ratio is fair.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from trainer.infer import decode_kernels, gated_deltanet
from trainer.infer.speculative import Decoded
from trainer.fused_projections import GATE_UP, QKV, fused_rows
from trainer.model import DFlashDrafter, apply_rope, rope_cos_sin
from trainer.target_family import HYBRID_TYPES, is_hybrid


class Unsupported(ValueError):
    """The target's architecture is outside what the static path implements (use the reference path)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, centered: bool = False) -> torch.Tensor:
    """Qwen3 RMSNorm (HF and trainer.model.RMSNorm alike): normalise in fp32, scale in the input dtype.
    `centered`: Qwen3.5's norm, scaled by (1 + weight) in fp32 before the cast."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if centered:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head (all of them, or Qwen3.5's partial rotary)."""
    turned = cos.shape[-1]
    if turned == x.shape[-1]:
        return apply_rope(x, cos, sin)
    head, rest = x[..., :turned], x[..., turned:]
    return torch.cat([apply_rope(head, cos, sin), rest], dim=-1)


def pre_attention(
    x, weights, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int,
    centered: bool = False, gated: bool = False, project=F.linear,
):  # fmt: skip
    """Input norm, q/k/v projections, per-head norms and RoPE of one layer: q grouped by kv head
    [B, Hkv, G*T, D] (grouped_attention), k, v [B, T, Hkv, D] (the cache's write layout) and, for a
    gated attention (Qwen3.5: q_proj gives each head's query and gate), the output gate, else None."""
    ln, wq, bq, wk, bk, wv, bv, q_norm, k_norm = weights
    batch, length, _ = x.shape
    h = rms_norm(x, ln, eps, centered)
    if wk is None:
        width = kv_heads * head_dim
        q, k, v = project(h, wq, bq).split([wq.shape[0] - 2 * width, width, width], dim=-1)
    else:
        q, k, v = project(h, wq, bq), project(h, wk, bk), project(h, wv, bv)
    q = q.reshape(batch, length, heads, -1)
    gate = None
    if gated:
        q, gate = q.chunk(2, dim=-1)
        gate = gate.reshape(batch, length, heads * head_dim)
    k = k.reshape(batch, length, kv_heads, head_dim)
    v = v.reshape(batch, length, kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps, centered)
        k = rms_norm(k, k_norm, eps, centered)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    q, k = rotate(q, c, s), rotate(k, c, s)
    group = heads // kv_heads
    grouped = q.reshape(batch, length, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    return grouped.reshape(batch, kv_heads, group * length, head_dim), k, v, gate


def gated_up(x, branch, ln, gate, up, eps: float, centered: bool = False, project=F.linear):
    """The first half of residual_mlp: x + branch (branch None: x) and the SiLU-gated up projection of
    its norm, for a down projection that adds the residual itself."""
    if branch is not None:
        x = x + branch
    h = rms_norm(x, ln, eps, centered)
    g, u = project(h, gate).chunk(2, dim=-1) if up is None else (project(h, gate), project(h, up))
    return x, F.silu(g) * u


def residual_mlp(x, branch, ln, gate, up, down, eps: float, centered: bool = False, project=F.linear):
    """x + branch, then the post-mixing norm, the SiLU MLP and its residual (every layer kind ends so).
    up None: gate is gate and up fused."""
    x, act = gated_up(x, branch, ln, gate, up, eps, centered, project)
    return x + project(act, down)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, written for one row (a decode step) as a product and a sum in fp32 that torch.compile
    turns into one reduction kernel reading the weight once; more rows take the matmul."""
    if x.numel() != x.shape[-1]:
        return F.linear(x, weight, bias)
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def merge_heads(attn, out_gate, length: int):
    """The grouped attention output [B, Hkv, G*T, D] as [B, T, H*D], times the output gate when gated."""
    batch, kv_heads, rows, dim = attn.shape
    attn = attn.view(batch, kv_heads, rows // length, length, dim).permute(0, 3, 1, 2, 4)
    attn = attn.reshape(batch, length, -1)
    return attn if out_gate is None else attn * torch.sigmoid(out_gate)


def post_attention(x, attn, out_gate, weights, eps: float, centered: bool = False, project=F.linear):
    """merge_heads, the output projection, then residual_mlp. weights: _Layer.post."""
    wo, bo, ln, gate, up, down = weights
    merged = merge_heads(attn, out_gate, x.shape[1])
    return residual_mlp(x, project(merged, wo, bo), ln, gate, up, down, eps, centered, project)


def context_kv(
    features, start, fc, norm, kv, k_norms, cos, sin, keys, values, rows, eps: tuple, kv_heads: int,
    head_dim: int,
) -> None:  # fmt: skip
    """Write every drafter layer's context keys/values of target features [B, T, K*H] at positions
    start.. [B] into the caches [L, B', Hkv, S, D] (rows [B, 1] of them): the feature projection and its
    norm, then ONE product for all L layers' K and V (kv: each layer's k_proj then v_proj rows,
    stacked), each layer's k norm and RoPE. eps: (the feature norm's, the layers' norms')."""
    batch, length, _ = features.shape
    where = start.unsqueeze(1) + torch.arange(length, device=start.device)
    ctx = rms_norm(F.linear(features.to(fc.dtype), fc), norm, eps[0])
    both = F.linear(ctx, kv).view(batch, length, -1, 2, kv_heads, head_dim)
    k = rms_norm(both[:, :, :, 0], k_norms.unsqueeze(1), eps[1])
    keys[:, rows, :, where] = rotate(k, cos[where][:, :, None, None], sin[where][:, :, None, None])
    values[:, rows, :, where] = both[:, :, :, 1]


def block_inputs(anchor, start, offsets, mask_ids, embed, cos, sin, dtype: torch.dtype):
    """What a drafter block forward takes: the embedded block [anchor, MASK...] [B, L, H] at positions
    where = start.. [B, L], their RoPE cos/sin, and each query's horizon (it sees the whole block)."""
    where = start.unsqueeze(1) + offsets
    x = F.embedding(torch.cat([anchor.unsqueeze(1), mask_ids], dim=1), embed).to(dtype)
    return x, where, cos[where], sin[where], (start + offsets[-1]).unsqueeze(1).expand_as(where)


def grouped_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of decode_kernels.grouped_visibility's answer (built once per
    forward, shared by every layer)."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def grouped_attention(q, keys, values, mask):
    """GQA without repeating the cache: the G query heads of one kv head are G*T query rows against
    that head's keys. q [B, Hkv, G*T, D]; keys/values [B, Hkv, S, D]; mask from grouped_mask."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


@dataclasses.dataclass
class _Layer:
    """One decoder layer's weights (the model's own tensors, not copies), as its kernels take them."""

    pre: tuple  # pre_attention's: ln, wq, bq, wk, bk, wv, bv, q_norm, k_norm (wk None: wq is q, k, v fused)
    post: tuple  # post_attention's: wo, bo, then _mlp_weights
    centered: bool = False  # Qwen3.5 norms (1 + weight)
    gated: bool = False  # Qwen3.5 gated attention


@dataclasses.dataclass
class DeltaLayer:
    """One Gated DeltaNet layer: its token mixer and the norms and MLP around it."""

    ln: torch.Tensor
    mixer: gated_deltanet.DeltaNetWeights
    mlp: tuple  # _mlp_weights
    eps: float


def _mlp_weights(layer) -> tuple:
    """What follows the token mixer, as residual_mlp takes it: ln2, gate, up, down (up None: gate is
    gate and up fused by fuse_projections)."""
    mlp = layer.mlp
    both = fused_rows(mlp, GATE_UP, [mlp.gate_proj, mlp.up_proj])
    gate_up = (both, None) if both is not None else (mlp.gate_proj.weight, mlp.up_proj.weight)
    return layer.post_attention_layernorm.weight, *gate_up, mlp.down_proj.weight


def _layer_of(layer, centered: bool = False) -> _Layer:
    attn = layer.self_attn
    norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    pre = (layer.input_layernorm.weight, *_qkv(attn), *(None if n is None else n.weight for n in norms))
    post = (attn.o_proj.weight, attn.o_proj.bias, *_mlp_weights(layer))
    gated = attn.q_proj.weight.shape[0] == 2 * attn.o_proj.weight.shape[1]
    return _Layer(pre, post, centered, gated)


def _qkv(attn) -> tuple[torch.Tensor | None, ...]:
    """wq, bq, wk, bk, wv, bv; when fuse_projections fused them, q/k/v as wq with their biases
    concatenated as bq and None for the rest (a mix of biased and unbiased stays apart)."""
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    biases = [p.bias for p in projections]
    whole = fused_rows(attn, QKV, projections)
    if whole is None or len({bias is None for bias in biases}) > 1:
        q, k, v = (p.weight for p in projections)
        return q, biases[0], k, biases[1], v, biases[2]
    return whole, None if biases[0] is None else torch.cat(biases), None, None, None, None


def _delta_layer_of(layer) -> DeltaLayer:
    ln, mixer = layer.input_layernorm, gated_deltanet.DeltaNetWeights.of(layer.linear_attn)
    return DeltaLayer(ln.weight, mixer, _mlp_weights(layer), _eps_of(ln))


def _eps_of(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class Kernels:
    """How a layer's math runs: eager or compiled once per shape and shared by every layer (weights are
    arguments, so the layers of a model are one compiled graph); with `triton`, attention and the
    products followed by a residual run as decode_kernels."""

    def __init__(self, compile: bool, rowwise: bool = False, triton: bool = False):
        """`rowwise` (with compile): one-row products as reduction kernels (rowwise_linear)."""
        self.compiled, self.rowwise, self.triton = compile, compile and rowwise, triton
        if compile:  # one compiled graph per distinct shape (target step, verify, draft; several models)
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64))
        options: dict[str, Any] | None = {"coordinate_descent_tuning": True} if self.rowwise else None
        project = rowwise_linear if self.rowwise else F.linear

        def wrap(f):
            return torch.compile(f, dynamic=False, fullgraph=True, options=options) if compile else f

        self.wrap = wrap
        self.pre = wrap(functools.partial(pre_attention, project=project))
        self.post = wrap(functools.partial(post_attention, project=project))
        self.residual_mlp = wrap(functools.partial(residual_mlp, project=project))
        self.context = wrap(context_kv)
        self.block_inputs = wrap(block_inputs)
        self.norm = wrap(rms_norm)  # eager, a norm is a kernel per op; compiled, one
        self.delta = wrap(gated_deltanet.mix_tensors)
        self.merge = wrap(merge_heads)
        self.gated_up = wrap(functools.partial(gated_up, project=project))

    def visibility(self, horizon: torch.Tensor, keys: int, group: int, dtype: torch.dtype):
        """What attention takes to know that query (b, t) sees the keys at positions <= horizon [B, T]
        of a cache of `keys` positions: the horizon itself (decode_kernels) or the additive mask."""
        if self.triton:
            return horizon
        return grouped_mask(decode_kernels.grouped_visibility(horizon, keys, group), dtype)

    def head(self, x, weight, bias=None):
        """An LM head's logits (decode_kernels' product reads the vocabulary's rows faster than cuBLAS)."""
        return decode_kernels.linear(x, weight, bias) if self.triton else F.linear(x, weight, bias)

    def mlp(self, x, branch, weights: tuple, eps: float, centered: bool = False):
        """residual_mlp (branch None: x alone) with _mlp_weights."""
        ln, gate, up, down = weights
        if not self.triton:
            return self.residual_mlp(x, branch, ln, gate, up, down, eps, centered)
        x, act = self.gated_up(x, branch, ln, gate, up, eps, centered)
        return decode_kernels.linear(act, down, residual=x)

    def layer(self, x, w: _Layer, cos, sin, keys, values, rows, where, seen, dims: tuple):
        """One decoder layer over a static cache: its K/V written at `where` of `rows` (consecutive
        positions per row), then attention over the keys `seen` (visibility's answer) lets each query
        see. dims: (eps, heads, kv heads, head dim)."""
        q, k, v, out_gate = self.pre(x, w.pre, cos, sin, *dims, w.centered, w.gated)
        if not self.triton:
            keys[rows, :, where] = k
            values[rows, :, where] = v
            out = grouped_attention(q, keys, values, seen)
            return self.post(x, out, out_gate, w.post, dims[0], w.centered)
        out = decode_kernels.attention(q, keys, values, seen, k, v, where)
        wo, bo, *mlp = w.post
        x = decode_kernels.linear(self.merge(out, out_gate, x.shape[1]), wo, bo, residual=x)
        return self.mlp(x, None, tuple(mlp), dims[0], w.centered)


EAGER = Kernels(compile=False)


class Pass(NamedTuple):
    """What one target pass gives: the final normed hidden [B, T, H], the drafter's features
    [B, T, K*H] (None when not asked for) and each recurrent layer's Pending (for commit)."""

    hidden: torch.Tensor
    features: torch.Tensor | None
    pending: dict[int, gated_deltanet.Pending]


def _check_static(model) -> None:
    """Raise Unsupported for what the static path does not implement (the reference loop decodes then)."""
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg.hidden_act!r} (the static path implements silu)")
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or []
    ):
        raise Unsupported("sliding-window attention")
    decoder = model.get_decoder()
    if not hasattr(decoder, "rotary_emb") or not all(
        hasattr(getattr(layer, "mlp", None), "gate_proj") for layer in decoder.layers
    ):
        raise Unsupported(f"{type(model).__name__} has no model-level rotary_emb / dense SiLU MLP layers")
    if getattr(cfg, "model_type", "") not in HYBRID_TYPES and is_hybrid(cfg):
        raise Unsupported(f"recurrent layers of model_type {cfg.model_type!r}")


def model_rope(decoder, x: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own RoPE (scaling, partial rotary included) at positions 0..positions-1, batch 1, in
    x's dtype. A multimodal rotary (Qwen3.5/3.6) takes one row of positions per axis; some transformers
    releases expand text positions to those rows in the model's forward, not in the rotary, so they are
    given expanded (text has the same position on every axis)."""
    where = torch.arange(positions, device=x.device).unsqueeze(0)
    if hasattr(decoder.rotary_emb, "mrope_section"):
        where = where.expand(3, 1, -1)
    return decoder.rotary_emb(x, where)


class StaticTarget:
    """The HF target's forward over pre-allocated state, batched by rows, taking the drafter's features
    (HF `hidden_states[l + 1]`) on the way; recurrent layers advance only on `commit`."""

    def __init__(self, model, layer_ids, rows: int, positions: int):
        _check_static(model)
        cfg = model.config
        decoder = model.get_decoder()
        self.model, self.centered = model, is_hybrid(cfg)  # Qwen3.5 norms scale by (1 + weight)
        self.layers: list[_Layer | DeltaLayer] = [
            _delta_layer_of(layer) if hasattr(layer, "linear_attn") else _layer_of(layer, self.centered)
            for layer in decoder.layers
        ]
        attention = [i for i, w in enumerate(self.layers) if isinstance(w, _Layer)]
        self.kv_slot = {layer: slot for slot, layer in enumerate(attention)}
        self.eps = _eps_of(decoder.layers[0].input_layernorm)
        self.norm_weight, self.norm_eps = decoder.norm.weight, _eps_of(decoder.norm)
        self.embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        self.head_weight, self.head_bias = head.weight, head.bias
        self.layer_ids = list(layer_ids)
        self.head_dim = decoder.layers[attention[0]].self_attn.head_dim if attention else 1
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.dims = (self.eps, self.heads, self.kv_heads, self.head_dim)
        self.rows, self.positions = rows, positions
        self.device, self.dtype = self.embed.device, self.embed.dtype
        shape = (len(attention), rows, self.kv_heads, positions, self.head_dim)
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.states = {  # each recurrent layer's (conv window, S)
            i: gated_deltanet.new_state(w.mixer, rows, self.device, self.dtype)
            for i, w in enumerate(self.layers)
            if isinstance(w, DeltaLayer)
        }
        with torch.no_grad():  # tabulated once
            cos, sin = model_rope(decoder, self.embed[:1].unsqueeze(0), positions)
        self.cos, self.sin = cos[0], sin[0]  # [positions, rotary dims]
        self.row_index = torch.arange(rows, device=self.device).unsqueeze(1)

    def _delta(self, i: int, x, w: DeltaLayer, lengths, kernels: Kernels):
        """A Gated DeltaNet layer: mix from the state (Pending to commit) or, given `lengths`, run a
        whole prompt and advance the state at once (no Pending)."""
        h = kernels.norm(x, w.ln, w.eps, True)
        if lengths is None:
            mixed, pending = gated_deltanet.mix(h, w.mixer, *self.states[i], kernels.delta)
        else:
            mixed, pending = gated_deltanet.run(h, w.mixer, *self.states[i], lengths), None
        return kernels.mlp(x, mixed, w.mlp, w.eps, True), pending

    def hidden(
        self,
        ids: torch.Tensor,
        where: torch.Tensor,
        kernels: Kernels = EAGER,
        features: bool = True,
        lengths: torch.Tensor | None = None,
    ) -> Pass:
        """The target over ids [rows, T] at positions where: recurrent layers leave Pending for `commit`,
        or, given `lengths` (a right-padded prompt), take each row's first lengths tokens at once."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[where], self.sin[where]
        seen = kernels.visibility(where, self.positions, self.heads // self.kv_heads, self.dtype)
        wanted = set(self.layer_ids) if features else set()
        last = len(self.layers) - 1
        taken, pending = {}, {}
        for i, w in enumerate(self.layers):
            if isinstance(w, DeltaLayer):
                x, left = self._delta(i, x, w, lengths, kernels)
                if left is not None:
                    pending[i] = left
            else:
                keys, values = self.keys[self.kv_slot[i]], self.values[self.kv_slot[i]]
                x = kernels.layer(x, w, cos, sin, keys, values, self.row_index, where, seen, self.dims)
            if i in wanted and i != last:
                taken[i] = x
        normed = kernels.norm(x, self.norm_weight, self.norm_eps, self.centered)
        if last in wanted:
            taken[last] = normed  # HF reports the last layer's state after the final norm
        found = torch.cat([taken[i] for i in self.layer_ids], dim=-1) if wanted else None
        return Pass(normed, found, pending)

    def commit(self, pending: dict[int, gated_deltanet.Pending], kept: torch.Tensor) -> None:
        """Advance every recurrent layer by the first `kept` [B] tokens of the pass that left `pending`."""
        for i, left in pending.items():
            gated_deltanet.commit(left, kept, *self.states[i])

    def reset(self) -> None:
        """Empty recurrent states (a new prefill; K/V need no reset: every query's horizon is its own)."""
        for conv, state in self.states.values():
            conv.zero_()
            state.zero_()

    def logits(self, hidden: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        return kernels.head(hidden, self.head_weight, self.head_bias)


class StaticDrafter:
    """The drafter's context K/V per layer in a pre-allocated cache; one block forward per call."""

    def __init__(self, drafter: DFlashDrafter, rows: int, positions: int):
        cfg = drafter.cfg
        self.drafter, self.cfg = drafter, cfg
        # Products the drafter's modules keep apart run as one over stacked copies of their weights
        # (q/k/v, gate/up, every layer's k/v of the context), taken again at each refresh: the
        # drafter's weights change in place while it trains.
        self._copies: list[tuple[Callable, list[torch.Tensor], torch.Tensor]] = []
        self.layers = [self._fused(_layer_of(layer)) for layer in drafter.layers]
        attention: list[Any] = [layer.self_attn for layer in drafter.layers]  # DFlashAttention: no biases
        self.kv = self._copy(torch.cat, [w for a in attention for w in (a.k_proj.weight, a.v_proj.weight)])
        self.k_norms = self._copy(torch.stack, [a.k_norm.weight for a in attention])
        self.block = cfg.block_size
        self.dims = (cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        shape = (len(self.layers), rows, cfg.num_kv_heads, positions, cfg.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        cos, sin = rope_cos_sin(
            torch.arange(positions, device=device).unsqueeze(0), cfg.head_dim, cfg.rope_theta, dtype
        )
        self.cos, self.sin = cos[0, 0], sin[0, 0]  # [positions, D]
        self.row_index = torch.arange(rows, device=device).unsqueeze(1)
        self.offsets = torch.arange(self.block, device=device)
        self.mask_ids = torch.full((rows, self.block - 1), cfg.mask_token_id, dtype=torch.long, device=device)

    def _copy(self, join: Callable, parts: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            out = join(parts)
        self._copies.append((join, parts, out))
        return out

    def _fused(self, w: _Layer) -> _Layer:
        """The layer with its q/k/v and its gate/up as one stacked product each (as fuse_projections)."""
        ln, wq, _, wk, _, wv, _, q_norm, k_norm = w.pre
        wo, bo, ln2, gate, up, down = w.post
        qkv, gate_up = self._copy(torch.cat, [wq, wk, wv]), self._copy(torch.cat, [gate, up])
        return _Layer(
            (ln, qkv, None, None, None, None, None, q_norm, k_norm), (wo, bo, ln2, gate_up, None, down)
        )

    def refresh(self) -> None:
        """Take the drafter's current weights into the stacked copies (in place: graphs read these)."""
        with torch.no_grad():
            for join, parts, out in self._copies:
                join(parts, out=out)

    def extend(self, features: torch.Tensor, start: torch.Tensor, kernels: Kernels = EAGER) -> None:
        """Write the context K/V of target features [B, T, K*H] at positions start.. [B]."""
        d, cfg = self.drafter, self.cfg
        weights = (d.fc.weight, d.hidden_norm.weight, self.kv, self.k_norms, self.cos, self.sin)
        caches = (self.keys, self.values, self.row_index)
        eps = (d.hidden_norm.eps, cfg.rms_norm_eps)
        kernels.context(features, start, *weights, *caches, eps, cfg.num_kv_heads, cfg.head_dim)

    def proposals(self, anchor: torch.Tensor, start: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """[B, block-1] greedy proposals for positions start+1.. of the block [anchor, MASK...] placed
        at start..start+block-1 (it sees the cached context before start and the whole block)."""
        d, cfg = self.drafter, self.cfg
        tables = (self.offsets, self.mask_ids, d.embed_weight, self.cos, self.sin)
        x, where, cos, sin, horizon = kernels.block_inputs(anchor, start, *tables, d.fc.weight.dtype)
        group = cfg.num_heads // cfg.num_kv_heads
        seen = kernels.visibility(horizon, self.keys.shape[3], group, x.dtype)
        for i, w in enumerate(self.layers):
            x = kernels.layer(
                x, w, cos, sin, self.keys[i], self.values[i], self.row_index, where, seen, self.dims
            )
        hidden = kernels.norm(x[:, 1:], d.norm.weight, d.norm.eps)
        return kernels.head(hidden, d.lm_head_weight.to(hidden.dtype), d.lm_head_bias).argmax(-1)


@dataclasses.dataclass
class Batch:
    results: list[Decoded]  # each with the whole batch's seconds (rows decode together)
    seconds: float
    rounds: int  # host iterations (graph replays)


class StaticDecoder:
    """Greedy decoding of up to `rows` prompts at once. Build once, decode many times: caches and graphs
    are reused (spare rows stay inactive), and drafter weights may change in place between calls."""

    def __init__(
        self,
        model,
        layer_ids,
        drafter: DFlashDrafter | None,
        *,
        rows: int,
        max_prompt: int,
        max_new_tokens: int,
        stop_ids=(),
        graphs: bool | None = None,
        compile: bool = False,
        rowwise: bool = False,
        triton: bool | None = None,
    ):
        block = drafter.cfg.block_size if drafter is not None else 1
        self.rows, self.max_prompt, self.max_new_tokens, self.block = rows, max_prompt, max_new_tokens, block
        positions = max_prompt + max_new_tokens + block
        self.target = StaticTarget(model, layer_ids, rows, positions)
        self.drafter = StaticDrafter(drafter, rows, positions) if drafter is not None else None
        self.device = device = self.target.device
        on_cuda = device.type == "cuda"
        self.graphs = on_cuda if graphs is None else (graphs and on_cuda)
        if triton is None:  # decode_kernels' products where they run: compiled decoding on CUDA
            triton = compile and on_cuda and decode_kernels.triton is not None
        self.kernels = Kernels(compile, rowwise, triton) if compile or triton else EAGER
        stops = sorted({int(s) for s in stop_ids}) or [-1]
        self.stop_ids = torch.tensor(stops, device=device)
        long = {"device": device, "dtype": torch.long}
        self.offsets = torch.arange(block, **long)
        # state, all rows: position of the last emitted token (the next anchor), that token, tokens emitted,
        # rounds done, the token budget, still decoding, the output and the per-round accepted drafts
        self.start, self.anchor, self.emitted, self.round, self.budget = (
            torch.zeros(rows, **long) for _ in range(5)
        )
        self.active = torch.zeros(rows, device=device, dtype=torch.bool)
        self.out = torch.zeros(rows, max_new_tokens + block, **long)
        self.accepted = torch.zeros(rows, max_new_tokens + 1, **long)
        self.row_index = torch.arange(rows, device=device).unsqueeze(1)
        context = len(self.target.layer_ids) * self.target.embed.shape[1]
        self.pending = torch.zeros(rows, block, context, device=device, dtype=self.target.dtype)
        self.pending_start = torch.zeros(rows, **long)
        self.prompt_ids = torch.zeros(rows, max_prompt, **long)
        self.prompt_len = torch.ones(rows, **long)
        self.prompt_positions = torch.arange(max_prompt, **long).expand(rows, max_prompt)
        self.real = torch.zeros(rows, device=device, dtype=torch.bool)
        self.any_active = torch.zeros(1, dtype=torch.bool, device=device)
        self.host_flag = torch.zeros(1, dtype=torch.bool, pin_memory=on_cuda)
        # compiled with the kernels: some thirty tiny ops of bookkeeping become a few kernels
        self.emit = self.kernels.wrap(self._emit) if self.kernels.compiled else self._emit
        self._graph: dict[str, torch.cuda.CUDAGraph] = {}

    # ---- one step / round: tensor ops on the state only ------------------------------------------

    def _emit(self, tokens: torch.Tensor, proposals: torch.Tensor | None = None) -> torch.Tensor:
        """Accept the drafts that match the target's tokens (none without `proposals`), append
        tokens[:, :accepted+1] per active row (cut at a stop token and at the budget), log the round,
        advance the anchor; returns each row's count, which is also what the target keeps."""
        if proposals is None:
            accepted = torch.zeros_like(self.start)
        else:
            accepted = (proposals == tokens[:, : proposals.shape[1]]).long().cumprod(1).sum(1)
        offsets = self.offsets[: tokens.shape[1]]
        within = offsets <= accepted.unsqueeze(1)
        stop = torch.isin(tokens, self.stop_ids) & within
        stopped = stop.any(1)
        last = torch.where(stopped, stop.int().argmax(1), accepted)  # index of the last kept token
        count = torch.minimum(last + 1, self.budget - self.emitted)
        count = torch.where(self.active, count, torch.zeros_like(count))
        slots = self.emitted.unsqueeze(1) + offsets
        old = self.out[self.row_index, slots]
        self.out[self.row_index, slots] = torch.where(self.active.unsqueeze(1), tokens, old)
        self.accepted[self.row_index[:, 0], self.round] = torch.where(self.active, accepted, -1)
        self.round.add_(self.active.long())
        self.start.add_(count)
        self.anchor.copy_(
            torch.where(self.active, tokens.gather(1, last.unsqueeze(1)).squeeze(1), self.anchor)
        )
        self.emitted.add_(count)
        self.active.logical_and_(~stopped & (self.emitted < self.budget))
        self.any_active.copy_(self.active.any().view(1))
        return count

    def target_step(self) -> None:
        """One target-only decode step over the device state (what decode(speculative=False) repeats)."""
        step = self.target.hidden(
            self.anchor.unsqueeze(1), self.start.unsqueeze(1), self.kernels, features=False
        )
        logits = self.target.logits(step.hidden, self.kernels)
        self.target.commit(step.pending, self.emit(logits.argmax(-1)))
        self.host_flag.copy_(self.any_active, non_blocking=True)

    def speculative_round(self) -> None:
        """One draft-and-verify round over the device state (what decode(speculative=True) repeats)."""
        k = self.kernels
        drafter = self.drafter
        assert drafter is not None  # decode() runs speculative rounds only with a drafter
        drafter.extend(self.pending, self.pending_start, k)
        proposals = drafter.proposals(self.anchor, self.start, k)
        where = self.start.unsqueeze(1) + self.offsets
        verify = self.target.hidden(torch.cat([self.anchor.unsqueeze(1), proposals], 1), where, k)
        targets = self.target.logits(verify.hidden, k).argmax(-1)  # the target's token for start+1..start+B
        assert verify.features is not None  # asked for (features=True)
        self.pending.copy_(verify.features)
        self.pending_start.copy_(self.start)
        self.target.commit(verify.pending, self.emit(targets, proposals))
        self.host_flag.copy_(self.any_active, non_blocking=True)

    # ---- prefill (eager, once per call) -----------------------------------------------------------

    def _prefill_step(self, speculative: bool) -> None:
        """The prompts (right-padded to max_prompt) through the target: its first token, the drafter's
        context when speculative, and a fresh state (eager kernels: one shape, run once per decode)."""
        where = self.prompt_positions
        self.target.reset()
        prefill = self.target.hidden(self.prompt_ids, where, features=speculative, lengths=self.prompt_len)
        last = prefill.hidden[self.row_index[:, 0], self.prompt_len - 1]
        first = self.target.logits(last).argmax(-1)
        if speculative:
            assert self.drafter is not None and prefill.features is not None  # decode() checked
            self.drafter.refresh()
            self.drafter.extend(prefill.features, torch.zeros_like(self.prompt_len))  # where: 0..
        self.start.copy_(self.prompt_len)
        self.anchor.copy_(first)
        self.out[:, 0] = first
        self.emitted.fill_(1)
        self.round.zero_()
        self.active.copy_(self.real & ~torch.isin(first, self.stop_ids) & (self.emitted < self.budget))
        self.pending.zero_()
        self.pending_start.copy_(self.prompt_len)
        self.any_active.copy_(self.active.any().view(1))
        self.host_flag.copy_(self.any_active, non_blocking=True)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> None:
        """Load `prompts` and run their prefill: the state a decode's first step starts from."""
        if not 0 < len(prompts) <= self.rows:
            raise ValueError(f"{len(prompts)} prompts for a decoder of {self.rows} rows")
        longest = max(len(p) for p in prompts)
        if longest > self.max_prompt or max_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"prompt of {longest} tokens / {max_new_tokens} new tokens exceeds the decoder's "
                f"{self.max_prompt} / {self.max_new_tokens}"
            )
        rows = list(prompts) + [prompts[0]] * (self.rows - len(prompts))
        self.prompt_ids.copy_(torch.tensor([list(p) + [0] * (self.max_prompt - len(p)) for p in rows]))
        self.prompt_len.copy_(torch.tensor([len(p) for p in rows]))
        self.real.copy_(torch.arange(self.rows) < len(prompts))
        self.budget.fill_(max_new_tokens)
        name = "prefill-speculative" if speculative else "prefill-target"
        self.runner(name, lambda: self._prefill_step(speculative))()

    # ---- the host loop ----------------------------------------------------------------------------

    def runner(self, name: str, step):
        """`step` as the loop runs it: its CUDA graph's replay (captured once per name), or itself."""
        if not self.graphs:
            return step
        if name not in self._graph:
            self._graph[name] = self._capture(step)
        return self._graph[name].replay

    @torch.no_grad()
    def _capture(self, step) -> torch.cuda.CUDAGraph:
        """Warm up (compiles, cuBLAS workspaces) on a side stream, then capture one step. Both mutate
        the state, which the next prefill resets."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            step()
        torch.cuda.synchronize(self.device)
        return graph

    def prepare(self, prompts: list[list[int]], speculative: bool = True) -> None:
        """Capture the graphs (and compile) now, so the first timed decode does not pay for it."""
        with torch.no_grad():
            self.prefill(prompts[: self.rows], 1, False)
            self.runner("target", self.target_step)
            if speculative and self.drafter is not None:
                self.prefill(prompts[: self.rows], 1, True)
                self.runner("speculative", self.speculative_round)

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool) -> Batch:
        """Decode `prompts` (at most `rows`) greedily; results in prompt order."""
        if speculative and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        step = (
            self.runner("speculative", self.speculative_round)
            if speculative
            else self.runner("target", self.target_step)
        )
        self.sync()
        t0 = time.perf_counter()
        self.prefill(prompts, max_new_tokens, speculative)
        iterations = 0
        while iterations <= max_new_tokens:  # every round emits at least one token per active row
            self.sync()
            if not bool(self.host_flag[0]):
                break
            step()
            iterations += 1
        seconds = time.perf_counter() - t0
        out, emitted = self.out.cpu(), self.emitted.tolist()
        accepted, rounds = self.accepted.cpu(), self.round.tolist()
        results = [
            Decoded(
                tokens=out[r, : emitted[r]].tolist(),
                seconds=seconds,
                accepted=accepted[r, : rounds[r]].tolist() if speculative else [],
            )
            for r in range(len(prompts))
        ]
        return Batch(results=results, seconds=seconds, rounds=iterations)

    def sync(self) -> None:
        """Wait for the decoder's stream (the one host sync a decode iteration pays)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
