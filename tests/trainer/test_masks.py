"""Anchors and the block attention mask, checked against rules written out from first principles."""
from __future__ import annotations

import threading

import pytest
import torch

from trainer.compile_lock import MASK_LOCK
from trainer.masks import build_block_mask, dense_mask, make_mask_mod, sample_anchors


def brute_force_visible(anchors, valid, ctx_len, block_size):
    """The DFlash visibility rules, one (query, key) pair at a time, as plain Python.

    Query row i belongs to block i // block_size. Key column j < ctx_len is target position j;
    key column ctx_len + r is block token r. A valid block token sees target positions strictly
    before its anchor and every token of its own block; a padding block token sees only itself.
    """
    batch, num_blocks = len(anchors), len(anchors[0])
    q_len = num_blocks * block_size
    out = torch.zeros(batch, 1, q_len, ctx_len + q_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(q_len):
            n = i // block_size
            for j in range(ctx_len + q_len):
                if j < ctx_len:
                    seen = bool(valid[b][n]) and j < anchors[b][n]
                else:
                    r = j - ctx_len
                    seen = (r // block_size == n) if valid[b][n] else (r == i)
                out[b, 0, i, j] = seen
    return out


def random_anchor_batch(seed, batch, num_blocks, ctx_len, pad_blocks):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, ctx_len, (batch, num_blocks), generator=g).sort(dim=1).values
    valid = torch.ones(batch, num_blocks, dtype=torch.bool)
    if pad_blocks:
        valid[:, -pad_blocks:] = False
        anchors[:, -pad_blocks:] = 0
    return anchors, valid


@pytest.mark.parametrize("seed,batch,num_blocks,ctx_len,block_size,pad", [
    (0, 2, 5, 23, 4, 0),
    (1, 3, 6, 17, 3, 2),
    (2, 1, 4, 9, 5, 1),
])
def test_dense_mask_equals_brute_force(seed, batch, num_blocks, ctx_len, block_size, pad):
    anchors, valid = random_anchor_batch(seed, batch, num_blocks, ctx_len, pad)
    expected = brute_force_visible(anchors.tolist(), valid.tolist(), ctx_len, block_size)
    got = dense_mask(anchors, valid, ctx_len, block_size, "cpu")
    assert got.dtype == torch.bool
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_anchor_position_itself_is_hidden():
    # The target's hidden state AT the anchor encodes its guess of anchor+1: seeing it is the
    # `<=` bug that trains to high accuracy and accepts nothing at inference.
    anchors = torch.tensor([[5, 9]])
    valid = torch.tensor([[True, True]])
    mask = dense_mask(anchors, valid, ctx_len=12, block_size=4, device="cpu")[0, 0]
    for n, a in enumerate([5, 9]):
        rows = mask[n * 4:(n + 1) * 4]
        assert rows[:, a - 1].all(), "the position just before the anchor must be visible"
        assert not rows[:, a].any(), "the anchor's own target position must be hidden"
        assert not rows[:, a + 1:12].any()


def test_every_row_sees_something_and_padding_sees_only_itself():
    anchors, valid = random_anchor_batch(3, 2, 4, 10, pad_blocks=2)
    mask = dense_mask(anchors, valid, 10, 3, "cpu")[:, 0]
    assert mask.any(dim=-1).all(), "an all-masked row would make SDPA return NaN"
    for row in range(6, 12):  # blocks 2 and 3 are padding
        assert mask[:, row].sum(dim=-1).tolist() == [1, 1]
        assert mask[:, row, 10 + row].all()


def test_mask_mod_matches_dense_pointwise():
    anchors, valid = random_anchor_batch(4, 2, 3, 11, pad_blocks=1)
    mod = make_mask_mod(anchors, valid, 11, 4)
    dense = dense_mask(anchors, valid, 11, 4, "cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b = int(torch.randint(0, 2, (), generator=g))
        q = int(torch.randint(0, 12, (), generator=g))
        kv = int(torch.randint(0, 23, (), generator=g))
        got = mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(kv))
        assert bool(got) == bool(dense[b, 0, q, kv])


def test_block_mask_tiles_match_brute_force():
    # 128x128 tiles: a tile is present in the BlockMask iff any (q, kv) inside it is visible.
    ctx_len, block_size, num_blocks = 300, 16, 20
    anchors, valid = random_anchor_batch(5, 2, num_blocks, ctx_len, pad_blocks=3)
    q_len, kv_len = num_blocks * block_size, ctx_len + num_blocks * block_size
    block_mask = build_block_mask(anchors, valid, ctx_len, block_size, "cpu")
    assert block_mask.shape == (2, 1, q_len, kv_len)
    tiles = block_mask.to_dense()[:, 0].bool()

    elements = brute_force_visible(anchors.tolist(), valid.tolist(), ctx_len, block_size)[:, 0]
    qt, kt = -(-q_len // 128), -(-kv_len // 128)
    padded = torch.zeros(2, qt * 128, kt * 128, dtype=torch.bool)
    padded[:, :q_len, :kv_len] = elements
    expected = padded.view(2, qt, 128, kt, 128).any(dim=4).any(dim=2)
    assert torch.equal(tiles, expected)
    # and the element-level rule the kernel applies inside partial tiles is the same mask_mod
    b = torch.arange(2).view(2, 1, 1)
    evaluated = block_mask.mask_mod(b, 0, torch.arange(q_len).view(1, -1, 1),
                                    torch.arange(kv_len).view(1, 1, -1))
    assert torch.equal(evaluated, elements)


def test_build_block_mask_waits_for_the_mask_lock():
    anchors, valid = random_anchor_batch(6, 1, 2, 8, pad_blocks=0)
    done = threading.Event()

    def build():
        build_block_mask(anchors, valid, 8, 4, "cpu")
        done.set()

    with MASK_LOCK:
        worker = threading.Thread(target=build)
        worker.start()
        assert not done.wait(0.5), "create_block_mask ran while another thread held MASK_LOCK"
    assert done.wait(30)
    worker.join()


def test_concurrent_mask_building_is_consistent():
    anchors, valid = random_anchor_batch(7, 2, 6, 40, pad_blocks=1)
    reference = build_block_mask(anchors, valid, 40, 4, "cpu").to_dense()
    errors, results = [], []

    def build():
        try:
            for _ in range(5):
                results.append(build_block_mask(anchors, valid, 40, 4, "cpu").to_dense())
        except Exception as exc:  # noqa: BLE001 - any failure in a thread fails the test
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 20 and all(torch.equal(r, reference) for r in results)


# ---- anchors ---------------------------------------------------------------------------------

def eligible_positions(loss_mask_row):
    """Positions a with the loss on at a and at a+1 (so the block has a label to learn)."""
    m = loss_mask_row.tolist()
    return {a for a in range(len(m) - 1) if m[a] and m[a + 1]}


def test_anchors_are_sorted_unique_and_eligible():
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(3, 50, generator=g) > 0.3
    anchors, valid = sample_anchors(loss_mask, 8, 4, torch.Generator().manual_seed(1))
    assert anchors.shape == valid.shape == (3, 8)
    assert anchors.dtype == torch.long
    for b in range(3):
        picked = anchors[b][valid[b]].tolist()
        assert picked == sorted(set(picked))
        assert set(picked) <= eligible_positions(loss_mask[b])
        assert len(picked) == min(8, len(eligible_positions(loss_mask[b])))


def test_too_few_eligible_positions_pad_with_invalid_blocks():
    loss_mask = torch.zeros(2, 20, dtype=torch.bool)
    loss_mask[0, 3:6] = True       # eligible: 3, 4 (5 has no trained successor)
    loss_mask[1, 19] = True        # last position only: nothing eligible
    anchors, valid = sample_anchors(loss_mask, 5, 4, torch.Generator().manual_seed(0))
    assert valid.tolist() == [[True, True, False, False, False], [False] * 5]
    assert anchors[0, :2].tolist() == [3, 4]
    assert (anchors[~valid] == 0).all()


def test_more_anchors_than_positions():
    loss_mask = torch.ones(1, 6, dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, 10, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (1, 10)
    assert anchors[valid].tolist() == [0, 1, 2, 3, 4]


def test_anchors_are_reproducible_and_random():
    loss_mask = torch.ones(2, 64, dtype=torch.bool)
    first = sample_anchors(loss_mask, 6, 4, torch.Generator().manual_seed(7))[0]
    again = sample_anchors(loss_mask, 6, 4, torch.Generator().manual_seed(7))[0]
    other = sample_anchors(loss_mask, 6, 4, torch.Generator().manual_seed(8))[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # every eligible position gets picked sometimes (no position is systematically excluded)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(100):
        seen |= set(sample_anchors(loss_mask[:1], 6, 4, g)[0][0].tolist())
    assert seen == set(range(63))


def test_bad_anchor_arguments_are_refused():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="block_size"):
        sample_anchors(torch.ones(1, 8, dtype=torch.bool), 4, 1, g)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.ones(1, 8, dtype=torch.bool), 0, 4, g)


@pytest.mark.parametrize("ctx_len, num_blocks, block_size", [(300, 20, 16), (256, 32, 8), (384, 64, 16), (40, 6, 4)])
def test_the_block_masks_tiles_are_create_block_masks(ctx_len, num_blocks, block_size):
    """The tiles built from the visible intervals are the ones create_block_mask finds by evaluating
    mask_mod everywhere: the same partial tiles and the same full ones (a tile marked full that is not
    would let the kernel skip the mask there)."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchors, valid = random_anchor_batch(11, 2, num_blocks, ctx_len, pad_blocks=3)
    q_len = num_blocks * block_size
    ours = build_block_mask(anchors, valid, ctx_len, block_size, "cpu")
    mod = make_mask_mod(anchors, valid, ctx_len, block_size)
    theirs = create_block_mask(mod, 2, None, q_len, ctx_len + q_len, device="cpu")
    assert ours.shape == theirs.shape
    for mask in (ours, theirs):
        assert mask.full_kv_num_blocks is not None

    def tiles(counts, indices):
        listed = torch.zeros(*indices.shape[:-1], indices.shape[-1] + 1, dtype=torch.bool)
        keep = torch.arange(indices.shape[-1]) < counts.unsqueeze(-1)
        listed.scatter_(-1, torch.where(keep, indices.long(), indices.shape[-1]), True)
        return listed[..., :-1]
    assert torch.equal(tiles(ours.kv_num_blocks, ours.kv_indices), tiles(theirs.kv_num_blocks, theirs.kv_indices))
    assert torch.equal(tiles(ours.full_kv_num_blocks, ours.full_kv_indices),
                       tiles(theirs.full_kv_num_blocks, theirs.full_kv_indices))
    if ctx_len == 384:  # a shape with whole tiles: some of them full
        assert ours.full_kv_num_blocks.sum() > 0
