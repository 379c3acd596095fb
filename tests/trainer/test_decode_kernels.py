"""decode_kernels' Triton products against their PyTorch reference, and the static loop decoding through
them. Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is defined) runs the kernels on the
CPU, so each check runs in a fresh interpreter process; on the H200 they run compiled."""

from __future__ import annotations

import pytest

from tests.trainer.conftest import triton_interpret

pytest.importorskip("triton")
pytestmark = pytest.mark.timeout(600)


def test_the_kernels_match_their_references_at_any_row_count_and_horizon():
    out = triton_interpret("""
        import torch
        from trainer.infer import decode_kernels as dk

        g = torch.Generator().manual_seed(0)
        def rand(*shape, dtype):
            return torch.randn(*shape, generator=g).to(dtype)

        def close(got, want, tol, what):
            assert got.shape == want.shape, (what, got.shape, want.shape)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= tol * (1 + want.float().abs().max().item()), (what, err)

        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
            for rows in (1, 5, 16):
                k, n = 160, 72  # neither a multiple of the tiles
                x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype) / 8
                for fused in ({}, {"bias": rand(n, dtype=dtype)}, {"residual": rand(rows, n, dtype=dtype)}):
                    close(dk.linear(x, w, **fused), dk.reference_linear(x, w, **fused), tol, (rows, list(fused)))
            # 2 batch rows, 2 kv heads of 3 query heads, T new positions, 150 cached keys (3 splits);
            # ragged horizons: a row whose horizon ends inside the first split, one that sees them all
            for length, first, horizon in ((1, [40, 149], [[40], [149]]), (4, [60, 97], [[63] * 4, [100] * 4])):
                where = torch.tensor(first).unsqueeze(1) + torch.arange(length)
                q = rand(2, 2, 3 * length, 32, dtype=dtype)
                new = [rand(2, length, 2, 32, dtype=dtype) for _ in range(2)]
                cache = [rand(2, 2, 150, 32, dtype=dtype) for _ in range(2)]
                mine = [c.clone() for c in cache]
                got = dk.attention(q, *mine, torch.tensor(horizon), *new, where)
                want = dk.reference_attention(q, *cache, torch.tensor(horizon), *new, where)
                close(got, want, tol, ("attention", length))
                assert all(torch.equal(a, b) for a, b in zip(mine, cache)), "the new keys written where they go"
                # the drafter's horizon: one per row, expanded over the block (a stride of 0)
                block = (torch.tensor(first) + length - 1).unsqueeze(1).expand(2, length)
                got = dk.attention(q, *[c.clone() for c in cache], block, *new, where)
                close(got, dk.reference_attention(q, *cache, block, *new, where), tol, ("expanded", length))
        # operands whose last dimension is not contiguous (a transposed weight, a strided residual, a
        # cache read through a transpose) are not stepped through by 1: the answer is still the reference's
        x, w_t = rand(3, 40, dtype=torch.float32), rand(40, 24, dtype=torch.float32).t()
        res = rand(24, 3, dtype=torch.float32).t()
        close(dk.linear(x, w_t, residual=res), dk.reference_linear(x, w_t, residual=res), 1e-4, "strided")
        q = rand(1, 1, 2, 16, dtype=torch.float32)
        cache = [rand(1, 1, 16, 80, dtype=torch.float32).transpose(2, 3) for _ in range(2)]
        new, where = [rand(1, 1, 1, 16, dtype=torch.float32) for _ in range(2)], torch.tensor([[30]])
        got = dk.attention(q, *[c.clone() for c in cache], where, *new, where)
        close(got, dk.reference_attention(q, *cache, where, *new, where), 1e-4, "strided cache")
        # past MAX_ROWS the reference runs (the same function answers)
        x = torch.randn(dk.MAX_ROWS + 1, 32)
        assert torch.equal(dk.linear(x, torch.eye(32)), x)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_wrong_kernel_would_be_caught():
    """The comparisons above can fail: a residual dropped, or a key past the horizon seen, is a large error."""
    out = triton_interpret("""
        import torch
        from trainer.infer import decode_kernels as dk

        x, w, res = torch.randn(3, 64), torch.randn(48, 64) / 8, torch.randn(3, 48)
        dropped = (dk.linear(x, w, residual=res) - dk.reference_linear(x, w)).abs().max().item()
        q, keys, values = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 80, 16), torch.randn(1, 1, 80, 16)
        new, where = (torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)), torch.tensor([[30]])
        got = dk.attention(q, keys, values, where, *new, where)
        seen_more = dk.reference_attention(q, keys, values, torch.tensor([[79]]), *new, where)
        further = (got - seen_more).abs().max().item()
        print(dropped > 0.5, further > 0.05)
    """)
    assert out.strip() == "True True"


@pytest.mark.parametrize("spec", ["tiny-random", "tiny-random-hybrid"])
def test_the_static_loop_through_the_triton_products_decodes_the_reference_tokens(spec):
    """Target-only and speculative decoding through decode_kernels (attention and Gated DeltaNet layers,
    the drafter's block, the head) give the HF reference loop's tokens."""
    out = triton_interpret(f"""
        import torch
        from trainer.data.target import load_target
        from trainer.fused_projections import fuse_projections
        from trainer.infer.speculative import target_generate
        from trainer.infer.static_decode import StaticDecoder
        from trainer.model import DFlashDrafter, DrafterConfig

        torch.set_num_threads(1)
        target = load_target({spec!r}, "cpu", torch.float32, layer_ids=[1, 2, 3], seed=0,
                             tiny={{"initializer_range": 0.05}})
        fuse_projections(target.model)
        torch.manual_seed(0)
        dcfg = DrafterConfig.for_target(target, num_layers=2, block_size=4)
        drafter = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head).eval()
        prompts = [[5, 9, 31, 7, 2, 11], [3, 8, 1]]
        decoder = StaticDecoder(target.model, target.layer_ids, drafter, rows=2, max_prompt=6,
                                max_new_tokens=10, triton=True)
        assert decoder.kernels.triton
        own = decoder.decode(prompts, 10, speculative=False).results
        spec = decoder.decode(prompts, 10, speculative=True).results
        for i, p in enumerate(prompts):
            ref = target_generate(target.model, p, 10).tokens
            assert own[i].tokens == ref, (i, own[i].tokens, ref)
            assert spec[i].tokens == ref, (i, spec[i].tokens, ref)
        # lossless holds whatever the drafter proposes: its proposals must be the eager loop's too
        eager = StaticDecoder(target.model, target.layer_ids, drafter, rows=2, max_prompt=6,
                              max_new_tokens=10, triton=False)
        for dec in (decoder, eager):
            dec.prefill(prompts, 10, True)
        got = decoder.drafter.proposals(decoder.anchor, decoder.start, decoder.kernels)
        want = eager.drafter.proposals(eager.anchor, eager.start)
        assert torch.equal(got, want), (got, want)
        print("ok")
    """)
    assert out.strip().endswith("ok")
