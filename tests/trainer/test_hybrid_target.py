"""Hybrid Qwen3.5/3.6 targets (Gated DeltaNet + gated full attention): loading, the recurrent layer's
math against the target's own, and speculative decoding that stays exact when drafts are rejected.

An oracle drafter proposes the target's own greedy continuation with one draft spoiled at a chosen
position each round, so every rejection point is exercised and the accepted counts are known in
advance. A recurrent state that kept a rejected draft would change the target's next tokens: both
loops must still emit exactly the target's greedy output."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ConfigError
from trainer.data.target import load_target
from trainer.infer import gated_deltanet, speculative
from trainer.infer.lossless import fp32_last_hidden
from trainer.infer.speculative import speculative_generate, target_generate
from trainer.infer.static_decode import StaticDecoder, StaticDrafter
from trainer.model import DFlashDrafter, DrafterConfig
from trainer.target_family import is_hybrid

pytestmark = pytest.mark.timeout(300)

TINY = {"initializer_range": 0.05}
NEW = 24
PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), list(range(100, 170, 2))]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target("tiny-random-hybrid", "cpu", torch.float32, layer_ids=[1, 3, 5], tiny=TINY)


@pytest.fixture(scope="module")
def greedy(target):
    """Each prompt's greedy continuation by the target's own HF forward, a block's worth longer than decoded."""
    return [target_generate(target.model, p, NEW + 16).tokens for p in PROMPTS]


def drafter_for(target, block: int) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=block)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head).eval()


def spoiled_at(call: int, row: int, block: int) -> int:
    """Which draft (0..block-2) the oracle spoils in this round; block-1: none (a full block accepted)."""
    return (call + row) % block


class Oracle:
    """Proposals = the target's greedy tokens after the anchor, one spoiled per spoiled_at."""

    def __init__(self, greedy, block: int, vocab: int):
        self.truth = [p + g for p, g in zip(PROMPTS, greedy)]
        self.block, self.vocab, self.calls = block, vocab, 0

    def proposals(self, row: int, start: int) -> list[int]:
        seq = self.truth[row % len(self.truth)]
        out = [seq[i] if i < len(seq) else 0 for i in range(start + 1, start + self.block)]
        bad = spoiled_at(self.calls, row, self.block)
        if bad < self.block - 1:
            out[bad] = (out[bad] + 1) % self.vocab
        return out


def expected_accepted(rounds: int, row: int, block: int) -> list[int]:
    return [min(spoiled_at(call, row, block), block - 1) for call in range(rounds)]


def test_tiny_hybrid_is_a_qwen3_5_with_linear_and_full_attention_layers(target):
    config = target.config
    assert config.model_type.startswith("qwen3_5") and is_hybrid(config)
    assert config.layer_types.count("full_attention") == 2 and config.layer_types[3] == "full_attention"
    assert not hasattr(target.model.model.layers[0], "self_attn")  # the shape that crashed the old loops


def test_an_unsupported_model_type_is_one_line_naming_it_and_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ConfigError) as caught:
        load_target(str(tmp_path), "cpu", torch.float32)
    message = str(caught.value)
    assert "'gpt2' is not supported" in message and "qwen3_5" in message and "qwen3" in message
    assert "\n" not in message


def test_the_deltanet_layer_is_the_targets_own_and_a_partial_commit_is_exact(target):
    layer = target.model.model.layers[0].linear_attn
    weights = gated_deltanet.DeltaNetWeights.of(layer)
    torch.manual_seed(1)
    x = torch.randn(2, 150, target.hidden_size)
    with torch.no_grad():
        expected = layer(x)
        conv, state = gated_deltanet.new_state(weights, 2, "cpu", torch.float32)
        whole = gated_deltanet.run(x, weights, conv, state, torch.tensor([150, 150]))
        assert torch.allclose(whole, expected, atol=1e-5)
        # a prefix, then passes of 7 of which only the first 3 are kept (a verify with a rejection)
        conv, state = gated_deltanet.new_state(weights, 2, "cpu", torch.float32)
        pieces = [gated_deltanet.run(x[:, :100], weights, conv, state, torch.tensor([100, 100]))]
        at = 100
        while at < 150:
            out, pending = gated_deltanet.mix(x[:, at : at + 7], weights, conv, state)
            kept = min(3, out.shape[1])
            gated_deltanet.commit(pending, torch.tensor([kept, kept]), conv, state)
            pieces.append(out[:, :kept])
            at += kept
        assert torch.allclose(torch.cat(pieces, 1), expected, atol=1e-5)
        # a shorter row's padding never reaches its state
        conv, state = gated_deltanet.new_state(weights, 2, "cpu", torch.float32)
        gated_deltanet.run(x, weights, conv, state, torch.tensor([150, 120]))
        conv1, state1 = gated_deltanet.new_state(weights, 1, "cpu", torch.float32)
        gated_deltanet.run(x[1:, :120], weights, conv1, state1, torch.tensor([120]))
        assert torch.equal(state[1], state1[0]) and torch.equal(conv[1], conv1[0])


def test_static_target_only_decoding_is_the_hf_greedy_output(target, greedy):
    decoder = StaticDecoder(target.model, target.layer_ids, None, rows=3, max_prompt=40, max_new_tokens=NEW)
    batch = decoder.decode(PROMPTS, NEW, speculative=False)
    assert [r.tokens for r in batch.results] == [g[:NEW] for g in greedy]


def test_the_fp32_referee_recomputes_the_hybrid_target(target):
    prompt = PROMPTS[1]
    decoder = StaticDecoder(target.model, target.layer_ids, None, rows=1, max_prompt=40, max_new_tokens=2)
    hidden = fp32_last_hidden(decoder.target, prompt)
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    assert torch.allclose(hidden, out.hidden_states[-1][0, -1], atol=1e-4)


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_static_speculative_decoding_with_rejections_at_every_position(target, greedy, block, monkeypatch):
    oracle = Oracle(greedy, block, target.vocab_size)

    def proposals(self, anchor, start, kernels=None):
        rows = [oracle.proposals(r, int(s)) for r, s in enumerate(start.tolist())]
        oracle.calls += 1
        return torch.tensor(rows, dtype=torch.long)

    monkeypatch.setattr(StaticDrafter, "proposals", proposals)
    decoder = StaticDecoder(
        target.model, target.layer_ids, drafter_for(target, block), rows=3, max_prompt=40, max_new_tokens=NEW
    )
    batch = decoder.decode(PROMPTS, NEW, speculative=True)
    assert [r.tokens for r in batch.results] == [g[:NEW] for g in greedy]
    for row, result in enumerate(batch.results):
        rounds = len(result.accepted)
        assert result.accepted[:-1] == expected_accepted(rounds, row, block)[:-1]  # the last may be cut
    lengths = {len(r.accepted) for r in batch.results}
    assert block == 2 or len(lengths) > 1  # rows advanced raggedly


@pytest.mark.parametrize("block", [2, 4, 8, 16])
def test_reference_speculative_decoding_with_rejections_at_every_position(target, greedy, block, monkeypatch):
    oracle = Oracle(greedy, block, target.vocab_size)

    class OracleContext:
        def __init__(self, drafter):
            self.length = 0

        def extend(self, features):
            self.length += features.shape[0]

        def draft_logits(self, token):
            logits = torch.zeros(block, target.vocab_size)
            logits[torch.arange(1, block), torch.tensor(oracle.proposals(0, self.length))] = 1.0
            oracle.calls += 1
            return logits

    monkeypatch.setattr(speculative, "DrafterContext", OracleContext)
    decoded = speculative_generate(
        target.model, target.layer_ids, drafter_for(target, block), PROMPTS[0], NEW
    )
    assert decoded.tokens == greedy[0][:NEW]
    assert decoded.accepted[:-1] == expected_accepted(len(decoded.accepted), 0, block)[:-1]


def test_a_stop_token_ends_both_loops_where_the_target_says_it(target, greedy, monkeypatch):
    block = 4
    stop = greedy[0][9]
    end = greedy[0].index(stop) + 1
    drafter = drafter_for(target, block)
    reference = speculative_generate(
        target.model, target.layer_ids, drafter, PROMPTS[0], NEW, stop_ids=[stop]
    )
    assert reference.tokens == greedy[0][:end]
    decoder = StaticDecoder(
        target.model, target.layer_ids, drafter, rows=2, max_prompt=40, max_new_tokens=NEW, stop_ids=[stop]
    )
    batch = decoder.decode(PROMPTS[:2], NEW, speculative=True)
    assert batch.results[0].tokens == greedy[0][:end]


def test_training_with_in_training_tau_then_eval_both_loops_and_export(tmp_path):
    """The seeds' crash: a hybrid target died at its first tau evaluation; eval and export after it."""
    import subprocess
    import sys

    run = tmp_path / "run"
    train = [sys.executable, "-m", "trainer", "--config", "tiny-cpu", "--output-dir", str(run),
             "--set", "target.spec=tiny-random-hybrid", "--set", "target.layer_ids=[1,3,5]",
             "--set", "max_steps=12", "--set", "eval.every=5", "--set", "eval.max_new_tokens=12",
             "--set", "data.synthetic.num_samples=48", "--set", "run.log_every=5"]  # fmt: skip
    done = subprocess.run(train, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert len(evals) >= 2 and all(r["lossless"] is True and r["tau"] >= 1.0 for r in evals)
    assert {r["split"] for r in evals} == {"held-in"}  # fresh synthetic prompts: the training distribution
    for loop in ("static", "reference"):
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "eval", "--checkpoint", str(run), "--num-prompts", "2",
             "--max-new-tokens", "10", "--loop", loop, "--json"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout)
        assert result["lossless"] is True and result["loop"].startswith(loop)
    done = subprocess.run([sys.executable, "-m", "trainer", "export", "--checkpoint", str(run), "--out",
                           str(tmp_path / "export")], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_target_layers"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]


def test_a_multimodal_qwen3_5_checkpoint_loads_its_language_model(tmp_path):
    """Published Qwen3.5/3.6 checkpoints are Qwen3_5ForConditionalGeneration: the text model is read."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from trainer.data.target_head import load_target_head

    text = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path
    )
    target = load_target(str(tmp_path), "cpu", torch.float32)
    assert target.num_layers == 8 and target.layer_ids == [
        1,
        2,
        3,
        4,
        5,
    ]  # the default spread over the text model
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert target.features(ids).shape == (1, 8, 5 * 64)
    head = load_target_head(str(tmp_path), torch.float32)
    assert head.num_layers == 8 and torch.equal(head.embed_tokens.weight, target.embed_tokens.weight)
    decoded = StaticDecoder(target.model, target.layer_ids, None, rows=1, max_prompt=8, max_new_tokens=6)
    assert (
        decoded.decode([ids[0].tolist()], 6, speculative=False).results[0].tokens
        == target_generate(target.model, ids[0].tolist(), 6).tokens
    )


def test_the_compiled_static_loop_decodes_the_same_tokens(target, greedy):
    block = 4
    decoder = StaticDecoder(
        target.model, target.layer_ids, drafter_for(target, block), rows=3, max_prompt=40, max_new_tokens=8,
        compile=True,
    )  # fmt: skip
    assert decoder.kernels.compiled
    for drafted in (False, True):
        batch = decoder.decode(PROMPTS, 8, speculative=drafted)
        assert [r.tokens for r in batch.results] == [g[:8] for g in greedy]


def test_the_exported_drafters_spec_generate_is_lossless_on_a_hybrid_target(target, greedy, tmp_path):
    """z-lab's Transformers entry point on the seeds' kind of target: its cache cannot be cropped."""
    from transformers import AutoModel

    from trainer.infer.export import export_drafter

    export_drafter(drafter_for(target, 4), tmp_path, dtype=torch.float32)
    draft = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[1]])
    out = draft.spec_generate(target=target.model, input_ids=ids, max_new_tokens=NEW, return_stats=True)
    assert out.output_ids[0, ids.shape[1] :].tolist() == greedy[1][:NEW]
