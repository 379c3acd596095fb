"""The static (pre-allocated, graph-capturable) decode loop against the HF-eager reference: same tokens,
same accepted drafts per round, batched with ragged acceptance and stop tokens; the strict lossless
check; both tau conventions."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from trainer.config import load_config
from trainer.infer.evaluate import evaluate, tau_summary
from trainer.infer.lossless import fp32_last_hidden, judge, tie_bound, unit_roundoff
from trainer.model import DFlashDrafter
from trainer.infer.speculative import speculative_generate, target_generate
from trainer.infer.static_decode import StaticDecoder, StaticTarget
from trainer.data.target import load_target

pytestmark = pytest.mark.timeout(300)

TINY = {"initializer_range": 0.05}


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target("tiny-random", "cpu", torch.float32, layer_ids=[1, 2, 3], seed=0, tiny=TINY)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target):
    """tiny-cpu, 100 steps on 64 sequences (~20 s on 2 cores): on its training prompts the drafter is
    accepted often and unevenly, which is what ragged acceptance needs."""
    from trainer.data.heldout import prompts_of
    from trainer.train.loop import build_dataset, train

    out = tmp_path_factory.mktemp("trained")
    cfg = load_config(
        "tiny-cpu",
        {
            "output_dir": str(out),
            "max_steps": 100,
            "run.checkpoint_every": 1000,
            "data.synthetic.num_samples": 64,
            "train.epochs": 60,
            "run.log_every": 1000,
            "eval.every": 0,
        },
    )
    drafter = train(cfg, out=io.StringIO()).replicas[0].model.eval()
    return drafter, prompts_of(build_dataset(cfg, target))


def with_block(target, drafter: DFlashDrafter, block_size: int) -> DFlashDrafter:
    other = DFlashDrafter(
        dataclasses.replace(drafter.cfg, block_size=block_size), target.embed_tokens, target.lm_head
    )
    other.load_state_dict(drafter.state_dict())
    return other.eval()


def ragged(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts of different lengths (a row's positions are its own)."""
    return [p[: len(p) - i % 3] for i, p in enumerate(prompts)]


def test_a_rotary_that_wants_a_row_of_positions_per_axis_gets_them():
    """Some transformers releases (5.17) expand text positions to the multimodal rotary's three rows in the
    model's forward, and the Qwen3.5 rotary indexes them as [3, batch, positions]: a 2-D tensor of
    positions is an IndexError there. The static loop and the fp32 referee give it the three rows."""
    target = load_target("tiny-random-hybrid", "cpu", torch.float32, layer_ids=[1, 3, 7], seed=0, tiny=TINY)
    rotary = target.model.get_decoder().rotary_emb
    x = target.embed_tokens.weight[:1].unsqueeze(0)
    want_cos, want_sin = rotary(x, torch.arange(9).view(1, 1, 9).expand(3, 1, 9))  # each release takes these
    want_hidden = fp32_last_hidden(StaticTarget(target.model, target.layer_ids, rows=1, positions=9), [4, 2, 7])
    forward = rotary.forward

    def rows_per_axis(x, position_ids):
        position_ids[:, :, None, :]  # what such a release does first
        return forward(x, position_ids)

    rotary.forward = rows_per_axis
    static = StaticTarget(target.model, target.layer_ids, rows=1, positions=9)
    assert torch.equal(static.cos, want_cos[0]) and torch.equal(static.sin, want_sin[0])
    assert torch.equal(fp32_last_hidden(static, [4, 2, 7]), want_hidden)


@pytest.mark.parametrize("spec", ["tiny-random", "tiny-random-hybrid"])
def test_static_target_forward_is_the_hf_forward(target, spec):
    if spec != "tiny-random":
        target = load_target(spec, "cpu", torch.float32, layer_ids=[1, 3, 7], seed=0, tiny=TINY)
    ids = torch.randint(0, 511, (2, 13), generator=torch.Generator().manual_seed(1))
    static = StaticTarget(target.model, target.layer_ids, rows=2, positions=20)
    where = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        hf = target.model(input_ids=ids, output_hidden_states=True)
        prefill = static.hidden(ids[:, :9], where[:, :9], lengths=torch.tensor([9, 9]))  # then 4 more in two steps
        hidden, features = prefill.hidden, prefill.features
        for lo, hi in ((9, 10), (10, 13)):
            step = static.hidden(ids[:, lo:hi], where[:, lo:hi])
            static.commit(step.pending, torch.tensor([hi - lo] * 2))
            hidden, features = torch.cat([hidden, step.hidden], 1), torch.cat([features, step.features], 1)
    torch.testing.assert_close(static.logits(hidden), hf.logits, atol=1e-5, rtol=1e-5)
    expected = torch.cat([hf.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_batched_static_loop_gives_the_reference_tokens_and_rounds(target, trained, block_size):
    drafter = with_block(target, trained[0], block_size)
    prompts = ragged(trained[1][:5])
    # a stop token that the target emits mid-answer for some prompts (mid-block on the speculative side)
    stop = {target_generate(target.model, prompts[0], 24).tokens[6]}
    decoder = StaticDecoder(
        target.model,
        target.layer_ids,
        drafter,
        rows=len(prompts),
        max_prompt=max(map(len, prompts)),
        max_new_tokens=24,
        stop_ids=stop,
    )
    own = decoder.decode(prompts, 24, speculative=False).results
    spec = decoder.decode(prompts, 24, speculative=True).results
    stopped = 0
    for i, prompt in enumerate(prompts):
        ref_own = target_generate(target.model, prompt, 24, stop)
        ref_spec = speculative_generate(target.model, target.layer_ids, drafter, prompt, 24, stop)
        assert own[i].tokens == ref_own.tokens, i
        assert spec[i].tokens == ref_spec.tokens == ref_own.tokens, i
        assert spec[i].accepted == ref_spec.accepted, i
        stopped += spec[i].tokens[-1] in stop
    assert stopped >= 1
    # ragged: in some round the rows accepted different numbers of drafts, and rows ran different rounds
    by_round = [{row.accepted[r] for row in spec if r < len(row.accepted)} for r in range(24)]
    assert any(len(counts) > 1 for counts in by_round)
    assert len({len(row.accepted) for row in spec}) > 1
    assert any(n > 0 for row in spec for n in row.accepted)


def test_a_decoder_is_reused_across_calls_with_fewer_prompts_and_new_weights(target, trained):
    """Weights change in place while a drafter trains: the decoder built on its random start decodes
    with the trained weights, every part of it (the accepted drafts prove the context K/V too)."""
    drafter = with_block(target, trained[0], 4)
    prompts = trained[1][:4]
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    decoder = StaticDecoder(
        target.model, target.layer_ids, drafter, rows=4, max_prompt=max(map(len, prompts)), max_new_tokens=16
    )
    decoder.decode(prompts, 16, speculative=True)
    with torch.no_grad():
        for p, learned in zip(drafter.parameters(), trained[0].parameters(), strict=True):
            p.copy_(learned)
    again = decoder.decode(prompts[1:3], 12, speculative=True).results
    assert len(again) == 2
    for prompt, got in zip(prompts[1:3], again, strict=True):
        ref = speculative_generate(target.model, target.layer_ids, drafter, prompt, 12)
        assert got.tokens == ref.tokens and got.accepted == ref.accepted
    assert any(n > 0 for got in again for n in got.accepted)


def test_the_compiled_loop_accepts_what_the_reference_accepts(target, trained):
    """Compiled (the stacked context K/V of every layer, the block's inputs, the layers), each round
    accepts the drafts the eager reference accepts."""
    drafter = with_block(target, trained[0], 4)
    prompts = ragged(trained[1][:3])
    decoder = StaticDecoder(
        target.model, target.layer_ids, drafter, rows=3, max_prompt=max(map(len, prompts)), max_new_tokens=16,
        compile=True,
    )  # fmt: skip
    assert decoder.kernels.compiled
    spec = decoder.decode(prompts, 16, speculative=True).results
    for prompt, got in zip(prompts, spec, strict=True):
        ref = speculative_generate(target.model, target.layer_ids, drafter, prompt, 16)
        assert got.tokens == ref.tokens and got.accepted == ref.accepted
    assert any(n > 0 for got in spec for n in got.accepted)


def test_evaluate_static_and_reference_loops_agree(target, trained):
    drafter = with_block(target, trained[0], 8)
    prompts = trained[1][:4]
    fast = evaluate(target.model, target.layer_ids, drafter, prompts, max_new_tokens=20, batch=4)
    slow = evaluate(target.model, target.layer_ids, drafter, prompts, max_new_tokens=20, loop="reference")
    assert fast.loop == "static" and fast.batch == 4 and slow.loop == "reference"
    assert fast.lossless and slow.lossless and fast.ties == slow.ties == 0
    for field in ("tau", "tau_per_prompt_mean", "tau_per_prompt", "acceptance", "rounds", "new_tokens"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert fast.tau > 1.3


class _AcceptsOneWrongDraft(StaticDecoder):
    """A verify broken by one token: in the first round of each decode, the first draft is taken as
    the target's own token."""

    def decode(self, *args, **kwargs):
        self._broken = False
        return super().decode(*args, **kwargs)

    def _emit(self, tokens, proposals=None):
        if tokens.shape[1] > 1 and not getattr(self, "_broken", False):
            tokens = tokens.clone()
            tokens[:, 0] = self._proposals[:, 0]
            self._broken = True
        return super()._emit(tokens, proposals)

    def speculative_round(self):
        real = self.drafter.proposals

        def keep(anchor, start, kernels):
            self._proposals = real(anchor, start, kernels)
            return self._proposals

        self.drafter.proposals = keep
        try:
            super().speculative_round()
        finally:
            del self.drafter.proposals


def test_a_verify_broken_by_one_token_is_caught_with_the_prompt_position_and_logits(target, trained):
    from trainer.infer.evaluate import make_decoder

    drafter = with_block(target, trained[0], 4)
    prompts = trained[1][:3]
    good = make_decoder(target.model, target.layer_ids, drafter, prompts, 16, (), 3)
    broken = _AcceptsOneWrongDraft(
        target.model, target.layer_ids, drafter, rows=3, max_prompt=max(map(len, prompts)), max_new_tokens=16
    )
    own = good.decode(prompts, 16, speculative=False).results
    spec = broken.decode(prompts, 16, speculative=True).results
    differs = [i for i in range(3) if own[i].tokens != spec[i].tokens]
    assert differs  # the planted bug changed an output
    result = evaluate(
        target.model, target.layer_ids, drafter, prompts, max_new_tokens=16, batch=3, decoder=broken
    )
    m = result.mismatch
    assert result.lossless is False and result.ties == 0 and m is not None
    first = differs[0]
    at = next(
        i for i, (a, b) in enumerate(zip(own[first].tokens, spec[first].tokens, strict=False)) if a != b
    )
    assert (m.prompt_index, m.position) == (first, at)
    assert (m.expected, m.got) == (own[first].tokens[at], spec[first].tokens[at])
    assert m.expected_logit - m.got_logit > m.tie_bound > 0  # a real gap, far beyond rounding


def test_a_genuine_tie_passes_and_a_gap_just_past_the_bound_does_not(target):
    prompt = [5, 17, 99, 3, 250, 8]
    static = StaticTarget(target.model, target.layer_ids, rows=1, positions=1)
    top = target_generate(target.model, prompt, 1).tokens[0]
    twin = (top + 1) % 512
    head = target.lm_head.weight
    saved = head[twin].clone()
    try:
        with torch.no_grad():
            head[twin] = head[top]  # two tokens the target cannot tell apart: equal logits in any precision
        verdict = judge(static, prompt, top, twin)
        assert verdict.tie and verdict.expected_logit == verdict.got_logit
        with torch.no_grad():  # the same pair, its fp32 gap now twice the bound: a bug
            head[twin] = head[top] - head[top] * 2 * verdict.bound / verdict.expected_logit
        far = judge(static, prompt, top, twin)
        assert not far.tie and far.expected_logit - far.got_logit > far.bound
    finally:
        with torch.no_grad():
            head[twin] = saved
    other = judge(static, prompt, top, (top + 7) % 512)  # an ordinary wrong token
    assert not other.tie


def test_two_tokens_both_near_a_third_top_are_a_tie_and_one_far_from_it_is_not(target):
    # a three-way near-tie: the fp32 top is neither decoding's token, yet both were within rounding
    prompt = [5, 17, 99, 3, 250, 8]
    static = StaticTarget(target.model, target.layer_ids, rows=1, positions=1)
    static.dtype = torch.bfloat16  # judged as bf16 forwards: a bound wide enough to place fp32 gaps in
    top = target_generate(target.model, prompt, 1).tokens[0]
    a, b = (top + 1) % 512, (top + 2) % 512
    head = target.lm_head.weight
    saved = head[[a, b]].clone()
    own = judge(static, prompt, top, top)
    try:
        with torch.no_grad():
            head[a] = head[b] = head[top] - head[top] * (own.bound / 4) / own.top_logit
        near = judge(static, prompt, a, b)
        assert near.top == top and near.tie
        assert near.top_logit - near.expected_logit == pytest.approx(own.bound / 4, rel=1e-2)
        with torch.no_grad():
            head[b] = head[top] - head[top] * (4 * own.bound) / own.top_logit
        far = judge(static, prompt, a, b)
        assert far.top == top and not far.tie and far.top_logit - far.got_logit > far.bound
    finally:
        with torch.no_grad():
            head[[a, b]] = saved


def test_the_tie_bound_is_the_working_dtypes_rounding_not_a_share_of_the_logit():
    h, wa, wb = torch.ones(64), torch.full((64,), 0.05), torch.full((64,), 0.04)
    z = 3.2  # <h, wa>
    bf16 = tie_bound(h, wa, wb, z, z - 0.64, torch.bfloat16, num_layers=8)
    fp32 = tie_bound(h, wa, wb, z, z - 0.64, torch.float32, num_layers=8)
    assert unit_roundoff(torch.bfloat16) == 2**-8 and unit_roundoff(torch.float32) == 2**-24
    assert fp32 == pytest.approx(bf16 * 2**-16)  # linear in u
    # 2 * (6 u sqrt(34/3) ||h (.) (wa - wb)|| + u (|z_a| + |z_b|)), worked by hand
    assert bf16 == pytest.approx(2 * (6 * 2**-8 * (34 / 3) ** 0.5 * 0.08 + 2**-8 * (3.2 + 2.56)))
    assert bf16 < 0.125 * z / 4  # far tighter than the old 12.5 %-of-the-top-logit rule


def test_both_tau_conventions_on_a_hand_made_example():
    # prompt A: rounds accepting 0, 1, 2 drafts (tau 2.0); prompt B: one round of 3 (tau 4.0); C: no round
    summary = tau_summary([[0, 1, 2], [3], []])
    assert summary["tau"] == pytest.approx((1 + 2 + 3 + 4) / 4)  # pooled over the four rounds: 2.5
    assert summary["tau_per_prompt_mean"] == pytest.approx(3.0)  # (2.0 + 4.0) / 2
    assert summary["tau_per_prompt"] == {"min": 2.0, "median": 3.0, "max": 4.0}


def test_a_stop_token_inside_the_accepted_drafts_ends_decoding_in_both_loops(target, trained):
    """A stop token among a round's accepted drafts (not its last token) ends that prompt: no further
    rounds are run or counted in tau, in the reference loop as in the static one."""
    drafter = with_block(target, trained[0], 8)
    found = 0
    for prompt in trained[1][:12]:
        free = speculative_generate(target.model, target.layer_ids, drafter, prompt, 32)
        at = 1  # index in the output of the current round's first token
        for n in free.accepted:
            if n >= 2 and free.tokens[at] not in free.tokens[:at]:
                stop = {free.tokens[at]}  # the round's first accepted draft, n - 1 more accepted after it
                ref = speculative_generate(target.model, target.layer_ids, drafter, prompt, 32, stop)
                decoder = StaticDecoder(
                    target.model,
                    target.layer_ids,
                    drafter,
                    rows=1,
                    max_prompt=len(prompt),
                    max_new_tokens=32,
                    stop_ids=stop,
                )
                fast = decoder.decode([prompt], 32, speculative=True).results[0]
                assert ref.tokens == fast.tokens == free.tokens[: at + 1]
                assert ref.accepted == fast.accepted == free.accepted[: len(ref.accepted)]
                assert ref.accepted[-1] == n  # the stop was mid-block, and the round it was in was the last
                found += 1
                break
            at += n + 1
    assert found >= 1


def test_the_decode_cost_benchmark_runs_small_on_the_decoders_public_parts(tmp_path):
    """benchmarks/decode_cost.py times the decoder's parts through its public methods; at tiny size on
    the CPU it still checks graphs against eager and speculative against target-only decoding."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "decode_cost.py"), "--device", "cpu", "--shapes", "tiny",
         "--blocks", "4", "--kernels", "eager", "--iterations", "2", "--reference-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]["tiny"]["rows"]
    assert row["speculative_equals_target_only"] is True and row["graph_tokens_equal_eager"] is True
    assert all(row[f"{part}_loop_ms"] > 0 for part in ("verify", "draft", "step", "round")), row


def test_the_decode_profile_benchmark_counts_each_calls_work(tmp_path):
    """benchmarks/decode_profile.py lists what each of the four calls runs; a round runs a draft and a
    verify, so it runs more than either (on the CPU the rows are aten ops)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "profile.md"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "decode_profile.py"), "--device", "cpu", "--shapes", "tiny",
         "--kernels", "eager", "--calls", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = json.loads(out.with_suffix(".json").read_text())["results"]["tiny"]
    counts = {name: part["kernels_per_call"] for name, part in parts.items()}
    assert set(counts) == {"verify", "draft", "step", "round"}
    assert counts["round"] > max(counts["draft"], counts["verify"]) > 0, counts
    assert sum(n for _, n, _ in parts["round"]["rows"]) == counts["round"]
    assert "### tiny: round" in out.read_text()
