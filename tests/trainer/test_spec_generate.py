"""`spec_generate` of the exported modeling code, loaded through AutoModel(trust_remote_code): the
target's own greedy tokens, and the same tau as `dflash-train eval --loop reference` (pooled)."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer.cli.eval import load_drafter_source, load_models
from trainer.infer.evaluate import evaluate, tau_summary
from trainer.cli.serving_gate import run_gate
from trainer.infer.speculative import target_generate

pytestmark = pytest.mark.timeout(300)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A drafter that knows one sequence well (high acceptance there, little elsewhere), its export
    loaded the way users load it, the target and the trainer's own drafter."""
    from transformers import AutoModel

    work = tmp_path_factory.mktemp("gate")
    result = run_gate(str(work), steps=150)
    dcfg, weights, run_config, _ = load_drafter_source(str(work / "run"))
    target, drafter = load_models(dcfg, weights, run_config, None, "cpu")
    draft = AutoModel.from_pretrained(result.export_dir, trust_remote_code=True, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    from trainer.data.heldout import prompts_of
    from trainer.train.loop import build_dataset
    from trainer.cli.serving_gate import gate_config

    cfg = gate_config("tiny-cpu", {}, str(work), 150)
    prompts = prompts_of(build_dataset(cfg, target)) + torch.randint(0, 500, (3, 10), generator=g).tolist()
    return target, drafter, draft, prompts


def _spec(draft, target, prompt, **kwargs):
    ids = torch.tensor([prompt])
    return draft.spec_generate(
        target=target.model,
        input_ids=ids,
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=[],
        return_stats=True,
        **kwargs,
    )


def test_greedy_output_is_the_targets_own(served):
    target, _, draft, prompts = served
    for prompt in prompts:
        stats = _spec(draft, target, prompt, temperature=0.0)
        assert stats.output_ids[0, : len(prompt)].tolist() == prompt  # z-lab's return value: prompt + new
        assert (
            stats.output_ids[0, len(prompt) :].tolist()
            == target_generate(target.model, prompt, NEW_TOKENS).tokens
        )


def test_plain_call_returns_the_ids_like_z_labs(served):
    target, _, draft, prompts = served
    ids = draft.spec_generate(
        input_ids=torch.tensor([prompts[0]]),
        max_new_tokens=8,
        temperature=0.0,
        target=target.model,
        stop_token_ids=[],
    )
    assert isinstance(ids, torch.Tensor) and ids.shape == (1, len(prompts[0]) + 8)


def test_tau_equals_the_reference_eval_loop(served):
    target, drafter, draft, prompts = served
    accepted = [_spec(draft, target, p, temperature=0.0).accepted for p in prompts]
    reference = evaluate(
        target.model, target.layer_ids, drafter, prompts, max_new_tokens=NEW_TOKENS, loop="reference"
    )
    assert max(max(a) for a in accepted) == drafter.cfg.block_size - 1  # some blocks accepted whole
    assert min(min(a) for a in accepted) == 0  # and some not at all: tau is not trivially equal
    assert tau_summary(accepted)["tau"] == pytest.approx(reference.tau, abs=1e-12)


def test_a_cache_that_cannot_be_cropped_is_rebuilt_from_the_accepted_tokens(served, monkeypatch):
    target, _, draft, prompts = served
    expected = [_spec(draft, target, p, temperature=0.0) for p in prompts]
    monkeypatch.setattr(sys.modules[type(draft).__module__], "_rollback_supported", lambda cache: False)
    for prompt, want in zip(prompts, expected, strict=True):
        got = _spec(draft, target, prompt, temperature=0.0)
        assert got.output_ids.tolist() == want.output_ids.tolist() and got.accepted == want.accepted


def test_sampling(served):
    target, _, draft, prompts = served
    greedy = _spec(draft, target, prompts[1], temperature=0.0)
    assert (
        _spec(draft, target, prompts[1], temperature=0.7, top_k=1).output_ids.tolist()
        == greedy.output_ids.tolist()
    )
    torch.manual_seed(0)
    first = _spec(draft, target, prompts[1], temperature=1.5)
    torch.manual_seed(0)
    again = _spec(draft, target, prompts[1], temperature=1.5)
    assert first.output_ids.tolist() == again.output_ids.tolist()  # seeded: reproducible
    assert first.output_ids.shape[1] == len(prompts[1]) + NEW_TOKENS
    assert first.output_ids.tolist() != greedy.output_ids.tolist()  # a hot sample leaves the greedy path


def test_stop_tokens_end_the_output(served):
    target, _, draft, prompts = served
    greedy = _spec(draft, target, prompts[0], temperature=0.0).output_ids[0, len(prompts[0]) :].tolist()
    stop = greedy[5]
    ids = draft.spec_generate(
        target=target.model,
        input_ids=torch.tensor([prompts[0]]),
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=[stop],
    )
    new = ids[0, len(prompts[0]) :].tolist()
    assert new == greedy[: greedy.index(stop) + 1]
