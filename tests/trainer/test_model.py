"""The drafter module: state layout, frozen target weights, what each block can see, both backends."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trainer.loss import block_labels, dflash_loss
from trainer.masks import build_block_mask, dense_mask
from trainer.model import DFlashDrafter, DrafterConfig
from tests.trainer.conftest import run_in_threads

VOCAB, HIDDEN, BLOCK, CTX = 64, 32, 4, 24


def small_config(**overrides) -> DrafterConfig:
    values = dict(hidden_size=HIDDEN, intermediate_size=48, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                  target_layer_ids=[0, 2], block_size=BLOCK, num_target_layers=4)
    values.update(overrides)
    return DrafterConfig(**values)


def target_parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(VOCAB, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.2)
    return embed, head


def make_drafter(seed=0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    embed, head = target_parts(seed)
    drafter = DFlashDrafter(small_config(**overrides), embed, head)
    # Non-trivial norm weights, so a missing or misplaced norm changes the output.
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return drafter


def make_batch(seed=0, batch=2, num_blocks=5, pad_blocks=1):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(batch, CTX, 2 * HIDDEN, generator=g)
    input_ids = torch.randint(0, VOCAB - 1, (batch, CTX), generator=g)
    anchors = torch.stack([torch.randperm(CTX - 1, generator=g)[:num_blocks].sort().values
                           for _ in range(batch)])
    valid = torch.ones(batch, num_blocks, dtype=torch.bool)
    if pad_blocks:
        valid[:, -pad_blocks:] = False
        anchors[:, -pad_blocks:] = 0
    return context, input_ids, anchors, valid


def run_sdpa(drafter, context, input_ids, anchors, valid):
    mask = dense_mask(anchors, valid, context.shape[1], BLOCK, "cpu")
    return drafter(context, input_ids, anchors, mask, backend="sdpa")


EXPORT_NAMES = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "input_layernorm", "post_attention_layernorm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def test_state_dict_is_exactly_the_export_layout():
    drafter = make_drafter()
    state = drafter.state_dict()
    assert sorted(state) == sorted(EXPORT_NAMES)
    assert state["fc.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert state["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, HIDDEN)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, HIDDEN)
    assert state["layers.1.self_attn.k_norm.weight"].shape == (8,)
    assert sorted(n for n, _ in drafter.named_parameters()) == sorted(EXPORT_NAMES)


def test_target_weights_are_used_frozen_and_never_modified():
    embed, head = target_parts()
    before = embed.weight.detach().clone()
    drafter = DFlashDrafter(small_config(), embed, head).double()
    assert drafter.embed_weight.dtype == torch.float64
    assert drafter.lm_head_weight.dtype == torch.float64
    assert embed.weight.dtype == torch.float32 and torch.equal(embed.weight, before)
    assert all(p.dtype == torch.float64 for p in drafter.parameters())
    assert not any(p is embed.weight or p is head.weight for p in drafter.parameters())
    hidden = torch.randn(1, 3, HIDDEN, dtype=torch.float64)
    assert torch.allclose(drafter.logits(hidden), hidden @ head.weight.double().T)


def test_block_input_is_anchor_then_mask_tokens():
    drafter = make_drafter()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    anchors = torch.tensor([[1, 4]])
    m = VOCAB - 1
    assert drafter.block_token_ids(input_ids, anchors).tolist() == [[[6, m, m, m], [9, m, m, m]]]


def per_block(hidden, num_blocks):
    return hidden.view(hidden.shape[0], num_blocks, BLOCK, -1)


def test_a_block_sees_only_context_strictly_before_its_anchor():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=0)
    base = per_block(run_sdpa(drafter, context, input_ids, anchors, valid), 5)
    b, n = 0, 2
    a = int(anchors[b, n])
    # Everything from the anchor's own target position onwards is invisible to this block.
    later = context.clone()
    later[b, a:] += 10 * torch.randn_like(later[b, a:])
    after = per_block(run_sdpa(drafter, later, input_ids, anchors, valid), 5)
    assert torch.allclose(after[b, :n + 1], base[b, :n + 1], atol=1e-6)
    # ...but the position right before the anchor is seen.
    just_before = context.clone()
    just_before[b, a - 1] += 10
    moved = per_block(run_sdpa(drafter, just_before, input_ids, anchors, valid), 5)
    assert not torch.allclose(moved[b, n], base[b, n], atol=1e-3)


def test_blocks_do_not_see_each_other():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=0)
    base = per_block(run_sdpa(drafter, context, input_ids, anchors, valid), 5)
    other = input_ids.clone()
    other[0, anchors[0, 3]] = (other[0, anchors[0, 3]] + 1) % (VOCAB - 1)  # block 3's anchor token
    changed = per_block(run_sdpa(drafter, context, other, anchors, valid), 5)
    keep = [0, 1, 2, 4]
    assert torch.allclose(changed[0, keep], base[0, keep], atol=1e-6)
    assert not torch.allclose(changed[0, 3], base[0, 3], atol=1e-3)
    # the mask-token rows of block 3 see its anchor token
    assert not torch.allclose(changed[0, 3, -1], base[0, 3, -1], atol=1e-3)


def test_padding_blocks_give_no_nan_and_no_loss():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=2)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    hidden = run_sdpa(drafter, context, input_ids, anchors, valid)
    assert torch.isfinite(hidden).all()
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, BLOCK)
    assert not label_mask[~valid].any()
    loss, _ = dflash_loss(drafter.logits(hidden), labels, label_mask, 7.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    # Whatever sits in a padding block changes neither the valid blocks nor the loss.
    moved = anchors.clone()
    moved[~valid] = 7
    hidden2 = run_sdpa(drafter, context, input_ids, moved, valid)
    pv = per_block(hidden, 5)
    assert torch.allclose(per_block(hidden2, 5)[valid], pv[valid], atol=1e-6)
    loss2, _ = dflash_loss(drafter.logits(hidden2), labels, label_mask, 7.0)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)


def test_all_padding_batch_trains_nothing():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=5)
    hidden = run_sdpa(drafter, context, input_ids, anchors, valid)
    labels, label_mask = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool),
                                      anchors, valid, BLOCK)
    loss, acc = drafter.loss(hidden, labels, label_mask, 7.0)
    loss.backward()
    assert loss.item() == 0.0 and (acc == 0).all()
    assert all((p.grad == 0).all() for p in drafter.parameters())


def test_sdpa_training_reaches_every_weight_and_learns():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=1)
    labels, label_mask = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool),
                                      anchors, valid, BLOCK)
    opt = torch.optim.Adam(drafter.parameters(), lr=5e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss, _ = drafter.loss(run_sdpa(drafter, context, input_ids, anchors, valid),
                               labels, label_mask, 7.0)
        loss.backward()
        if not losses:
            missing = [n for n, p in drafter.named_parameters()
                       if p.grad is None or not (p.grad != 0).any()]
            assert missing == []
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_drafter_matches_fp32_within_bf16_tolerance():
    # GPU training runs the drafter (and the frozen target weights) in bf16.
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch(pad_blocks=1)
    labels, label_mask = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool),
                                      anchors, valid, BLOCK)
    loss32, _ = drafter.loss(run_sdpa(drafter, context, input_ids, anchors, valid),
                             labels, label_mask, 7.0)
    half = copy.deepcopy(drafter).to(dtype=torch.bfloat16)
    assert half.lm_head_weight.dtype == torch.bfloat16
    hidden = run_sdpa(half, context.to(torch.bfloat16), input_ids, anchors, valid)
    assert hidden.dtype == torch.bfloat16
    loss16, acc16 = half.loss(hidden, labels, label_mask, 7.0)
    loss16.backward()
    assert loss16.item() == pytest.approx(loss32.item(), rel=2e-2)
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in half.parameters())


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="mask_token_id"):
        small_config(mask_token_id=VOCAB)
    with pytest.raises(ValueError, match="num_kv_heads"):
        small_config(num_kv_heads=3)
    with pytest.raises(ValueError, match="target_layer_ids"):
        small_config(target_layer_ids=[])
    with pytest.raises(ValueError, match="block_size"):
        small_config(block_size=1)
    cfg = small_config()
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_drafter_threads_on_one_device_agree_with_a_single_thread():
    drafter = make_drafter()
    batches = [make_batch(seed=s) for s in range(3)]
    with torch.no_grad():
        expected = [run_sdpa(drafter, *b) for b in batches]
    replicas = [copy.deepcopy(drafter) for _ in batches]
    results = [None] * 3

    def work(i):
        with torch.no_grad():
            for _ in range(3):
                results[i] = run_sdpa(replicas[i], *batches[i])

    assert not run_in_threads(3, work)
    for got, want in zip(results, expected):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def flex_vs_sdpa():
    """One compiled-flex forward (CPU compiles take seconds; do it once for this file)."""
    from torch._dynamo.utils import counters

    drafter = make_drafter(seed=1)
    batches = [make_batch(seed=s, pad_blocks=1) for s in (5, 6)]
    out = []
    with torch.no_grad():  # torch refuses flex_attention backward on CPU
        for context, input_ids, anchors, valid in batches:
            block_mask = build_block_mask(anchors, valid, CTX, BLOCK, "cpu")
            graphs_before = counters["stats"]["unique_graphs"]
            flex = drafter(context, input_ids, anchors, block_mask, backend="flex")
            new_graphs = counters["stats"]["unique_graphs"] - graphs_before
            sdpa = run_sdpa(drafter, context, input_ids, anchors, valid)
            ref64 = run_sdpa(copy.deepcopy(drafter).double(), context.double(), input_ids,
                             anchors, valid)
            out.append((flex, sdpa, ref64, new_graphs))
    return out


def test_compiled_flex_forward_equals_sdpa(flex_vs_sdpa):
    for flex, sdpa, _, _ in flex_vs_sdpa:
        assert torch.isfinite(flex).all()
        assert torch.allclose(flex, sdpa, atol=2e-5, rtol=1e-4)


def test_both_backends_match_a_float64_forward(flex_vs_sdpa):
    for flex, sdpa, ref64, _ in flex_vs_sdpa:
        assert torch.allclose(flex.double(), ref64, atol=5e-5, rtol=1e-4)
        assert torch.allclose(sdpa.double(), ref64, atol=5e-5, rtol=1e-4)


def test_a_new_mask_with_the_same_shapes_does_not_recompile(flex_vs_sdpa):
    # The BlockMask (and its mask_mod closure) is rebuilt every step; that must not recompile.
    assert flex_vs_sdpa[1][3] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_cuda_flex_and_sdpa_give_the_same_loss_and_gradients(dtype, tol):
    device = "cuda"
    context, input_ids, anchors, valid = (t.to(device) for t in make_batch(seed=9, pad_blocks=1))
    labels, label_mask = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool),
                                      anchors, valid, BLOCK)
    results = {}
    for backend in ("flex", "sdpa"):
        # flex_attention's GPU kernels need head_dim >= 16
        drafter = make_drafter(seed=2, head_dim=16).to(device=device, dtype=dtype)
        build = build_block_mask if backend == "flex" else dense_mask
        mask = build(anchors, valid, CTX, BLOCK, device)
        hidden = drafter(context.to(dtype), input_ids, anchors, mask, backend=backend)
        loss, acc = drafter.loss(hidden, labels, label_mask, 7.0)
        loss.backward()
        results[backend] = (loss.float(), acc, {n: p.grad.float() for n, p in drafter.named_parameters()})
    (lf, _, gf), (ls, _, gs) = results["flex"], results["sdpa"]
    assert torch.allclose(lf, ls, rtol=tol)
    for name in gs:
        rel = (gf[name] - gs[name]).norm() / gs[name].norm().clamp_min(1e-12)
        assert rel < tol, (name, rel.item())


def test_the_trainer_offers_only_its_own_attention_and_takes_a_benchmark_function():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch()
    mask = dense_mask(anchors, valid, input_ids.shape[1], drafter.cfg.block_size, "cpu")
    with pytest.raises(ValueError, match="use one of flex, sdpa"):
        drafter(context, input_ids, anchors, mask, backend="flex_eager")

    def sdpa_by_hand(q, k, v, attn_mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)

    by_hand = drafter(context, input_ids, anchors, mask, backend=sdpa_by_hand)
    assert torch.equal(by_hand, run_sdpa(drafter, context, input_ids, anchors, valid))


def test_compiled_layers_equal_eager_and_share_one_graph_across_layers_and_replicas(monkeypatch):
    """compile_layers compiles every decoder layer in place: same loss and gradients as eager, the
    same state_dict names, and ONE graph for all layers of all replicas (plus one for the first
    layer, whose input needs no grad) - a graph per layer would hit dynamo's recompile limit and
    silently fall back to eager. aot_eager keeps the compile cheap on a CPU; CUDA uses inductor."""
    from trainer import compile_modes
    from torch._dynamo.utils import counters

    monkeypatch.setattr(compile_modes, "compile_options",
                        lambda: {"dynamic": False, "fullgraph": True, "backend": "aot_eager"})
    torch._dynamo.reset()
    counters.clear()
    context, input_ids, anchors, valid = make_batch(seed=3)
    mask = dense_mask(anchors, valid, CTX, BLOCK, "cpu")
    trained = torch.ones_like(input_ids, dtype=torch.bool)
    labels, label_mask = block_labels(input_ids, trained, anchors, valid, BLOCK)

    def loss_and_grads(model):
        loss, _ = model.loss(model(context, input_ids, anchors, mask, "sdpa"), labels, label_mask, 4.0)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = make_drafter(seed=1, num_layers=4)
    replicas = [copy.deepcopy(eager) for _ in range(2)]
    ref_loss, ref_grads = loss_and_grads(eager)
    for replica in replicas:
        replica.compile_layers = True
        loss, grads = loss_and_grads(replica)
        assert torch.allclose(loss, ref_loss, rtol=1e-5)
        for name, grad in grads.items():
            assert torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6), name
        assert list(replica.state_dict()) == list(eager.state_dict())
    assert all(layer._compiled_call_impl is not None for layer in replicas[0].layers)
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_layers_compile_by_default_only_for_flex_on_cuda():
    drafter = make_drafter()
    context, input_ids, anchors, valid = make_batch()
    drafter(context, input_ids, anchors, dense_mask(anchors, valid, CTX, BLOCK, "cpu"), "sdpa")
    assert drafter.compile_layers == "auto" and not drafter._layers_compiled
    assert all(layer._compiled_call_impl is None for layer in drafter.layers)
