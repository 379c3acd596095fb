"""Speculative decoding with the drafter: the cached path is the training forward, the output is the
target's own, and tau moves from ~1 (untrained) to clearly more (trained)."""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from trainer import metrics_format
from trainer.config import load_config
from trainer.infer.drafter_cache import DrafterContext
from trainer.infer.evaluate import evaluate
from trainer.data.heldout import eval_prompts, prompts_of, split_heldout
from trainer.masks import dense_mask
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.infer.speculative import speculative_generate, target_generate
from trainer.data.target import load_target

pytestmark = pytest.mark.timeout(300)

TINY = {"initializer_range": 0.05}
DIMS = dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target("tiny-random", "cpu", torch.float32, layer_ids=[1, 2, 3], seed=0, tiny=TINY)


def untrained(target, block_size: int, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, block_size=block_size, **DIMS)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head).eval()


def with_block(target, drafter: DFlashDrafter, block_size: int) -> DFlashDrafter:
    """The same weights with another block size (the weights do not depend on it)."""
    cfg = dataclasses.replace(drafter.cfg, block_size=block_size)
    other = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    other.load_state_dict(drafter.state_dict())
    return other.eval()


def random_prompts(count: int, length: int, seed: int, vocab: int = 511) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_cached_context_path_gives_the_training_forward_logits(target, block_size):
    drafter = untrained(target, block_size, seed=block_size)
    with torch.no_grad():  # random weights big enough that a wrong position or mask shows
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    ids = torch.tensor(random_prompts(1, 40, seed=3))
    features = target.features(ids)
    anchors = torch.tensor([[1, 9, 17, 30]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter(features, ids, anchors, dense_mask(anchors, valid, 40, block_size, "cpu"), "sdpa")
        full = drafter.logits(hidden)[0].view(4, block_size, -1)
    for n, anchor in enumerate(anchors[0].tolist()):
        context = DrafterContext(drafter)
        # grown in pieces, as decoding does: the cache must not care how it was filled
        for lo, hi in ((0, anchor // 2), (anchor // 2, anchor)):
            context.extend(features[0, lo:hi])
        cached = context.draft_logits(int(ids[0, anchor]))
        torch.testing.assert_close(cached, full[n], atol=2e-5, rtol=2e-5)


def test_target_generate_is_the_models_own_greedy_decoding(target):
    prompt = random_prompts(1, 8, seed=5)[0]
    tokens = torch.tensor([prompt])
    for _ in range(12):  # no cache, one argmax per full forward
        tokens = torch.cat([tokens, target.model(input_ids=tokens).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert target_generate(target.model, prompt, 12).tokens == tokens[0, 8:].tolist()


def _assert_lossless(target, drafter, prompts, max_new_tokens, stop_ids=()):
    for prompt in prompts:
        own = target_generate(target.model, prompt, max_new_tokens, stop_ids)
        spec = speculative_generate(target.model, target.layer_ids, drafter, prompt, max_new_tokens, stop_ids)
        assert spec.tokens == own.tokens, (prompt, own.tokens, spec.tokens)
        assert len(spec.tokens) <= max_new_tokens
        if stop_ids and spec.tokens and spec.tokens[-1] in stop_ids:
            assert not set(spec.tokens[:-1]) & set(stop_ids)
    return spec


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_untrained_drafter_is_lossless_and_accepts_about_nothing(target, block_size):
    drafter = untrained(target, block_size)
    prompts = random_prompts(3, 7, seed=block_size)
    _assert_lossless(target, drafter, prompts, 24)
    result = evaluate(target.model, target.layer_ids, drafter, prompts, max_new_tokens=24)
    assert result.lossless is True and result.mismatch is None
    assert result.tau < 1.25, result.tau  # ~1: a random drafter rarely guesses the target
    assert len(result.acceptance) == block_size - 1


# ---- a trained drafter: one short tiny-cpu run shared by the tests below -------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny-cpu on 128 sequences, 200 steps (about 12 epochs) with tau evaluated every 100 (about
    25-40 s on a loaded 2-core box): on its own training prompts such a drafter is accepted often,
    a strong signal for the tests below."""
    from trainer.train.loop import train

    out = tmp_path_factory.mktemp("trained")
    cfg = load_config("tiny-cpu", {"output_dir": str(out), "max_steps": 200, "run.checkpoint_every": 1000,
                                   "data.synthetic.num_samples": 128, "train.epochs": 30,
                                   "run.log_every": 1000, "eval.every": 100, "eval.max_new_tokens": 24})
    result = train(cfg, out=io.StringIO())
    return cfg, result


@pytest.fixture(scope="module")
def reference():
    """The target's own greedy outputs, shared by the evaluations below (the target is frozen)."""
    return {}


def _training_prompts(cfg, target):
    """(prompts of the training rows, the unseen prompts the trainer evaluates with)."""
    from trainer.train.loop import build_dataset

    return prompts_of(build_dataset(cfg, target)), eval_prompts(cfg, target, None, cfg.eval.num_prompts)


def test_trained_drafter_is_lossless_at_every_block_size_with_stop_tokens(trained, target):
    cfg, result = trained
    drafter = result.replicas[0].model.eval()
    train_prompts, held_prompts = _training_prompts(cfg, target)
    prompts = train_prompts[:2] + held_prompts[:1]
    for block_size in (2, 4, 8):
        _assert_lossless(target, with_block(target, drafter, block_size), prompts, 24)
    # stop tokens: the 5th token of each target answer ends it, mid-block for the speculative side
    for prompt in prompts[:3]:
        stop = target_generate(target.model, prompt, 32).tokens[4]
        spec = _assert_lossless(target, with_block(target, drafter, 8), [prompt], 32, stop_ids={stop})
        assert spec.tokens[-1] == stop and len(spec.tokens) <= 5


def test_tau_rises_from_one_with_training_and_is_logged_during_training(trained, target, reference):
    cfg, result = trained
    train_prompts, held_prompts = _training_prompts(cfg, target)
    drafter = result.replicas[0].model.eval()
    before = evaluate(target.model, target.layer_ids, untrained(target, 8), train_prompts[:6], max_new_tokens=32,
                    reference=reference)
    after = evaluate(target.model, target.layer_ids, drafter, train_prompts[:6], max_new_tokens=32,
                    reference=reference)
    assert before.tau < 1.1 and after.tau > 1.6, (before.tau, after.tau)
    assert after.lossless and after.acceptance[0] > 0.25

    with open(cfg.metrics_path, encoding="utf-8") as f:
        evals = [r for r in metrics_format.parse_lines(f.read()) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [100, 200]
    last = evals[-1]
    assert last["lossless"] is True and last["prompts"] == cfg.eval.num_prompts and last["seconds"] > 0
    assert len(last["acceptance"]) == 7 and last["tau"] >= 1.0
    # the held-out prompts decoded after training give the tau the trainer logged
    held = evaluate(target.model, target.layer_ids, drafter, held_prompts, max_new_tokens=24)
    assert held.tau == pytest.approx(last["tau"])


def test_a_label_shifted_drafter_shows_in_tau(trained, target, reference):
    """Proposals one position late (what a label-shift bug in training produces) cost tau clearly,
    even on this repetitive target text where a late guess is often still right."""
    cfg, result = trained
    train_prompts, _ = _training_prompts(cfg, target)
    drafter = result.replicas[0].model.eval()
    good = evaluate(target.model, target.layer_ids, drafter, train_prompts[:6], max_new_tokens=32,
                    reference=reference, loop="reference")

    class Shifted(DrafterContext):
        def draft_logits(self, anchor_token):
            logits = super().draft_logits(anchor_token)
            return torch.cat([logits[:1], logits[:-1]])  # row k now holds the guess for k-1

    import trainer.infer.speculative as spec
    original = spec.DrafterContext
    spec.DrafterContext = Shifted
    try:
        shifted = evaluate(target.model, target.layer_ids, drafter, train_prompts[:6], max_new_tokens=32,
                           reference=reference, loop="reference")
    finally:
        spec.DrafterContext = original
    assert shifted.lossless  # still lossless: acceptance only decides how much is kept
    assert shifted.tau < good.tau - 0.25, (shifted.tau, good.tau)


def test_heldout_rows_never_reach_training(tmp_path):
    from trainer.data.dataset import BatchPlan, make_batch, synthetic_dataset

    t = load_target("tiny-random", "cpu", torch.float32, layer_ids=[1, 2, 3], seed=0, tiny=TINY)
    data = synthetic_dataset(t, 40, 4, 12, seed=0)
    rows, held = split_heldout(data, 0.1, seed=0)
    assert len(held) == 4 and len(rows) == 36
    again, held_again = split_heldout(data, 0.1, seed=0)
    assert torch.equal(held.input_ids, held_again.input_ids)  # eval finds the same rows later
    plan = BatchPlan(len(rows), 2, 2, seed=0)
    seen = {tuple(r) for step in range(plan.total_steps(3, None)) for rep in range(2)
            for r in make_batch(rows, plan, step, rep).input_ids.tolist()}
    held_set = {tuple(r) for r in held.input_ids.tolist()}
    assert len(seen) == 36 and not seen & held_set
    assert prompts_of(held) == [r[:4] for r in held.input_ids.tolist()]  # prompt = before the loss mask


def test_fresh_synthetic_prompts_are_not_the_training_prompts(target):
    from trainer.data.heldout import fresh_synthetic_prompts
    from trainer.train.loop import build_dataset

    cfg = load_config("tiny-cpu", {"data.synthetic.num_samples": 64})
    fresh = fresh_synthetic_prompts(512, target.mask_token_id, 16, 8, cfg.train.seed)
    assert fresh == fresh_synthetic_prompts(512, target.mask_token_id, 16, 8, cfg.train.seed)  # eval finds them again
    training = {tuple(p) for p in prompts_of(build_dataset(cfg, target))}
    assert len(fresh) == 16 and not training & {tuple(p) for p in fresh}
    assert all(target.mask_token_id not in p for p in fresh)


def test_without_unseen_prompts_training_runs_and_says_why_tau_is_off(target):
    from trainer.train.training_eval import TrainingEval

    cfg = load_config("tiny-cpu", {"data.source": "jsonl", "data.path": "train.jsonl"})
    dcfg = DrafterConfig.for_target(target, **cfg.drafter.overrides())
    said = []
    assert TrainingEval.create(cfg, target, dcfg, None, torch.float32, said.append) is None
    assert said == ["eval: tau evaluation off: no unseen prompts. Fix: set data.eval_fraction (e.g. 0.01) "
                    "or eval.path, or eval.every: 0 to silence this"]
    on = load_config("tiny-cpu", {"data.source": "jsonl", "data.path": "train.jsonl", "data.eval_fraction": 0.1})
    assert on.eval.every == 240  # the split is what makes prompts; create() then takes its rows
    head = type("TargetHead", (), {"model": None})()  # what data.source features trains with
    said.clear()
    assert TrainingEval.create(on, head, dcfg, None, torch.float32, said.append) is None
    assert said and "data.source features loads no target decoder" in said[0]
