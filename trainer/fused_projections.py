"""One weight matrix for q/k/v (a Gated DeltaNet layer: its four input projections) and one for the
MLP's gate/up of every target layer, so a decode step reads a layer's weights in four matrix-vector
products (qkv, o, gate_up, down) instead of six, a Gated DeltaNet layer's in four instead of seven.

The model's own parameters become row-slices (views) of the fused matrices: no second copy of the
weights, and the HF forward reads the same values as before. Fuse once, where the model will stay,
before any thread uses it (load_target does). A model moved afterwards gets fresh storage per
parameter; `fused_rows` then finds the views broken and decoding multiplies the parts separately.
"""

from __future__ import annotations

import torch

QKV = "fused_qkv_weight"
GATE_UP = "fused_gate_up_weight"
INPUTS = "fused_inputs_weight"  # Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
DELTA_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def fuse_projections(model) -> int:
    """Fuse q/k/v and gate/up of every decoder layer of `model` (an HF causal LM); how many fused."""
    fused = 0
    for layer in model.get_decoder().layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        mixer = getattr(layer, "linear_attn", None)
        if attn is not None and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
            fused += _fuse(attn, QKV, [attn.q_proj, attn.k_proj, attn.v_proj])
        if mixer is not None and all(hasattr(mixer, n) for n in DELTA_INPUTS):
            fused += _fuse(mixer, INPUTS, [getattr(mixer, n) for n in DELTA_INPUTS])
        if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj")):
            fused += _fuse(mlp, GATE_UP, [mlp.gate_proj, mlp.up_proj])
    return fused


def _fuse(owner: torch.nn.Module, name: str, linears: list[torch.nn.Linear]) -> int:
    if fused_rows(owner, name, linears) is not None:
        return 0  # already fused
    weights = [linear.weight for linear in linears]
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return 0
    whole = torch.cat([w.detach() for w in weights])
    at = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = whole[at : at + rows]  # the old storage is freed: one copy remains
        at += rows
    owner.__dict__[name] = whole  # a plain attribute: not a parameter, not in the state dict
    return 1


def fused_rows(owner: torch.nn.Module, name: str, linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The fused matrix whose row-slices `linears`' weights still are, else None."""
    whole = owner.__dict__.get(name)
    if whole is None:
        return None
    at = 0
    for linear in linears:
        w = linear.weight
        rows = w.shape[0]
        if w.device != whole.device or w.data_ptr() != whole[at : at + rows].data_ptr():
            return None
        at += rows
    return whole if at == whole.shape[0] else None
