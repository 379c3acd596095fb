"""Block labels and the DFlash loss, against hand-computed values and first-principles rules."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (IGNORE_INDEX, block_labels, dflash_loss, dflash_loss_fused,
                          position_weights)


def test_block_labels_hand_example():
    # token at position p is 100 + p, so a label names the position it came from
    input_ids = (100 + torch.arange(12)).unsqueeze(0)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 2:10] = True
    anchors = torch.tensor([[1, 5, 9, 0]])
    valid = torch.tensor([[True, True, True, False]])
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, block_size=4)
    x = IGNORE_INDEX
    assert labels.tolist() == [[
        [x, 102, 103, 104],   # anchor 1 predicts positions 2, 3, 4
        [x, 106, 107, 108],   # anchor 5 predicts 6, 7, 8
        [x, x, x, x],         # anchor 9: 10 and 11 are not trained, 12 is past the end
        [x, x, x, x],         # padding block
    ]]
    assert torch.equal(label_mask, labels != IGNORE_INDEX)


def test_block_labels_random_against_definition():
    g = torch.Generator().manual_seed(0)
    batch, seq_len, num_blocks, block = 3, 30, 7, 5
    input_ids = torch.randint(0, 1000, (batch, seq_len), generator=g)
    loss_mask = torch.rand(batch, seq_len, generator=g) > 0.25
    anchors = torch.randint(0, seq_len, (batch, num_blocks), generator=g)
    valid = torch.rand(batch, num_blocks, generator=g) > 0.2
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, block)
    for b in range(batch):
        for n in range(num_blocks):
            a = int(anchors[b, n])
            for k in range(block):
                p = a + k  # block position k is trained to produce the token at anchor + k
                counts = bool(valid[b, n]) and k >= 1 and p < seq_len and bool(loss_mask[b, p])
                assert bool(label_mask[b, n, k]) == counts, (b, n, k)
                expected = int(input_ids[b, p]) if counts else IGNORE_INDEX
                assert int(labels[b, n, k]) == expected, (b, n, k)


def test_an_oracle_drafter_scores_perfectly():
    # Logits that put all mass on the true token at anchor + k must give acc 1 and loss ~0.
    # Any off-by-one between positions and labels turns this into acc ~0.
    g = torch.Generator().manual_seed(1)
    vocab, block, seq_len = 50, 4, 40
    input_ids = torch.randint(0, vocab, (2, seq_len), generator=g)
    loss_mask = torch.ones(2, seq_len, dtype=torch.bool)
    anchors = torch.tensor([[3, 10, 20], [0, 17, 30]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    logits = torch.zeros(2, 3 * block, vocab)
    for b in range(2):
        for n in range(3):
            for k in range(block):
                logits[b, n * block + k, input_ids[b, int(anchors[b, n]) + k]] = 50.0
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, block)
    loss, acc = dflash_loss(logits, labels, label_mask, gamma=7.0)
    assert acc.tolist() == [1.0, 1.0, 1.0]
    assert loss.item() < 1e-6


def hand_batch():
    """B=1, two blocks of 4, vocab 3; logits chosen so each CE is a closed form."""
    ln2 = math.log(2.0)
    junk = [100.0, -100.0, 7.0]  # position 0 rows: never trained, must not matter
    logits = torch.tensor([[
        junk, [0.1, 0.0, 0.0], [ln2, 0.0, 0.0], [ln2, 0.0, 0.0],     # block 0
        junk, [0.0, ln2, 0.0], [5.0, 1.0, 2.0], [1.0, 2.0, 3.0],     # block 1
    ]])
    x = IGNORE_INDEX
    labels = torch.tensor([[[x, 1, 0, 2], [x, 1, x, x]]])
    return logits, labels, labels != IGNORE_INDEX


def test_dflash_loss_hand_computed():
    logits, labels, label_mask = hand_batch()
    gamma = 2.0
    w1, w2, w3 = 1.0, math.exp(-1 / gamma), math.exp(-2 / gamma)
    ce_b0 = [math.log(math.exp(0.1) + 2.0),   # softmax([0.1, 0, 0])[1]
             math.log(2.0),                   # softmax([ln2, 0, 0]) = [1/2, 1/4, 1/4], label 0
             math.log(4.0)]                   # same row, label 2
    ce_b1 = math.log(2.0)                     # softmax([0, ln2, 0])[1] = 1/2
    expected = (w1 * ce_b0[0] + w2 * ce_b0[1] + w3 * ce_b0[2] + w1 * ce_b1) / (w1 + w2 + w3 + w1)
    loss, acc = dflash_loss(logits, labels, label_mask, gamma)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # position 1: block 0 wrong (argmax 0, label 1), block 1 right; positions 2, 3: block 0 only
    assert acc.tolist() == pytest.approx([0.5, 1.0, 0.0])


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0].item() == 1.0
    assert w[14].item() == pytest.approx(math.exp(-2.0))
    ratios = w[1:] / w[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, math.exp(-1 / 7.0)))


def test_nothing_to_train_gives_zero_loss_and_no_nan():
    logits = torch.randn(1, 8, 5, requires_grad=True)
    labels = torch.full((1, 2, 4), IGNORE_INDEX)
    label_mask = torch.zeros(1, 2, 4, dtype=torch.bool)
    loss, acc = dflash_loss(logits, labels, label_mask, 7.0)
    loss.backward()
    assert loss.item() == 0.0
    assert acc.tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(logits.grad).all() and (logits.grad == 0).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_loss_equals_full_logits_loss(with_bias):
    g = torch.Generator().manual_seed(3)
    batch, num_blocks, block, hidden, vocab = 2, 3, 5, 8, 11
    h = torch.randn(batch, num_blocks * block, hidden, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) if with_bias else None
    label_mask = torch.rand(batch, num_blocks, block, generator=g) > 0.3
    label_mask[:, :, 0] = False
    labels = torch.randint(0, vocab, (batch, num_blocks, block), generator=g)
    labels = torch.where(label_mask, labels, torch.full_like(labels, IGNORE_INDEX))

    h_full = h.clone().requires_grad_(True)
    logits = torch.nn.functional.linear(h_full, weight, bias)
    loss_full, acc_full = dflash_loss(logits, labels, label_mask, 3.0)
    loss_full.backward()

    h_fused = h.clone().requires_grad_(True)
    # chunk of 5 rows over 24 trained rows: several chunks and a ragged last one
    loss_fused, acc_fused = dflash_loss_fused(h_fused, weight, labels, label_mask, 3.0,
                                              bias=bias, chunk_rows=5)
    (2.5 * loss_fused).backward()  # upstream gradient other than 1 must scale the result

    assert loss_fused.item() == pytest.approx(loss_full.item(), rel=1e-12)
    assert torch.equal(acc_fused, acc_full)
    assert torch.allclose(h_fused.grad, 2.5 * h_full.grad, rtol=1e-10, atol=1e-12)
    assert (h_fused.grad.view(batch, num_blocks, block, hidden)[:, :, 0] == 0).all()


def test_fused_loss_without_grad():
    h = torch.randn(1, 8, 4)
    weight = torch.randn(6, 4)
    labels = torch.tensor([[[IGNORE_INDEX, 1, 2, 3], [IGNORE_INDEX, 0, 5, IGNORE_INDEX]]])
    with torch.no_grad():
        loss, acc = dflash_loss_fused(h, weight, labels, labels != IGNORE_INDEX, 7.0)
        ref, ref_acc = dflash_loss(h @ weight.T, labels, labels != IGNORE_INDEX, 7.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.equal(acc, ref_acc)


# ---- the compiled chunk kernel (the CUDA default) -------------------------------------------------

def _loss_case(seed: int, batch=2, num_blocks=3, block=5, hidden=8, vocab=11, ignored_rows=(),
               dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, num_blocks * block, hidden, generator=g, dtype=dtype)
    weight = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    label_mask = torch.rand(batch, num_blocks, block, generator=g) > 0.3
    label_mask[:, :, 0] = False
    for b in ignored_rows:  # a sequence with nothing to train (all its positions ignored)
        label_mask[b] = False
    labels = torch.randint(0, vocab, (batch, num_blocks, block), generator=g)
    labels = torch.where(label_mask, labels, torch.full_like(labels, IGNORE_INDEX))
    return h, weight, labels, label_mask


def _reference(h, weight, labels, label_mask, gamma):
    h_ref = h.clone().requires_grad_(True)
    loss, acc = dflash_loss(torch.nn.functional.linear(h_ref, weight), labels, label_mask, gamma)
    loss.backward()
    return loss, acc, h_ref.grad


@pytest.fixture
def kernel_math(monkeypatch):
    """The compiled path with ce_chunk run eagerly: the chunking, padding and math, no compile."""
    import trainer.loss as loss_module

    monkeypatch.setattr(loss_module, "_compiled_ce_chunk", loss_module.ce_chunk)


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 64, None])
@pytest.mark.parametrize("ignored_rows", [(), (1,)])
def test_compiled_kernel_path_equals_the_full_logits_loss(kernel_math, chunk_rows, ignored_rows):
    # 2 x 3 x 4 = 24 trained rows: chunk 1 and 5 round up to 16 rows (a padded second chunk), 16
    # pads 8 rows, 64 is one padded chunk; a sequence with no label at all must not change anything.
    h, weight, labels, label_mask = _loss_case(4, ignored_rows=ignored_rows)
    ref_loss, ref_acc, ref_grad = _reference(h, weight, labels, label_mask, 3.0)
    h_k = h.clone().requires_grad_(True)
    loss, acc = dflash_loss_fused(h_k, weight, labels, label_mask, 3.0, chunk_rows=chunk_rows,
                                  kernel="compiled")
    (2.5 * loss).backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert torch.equal(acc, ref_acc)
    assert torch.allclose(h_k.grad, 2.5 * ref_grad, rtol=1e-10, atol=1e-12)


def test_compiled_kernel_path_with_nothing_to_train_gives_zero(kernel_math):
    h, weight, labels, label_mask = _loss_case(5, ignored_rows=(0, 1))
    h_k = h.clone().requires_grad_(True)
    loss, acc = dflash_loss_fused(h_k, weight, labels, label_mask, 7.0, chunk_rows=16, kernel="compiled")
    loss.backward()
    assert loss.item() == 0.0 and (acc == 0).all()
    assert torch.isfinite(h_k.grad).all() and (h_k.grad == 0).all()


def test_ce_chunk_compiles_whole_and_equals_the_eager_chunk(monkeypatch):
    """ce_chunk traced by dynamo in one graph (fullgraph, as on CUDA; aot_eager keeps it fast on a
    CPU) gives the eager chunk's loss, accuracy and gradient in fp32."""
    import trainer.loss as loss_module
    from trainer import compile_modes

    monkeypatch.setattr(loss_module, "_compiled_ce_chunk", None)
    monkeypatch.setattr(compile_modes, "compile_options",
                        lambda: {"dynamic": False, "fullgraph": True, "backend": "aot_eager"})
    h, weight, labels, label_mask = _loss_case(6, dtype=torch.float32)
    ref_loss, ref_acc, ref_grad = _reference(h.double(), weight.double(), labels, label_mask, 7.0)
    h_k = h.clone().requires_grad_(True)
    loss, acc = dflash_loss_fused(h_k, weight, labels, label_mask, 7.0, chunk_rows=16, kernel="compiled")
    loss.backward()
    assert loss_module._compiled_ce_chunk is not loss_module.ce_chunk  # it really went through torch.compile
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert torch.equal(acc, ref_acc)
    assert torch.allclose(h_k.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


def test_loss_kernel_defaults_to_triton_on_cuda_and_eager_elsewhere(monkeypatch):
    from trainer import loss_kernel
    from trainer.loss import even_chunks, loss_kernel_for

    monkeypatch.setattr(loss_kernel, "triton", object())
    assert loss_kernel_for("cuda:1") == "triton" and loss_kernel_for("cpu") == "eager"
    assert loss_kernel_for("cuda:0", "eager") == "eager" and loss_kernel_for("cpu", "compiled") == "compiled"
    monkeypatch.setattr(loss_kernel, "triton", None)  # the CPU wheel of torch: no Triton
    assert loss_kernel_for("cuda:1") == "compiled"
    with pytest.raises(ValueError, match="unknown"):
        loss_kernel_for("cpu", "cutlass")
    # paper dims: 512 anchors x 15 rows, vocab 151936 -> at most 883 rows: 10 x 768, no padding
    assert even_chunks(7680, (1 << 27) // 151936) == (768, 10)
    assert even_chunks(7680, 1766) == (1536, 5)
    assert even_chunks(24, 5) == (16, 2) and even_chunks(10, 64) == (16, 1)
    assert even_chunks(7000, 883) == (880, 8)  # no divisor without padding: the fewest chunks


def test_the_fused_loss_benchmark_checks_both_kernels_against_fp32_small(tmp_path):
    """benchmarks/fused_loss_check.py at tiny size on the CPU: both kernels within tolerance of the
    fp32 reference and of each other, written as markdown and json."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "fused.md"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "fused_loss_check.py"), "--small", "--repeats", "3",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["failures"] == [] and set(report["results"]) == {"eager", "compiled"}
    assert "all met." in out.read_text()
