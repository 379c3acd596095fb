"""q/k/v and gate/up fused into one matrix each: the model's parameters become views of it, the HF
forward and the static loop give what they gave unfused, and a model moved afterwards falls back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.data.target import load_target, tiny_target
from trainer.fused_projections import DELTA_INPUTS, GATE_UP, INPUTS, QKV, fuse_projections, fused_rows
from trainer.infer.static_decode import StaticTarget, rowwise_linear


def _model(spec: str):
    return tiny_target("cpu", torch.float32, 0, {"initializer_range": 0.05}, spec)


def _static_hidden(model, ids):
    static = StaticTarget(model, [1], rows=1, positions=ids.shape[1])
    where = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return static.hidden(ids, where, lengths=torch.tensor([ids.shape[1]])).hidden


@pytest.mark.parametrize("spec", ["tiny-random", "tiny-random-hybrid"])
def test_fused_weights_are_views_and_change_no_output(spec):
    plain, fused = _model(spec), _model(spec)
    assert fuse_projections(fused) > 0
    ids = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    for layer in fused.get_decoder().layers:
        mlp = layer.mlp
        whole = fused_rows(mlp, GATE_UP, [mlp.gate_proj, mlp.up_proj])
        assert (
            whole is not None
            and whole.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
        )
        if hasattr(layer, "linear_attn"):
            mixer = layer.linear_attn
            assert fused_rows(mixer, INPUTS, [getattr(mixer, n) for n in DELTA_INPUTS]) is not None
        if hasattr(layer, "self_attn"):
            attn = layer.self_attn
            assert fused_rows(attn, QKV, [attn.q_proj, attn.k_proj, attn.v_proj]) is not None
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(_static_hidden(fused, ids), _static_hidden(plain, ids), rtol=1e-5, atol=1e-5)
    assert fuse_projections(fused) == 0  # once is enough
    assert list(fused.state_dict()) == list(plain.state_dict())  # nothing new is saved


def test_load_target_fuses_and_a_moved_model_decodes_unfused():
    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=[1], seed=0)
    attn = target.model.get_decoder().layers[0].self_attn
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert fused_rows(attn, QKV, projections) is not None
    moved = target.model.to(torch.float64)  # fresh storage per parameter: the views are gone
    assert fused_rows(attn, QKV, projections) is None
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = moved(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(_static_hidden(moved, ids), hf, rtol=1e-9, atol=1e-9)


def test_rowwise_linear_is_linear_for_one_row_and_several():
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    for rows in (1, 3):
        x = torch.randn(1, rows, 16, generator=gen)
        torch.testing.assert_close(rowwise_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rowwise_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drop_v_bias", [False, True])
def test_fused_qkv_keeps_biases_and_a_mix_of_biased_and_unbiased_stays_apart(drop_v_bias):
    model = tiny_target("cpu", torch.float32, 0, {"initializer_range": 0.05, "attention_bias": True})
    for layer in model.get_decoder().layers:
        torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
        torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
        if drop_v_bias:
            layer.self_attn.v_proj.bias = None
    assert fuse_projections(model) > 0
    ids = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(_static_hidden(model, ids), hf, rtol=1e-5, atol=1e-5)
