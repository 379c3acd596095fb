"""trainer.loss_kernel (the Triton chunk of the fused loss) against the eager chunk and through
dflash_loss_fused. Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is defined) runs it on
the CPU, so each check runs in a fresh interpreter process; on the H200, benchmarks/fused_loss_check.py
runs it compiled at paper dims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.conftest import triton_interpret

pytest.importorskip("triton")
pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def test_the_kernel_matches_the_eager_chunk_with_ties_ignored_rows_and_a_ragged_last_block():
    out = triton_interpret("""
        import torch
        from trainer import loss_kernel
        from trainer.loss import _ce_chunk_eager

        g = torch.Generator().manual_seed(0)
        for dtype, grad_tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
            rows, vocab = 23, 1000  # 1000 = 7 blocks of 128 and a ragged 104
            x = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
            x[5, 10] = x[5, 700] = x[5].max() + 1  # a tie across blocks: the first wins, as torch
            x[6, 130] = x[6, 131] = x[6].max() + 1  # and within one block
            targets = torch.randint(0, vocab, (rows,), generator=g)
            targets[5], targets[6], targets[3] = 10, 130, -100  # row 3 is ignored: weight 0
            weights = torch.rand(rows, generator=g)
            weights[3] = 0.0
            loss, correct, grad = loss_kernel.ce_chunk(x, targets, weights, {"BLOCK": 128, "num_warps": 4})
            want_loss, want_correct, want_grad = _ce_chunk_eager(x.clone(), targets, weights, True)
            assert grad.dtype == dtype and grad.shape == x.shape
            assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss)), (loss, want_loss)
            assert torch.equal(correct, want_correct) and bool(correct[5]) and bool(correct[6])
            assert not bool(correct[3])
            err = (grad.float() - want_grad.float()).abs().max().item()
            assert err <= grad_tol, (dtype, err)
            assert grad[3].abs().max().item() == 0.0
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_fused_loss_through_the_kernel_equals_the_eager_one():
    out = triton_interpret("""
        import torch
        from trainer.loss import dflash_loss_fused

        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(1, 6 * 4, 16, generator=g)
        weight = torch.randn(300, 16, generator=g) * 0.5
        label_mask = torch.rand(1, 6, 4, generator=g) > 0.2
        label_mask[:, :, 0] = False
        labels = torch.where(label_mask, torch.randint(0, 300, (1, 6, 4), generator=g), -100)
        results = {}
        for kernel in ("eager", "triton"):
            h = hidden.clone().requires_grad_(True)
            loss, acc = dflash_loss_fused(h, weight, labels, label_mask, 7.0, chunk_rows=5, kernel=kernel)
            loss.backward()
            results[kernel] = (loss.detach(), acc, h.grad)
        (la, aa, ga), (lb, ab, gb) = results["eager"], results["triton"]
        assert torch.allclose(la, lb, rtol=1e-6) and torch.equal(aa, ab), (la, lb, aa, ab)
        assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_fused_loss_benchmark_checks_the_triton_kernel_too(tmp_path):
    out = tmp_path / "fused.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fused_loss_check.py"), "--small", "--repeats", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=250,
        env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["failures"] == [] and set(report["results"]) == {"eager", "compiled", "triton"}
    assert set(report["between"]) == {"compiled", "triton"}
