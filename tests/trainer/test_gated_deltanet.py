"""The Gated DeltaNet layer's closed-form chunk (trainer/infer/gated_deltanet.py) against the recurrence
it solves, written out one token at a time in float64 from the module docstring:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

A pass must give every position's output from the state it started from, and `commit` must leave
exactly the state (and conv window) of the first `kept` tokens of each row, whatever the others kept."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trainer.infer import gated_deltanet as gdn

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, KERNEL = 12, 2, 4, 4, 3, 4
ATOL = 2e-5


def random_weights(seed: int = 0) -> gdn.DeltaNetWeights:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.4):
        return scale * torch.randn(*shape, generator=g)

    channels = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
    return gdn.DeltaNetWeights(
        in_qkv=r(channels, HIDDEN),
        in_z=r(VALUE_HEADS * VALUE_DIM, HIDDEN),
        in_b=r(VALUE_HEADS, HIDDEN),
        in_a=r(VALUE_HEADS, HIDDEN),
        conv=r(channels, KERNEL, scale=0.8),
        conv_bias=r(channels, scale=0.1),
        a_log=r(VALUE_HEADS, scale=0.5),
        dt_bias=r(VALUE_HEADS, scale=0.5),
        norm=1.0 + r(VALUE_DIM, scale=0.3),
        out=r(HIDDEN, VALUE_HEADS * VALUE_DIM),
        key_heads=KEY_HEADS,
        value_heads=VALUE_HEADS,
        key_dim=KEY_DIM,
        value_dim=VALUE_DIM,
        eps=1e-6,
    )


def cast(w: gdn.DeltaNetWeights, dtype) -> gdn.DeltaNetWeights:
    tensors = [f.name for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
    return dataclasses.replace(w, **{name: getattr(w, name).to(dtype) for name in tensors})


def l2n(t):
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def naive_row(x, w, conv_hist, state):
    """One row, token by token, in float64: (outputs [T, H], conv window [C, K-1], S [Hv, dk, dv])."""
    w = cast(w, torch.float64)
    hist, s = conv_hist.double().clone(), state.double().clone()
    width, repeat = KEY_HEADS * KEY_DIM, VALUE_HEADS // KEY_HEADS
    outs = []
    for x_t in x.double():
        window = torch.cat([hist, (w.in_qkv @ x_t)[:, None]], dim=1)
        c = F.silu((w.conv * window).sum(-1) + w.conv_bias)
        hist = window[:, 1:]
        q = l2n(c[:width].view(KEY_HEADS, KEY_DIM).repeat_interleave(repeat, 0)) * KEY_DIM**-0.5
        k = l2n(c[width : 2 * width].view(KEY_HEADS, KEY_DIM).repeat_interleave(repeat, 0))
        v = c[2 * width :].view(VALUE_HEADS, VALUE_DIM)
        beta = torch.sigmoid(w.in_b @ x_t)
        gate = -w.a_log.exp() * F.softplus(w.in_a @ x_t + w.dt_bias)
        o = torch.empty(VALUE_HEADS, VALUE_DIM, dtype=torch.float64)
        for h in range(VALUE_HEADS):
            s[h] = gate[h].exp() * s[h]
            u = beta[h] * (v[h] - s[h].T @ k[h])
            s[h] = s[h] + torch.outer(k[h], u)
            o[h] = s[h].T @ q[h]
        z = (w.in_z @ x_t).view(VALUE_HEADS, VALUE_DIM)
        normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + w.eps) * w.norm * F.silu(z)
        outs.append(w.out @ normed.flatten())
    return torch.stack(outs), hist, s


def random_state(w, rows, seed):
    g = torch.Generator().manual_seed(seed)
    conv, state = gdn.new_state(w, rows, "cpu", torch.float32)
    conv.copy_(torch.randn(conv.shape, generator=g))
    state.copy_(0.3 * torch.randn(state.shape, generator=g))
    return conv, state


def inputs(rows, length, seed):
    return torch.randn(rows, length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def close(a, b):
    return torch.allclose(a.double(), b.double(), atol=ATOL, rtol=1e-4)


def test_new_state_is_zero_with_the_layers_shapes_and_the_state_in_fp32():
    w = random_weights()
    conv, state = gdn.new_state(w, 3, "cpu", torch.bfloat16)
    assert conv.shape == (3, w.channels, KERNEL - 1) and conv.dtype == torch.bfloat16
    assert state.shape == (3, VALUE_HEADS, KEY_DIM, VALUE_DIM) and state.dtype == torch.float32
    assert not conv.any() and not state.any()
    assert w.kernel == KERNEL and w.channels == 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM


@pytest.mark.parametrize("start", ["empty", "mid-sequence"])
def test_one_pass_gives_every_position_of_the_recurrence_and_leaves_the_state_alone(start):
    w = random_weights(1)
    x = inputs(2, 9, seed=2)
    if start == "empty":
        conv, state = gdn.new_state(w, 2, "cpu", torch.float32)
    else:
        conv, state = random_state(w, 2, seed=3)
    conv0, state0 = conv.clone(), state.clone()
    out, pending = gdn.mix(x, w, conv, state)
    assert out.shape == (2, 9, HIDDEN)
    assert torch.equal(conv, conv0) and torch.equal(state, state0), "mix must not change the state"
    for row in range(2):
        expected, _, _ = naive_row(x[row], w, conv0[row], state0[row])
        assert close(out[row], expected)
    assert pending.keys.shape == (2, VALUE_HEADS, 9, KEY_DIM)
    assert pending.window.shape == (2, w.channels, KERNEL - 1 + 9)


def test_commit_keeps_each_rows_own_count_and_nothing_of_the_rest():
    w = random_weights(4)
    rows, length = 4, 7
    kept = torch.tensor([0, 1, 4, length])
    x = inputs(rows, length, seed=5)
    conv, state = random_state(w, rows, seed=6)
    conv0, state0 = conv.clone(), state.clone()
    _, pending = gdn.mix(x, w, conv, state)
    gdn.commit(pending, kept, conv, state)
    assert torch.equal(state[0], state0[0]) and torch.equal(conv[0], conv0[0]), "kept 0 changes nothing"
    for row in range(1, rows):
        n = int(kept[row])
        _, hist, s = naive_row(x[row, :n], w, conv0[row], state0[row])
        assert close(state[row], s), f"row {row}: the state after its first {n} tokens"
        assert close(conv[row], hist), f"row {row}: the conv window holds the inputs before token {n}"


def test_a_rejected_tail_never_reaches_the_next_pass():
    """Verify 5, keep 2, then continue: the same outputs as feeding only the 2 kept tokens first."""
    w = random_weights(7)
    x = inputs(1, 8, seed=8)
    conv, state = gdn.new_state(w, 1, "cpu", torch.float32)
    _, pending = gdn.mix(x[:, :5], w, conv, state)
    gdn.commit(pending, torch.tensor([2]), conv, state)
    after, _ = gdn.mix(x[:, 5:], w, conv, state)
    sequence = torch.cat([x[0, :2], x[0, 5:]])
    empty_conv, empty_state = gdn.new_state(w, 1, "cpu", torch.float32)
    expected, _, _ = naive_row(sequence, w, empty_conv[0], empty_state[0])
    assert close(after[0], expected[2:])


def test_run_goes_chunk_by_chunk_and_padding_changes_no_state():
    w = random_weights(9)
    length = gdn.CHUNK + 6  # two chunks, the second short
    lengths = torch.tensor([length, gdn.CHUNK - 3, 5])
    x = inputs(3, length, seed=10)
    conv, state = gdn.new_state(w, 3, "cpu", torch.float32)
    out = gdn.run(x, w, conv, state, lengths)
    assert out.shape == (3, length, HIDDEN)
    empty_conv, empty_state = gdn.new_state(w, 1, "cpu", torch.float32)
    for row in range(3):
        n = int(lengths[row])
        expected, hist, s = naive_row(x[row, :n], w, empty_conv[0], empty_state[0])
        assert close(out[row, :n], expected)
        assert close(state[row], s) and close(conv[row], hist)


def test_gated_rms_norm_is_rms_norm_over_the_head_dim_times_silu_of_the_gate():
    g = torch.Generator().manual_seed(11)
    x, gate = torch.randn(2, 5, 3, 6, generator=g), torch.randn(2, 5, 3, 6, generator=g)
    weight = torch.randn(6, generator=g)
    got = gdn.gated_rms_norm(x, gate, weight, 1e-6)
    rms = x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    expected = x.double() / rms * weight.double() * gate.double() * torch.sigmoid(gate.double())
    assert got.dtype == x.dtype and close(got, expected)
    half = gdn.gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.bfloat16(), 1e-6)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.double(), expected, atol=0.05, rtol=0.05)


def test_fp32_copy_copies_every_tensor_to_fp32_and_keeps_the_shape_numbers():
    w = random_weights()
    half = cast(w, torch.bfloat16)
    up = gdn.fp32_copy(half)
    tensors = [f.name for f in dataclasses.fields(up) if isinstance(getattr(up, f.name), torch.Tensor)]
    assert "conv_bias" in tensors and len(tensors) == 10
    assert all(getattr(up, name).dtype == torch.float32 for name in tensors)
    assert all(getattr(half, name).dtype == torch.bfloat16 for name in tensors), "a copy: the original stays"
    assert (up.key_heads, up.value_heads, up.key_dim, up.value_dim) == (
        KEY_HEADS,
        VALUE_HEADS,
        KEY_DIM,
        VALUE_DIM,
    )
