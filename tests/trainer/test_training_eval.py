"""Tau while training (trainer/train/training_eval.py): when an evaluation is due, that building the
evaluator leaves the training RNG stream alone, and what one evaluation records and says."""

from __future__ import annotations

import io
import json

import pytest
import torch

from trainer.config import load_config
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.train.metrics import MetricsWriter
from trainer.train.training_eval import TrainingEval

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_cfg(**overrides):
    settings = {"eval.every": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 6, "drafter.num_layers": 1}
    return load_config("tiny-cpu", {**settings, **overrides})


def due_by_definition(step: int, total: int, every: int) -> bool:
    """Every `every` steps, and after the last one; a run shorter than `every` never evaluates."""
    return step % every == 0 or (step == total and total > every)


@pytest.mark.parametrize("every", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("total", [1, 2, 4, 5, 6, 13])
def test_an_evaluation_is_due_every_n_steps_and_after_the_last(every, total):
    evaluator = TrainingEval.__new__(TrainingEval)  # due() reads only `every`
    evaluator.every = every
    due = [step for step in range(1, total + 1) if evaluator.due(step, total)]
    assert due == [step for step in range(1, total + 1) if due_by_definition(step, total, every)]
    assert len(due) == len(set(due)), "the last step, when also a multiple, evaluates once"
    if total < every:
        assert due == []


def test_no_evaluator_when_evaluation_is_off_and_nothing_said(target):
    cfg = tiny_cfg(**{"eval.every": 0})
    said = []
    dcfg = DrafterConfig.for_target(target, **cfg.drafter.overrides())
    assert TrainingEval.create(cfg, target, dcfg, None, torch.float32, said.append) is None and not said


@pytest.fixture(scope="module")
def evaluator(target):
    cfg = tiny_cfg()
    dcfg = DrafterConfig.for_target(target, **cfg.drafter.overrides())
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    made = TrainingEval.create(cfg, target, dcfg, None, torch.float32, print)
    assert torch.equal(torch.random.get_rng_state(), before), "building the evaluator drew from the RNG"
    return made


def test_a_synthetic_run_evaluates_on_fresh_held_in_prompts(evaluator, target):
    assert evaluator.split == "held-in" and len(evaluator.prompts) == 2
    assert evaluator.decoder is None, "the decoder is built at the first evaluation"
    assert all(0 <= t < target.vocab_size and t != target.mask_token_id for p in evaluator.prompts for t in p)
    assert next(evaluator.drafter.parameters()).device == torch.device(target.device)


def trained_like(evaluator, seed: int) -> DFlashDrafter:
    """A drafter with the evaluator's shape and other weights: what a replica hands over."""
    torch.manual_seed(seed)
    model = DFlashDrafter(evaluator.drafter.cfg, evaluator.target.embed_tokens, evaluator.target.lm_head)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_an_evaluation_copies_the_weights_records_and_says_it(evaluator, tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    metrics = MetricsWriter(str(path), out=out, tty=False)
    first_model, second_model = trained_like(evaluator, seed=1), trained_like(evaluator, seed=2)
    try:
        first = evaluator.run(first_model, 2, metrics)
        decoder = evaluator.decoder
        second = evaluator.run(second_model, 4, metrics)
    finally:
        metrics.close()
    held = evaluator.drafter.state_dict()
    assert all(torch.equal(held[name], t) for name, t in second_model.state_dict().items())
    assert not all(torch.equal(held[name], t) for name, t in first_model.state_dict().items())
    assert evaluator.decoder is decoder, "later evaluations reuse the first one's decoder"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["step"], r["split"]) for r in records] == [
        ("eval", 2, "held-in"),
        ("eval", 4, "held-in"),
    ]
    for record, result in zip(records, (first, second)):
        assert record["tau"] == pytest.approx(result.tau) and record["lossless"] is True
        assert record["prompts"] == 2 and len(record["acceptance"]) == evaluator.drafter.cfg.block_size - 1
        assert 1.0 <= record["tau"] <= evaluator.drafter.cfg.block_size
        assert 0 < record["overhead"] <= 1 and record["seconds"] > 0
    assert evaluator.eval_seconds == pytest.approx(sum(r["seconds"] for r in records))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"eval     step 2: held-in tau {first.tau:.3f} pooled")
    assert "lossless ok" in lines[0] and "2 prompts" in lines[0]
