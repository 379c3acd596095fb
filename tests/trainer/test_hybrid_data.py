"""The data commands with a hybrid (Qwen3.5-style) target on the CPU: regenerate (batched, left padding,
the model's own hybrid cache; its batch sized from free memory), cache-features and training from it."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch

from trainer.cli.data import main as data_main
from trainer.config import load_config
from trainer.data import generation_memory as gm
from trainer.data.feature_cache import open_cache
from trainer.data.regenerate import Generator, RegenerateOptions
from trainer.data.target import load_target
from trainer.train.loop import train

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]
HYBRID = "tiny-random-hybrid"



@pytest.fixture(scope="module")
def generator():
    return Generator(HYBRID, "cpu", RegenerateOptions(HYBRID, "in", "out", max_new_tokens=6))


def test_a_left_padded_hybrid_batch_generates_each_prompts_own_greedy_continuation(generator):
    short = generator.prompt_ids([{"role": "user", "content": "hi"}])
    long = generator.prompt_ids([{"role": "user", "content": "a much longer question, padded on the left"}])
    together = generator.generate([short, long])
    assert together == [generator.generate([short])[0], generator.generate([long])[0]]
    for prompt, (tokens, _) in zip([short, long], together):
        ids = torch.tensor([prompt])
        for _ in range(6):  # no cache at all: the whole sequence each time
            ids = torch.cat([ids, generator.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        expected = ids[0, len(prompt) :].tolist()
        cut = next((k for k, t in enumerate(expected) if t in generator.eos_ids), None)
        assert tokens == expected[:cut]


QWEN36_27B = SimpleNamespace(  # the published text config (see benchmarks/seed_scale.py)
    num_hidden_layers=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    hidden_size=5120,
    intermediate_size=17408,
    vocab_size=248320,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
QWEN36_27B.layer_types = QWEN36_27B.layer_types * 16


def test_a_sequence_costs_its_attention_layers_kv_plus_its_recurrent_layers_state():
    # 16 full-attention layers x K,V x 4 kv heads x 256 x bf16 per position
    assert gm.kv_bytes_per_position(QWEN36_27B, 2) == 16 * 2 * 4 * 256 * 2 == 64 << 10
    # 48 Gated DeltaNet layers: conv (2*16*128 + 48*128 channels x kernel 4, bf16) + fp32 state 48 x 128 x 128
    assert gm.state_bytes(QWEN36_27B, 2) == 48 * ((2 * 2048 + 6144) * 4 * 2 + 48 * 128 * 128 * 4)
    dense = SimpleNamespace(**{**vars(QWEN36_27B), "layer_types": None})
    assert gm.state_bytes(dense, 2) == 0 and gm.kv_bytes_per_position(dense, 2) == 64 * 2 * 4 * 256 * 2
    each = gm.sequence_bytes(QWEN36_27B, 3072, 1024, 2)
    assert gm.batch_that_fits(QWEN36_27B, 3072, 1024, 80 << 30, 2) == int((80 << 30) * gm.FREE_SHARE) // each
    assert gm.batch_that_fits(QWEN36_27B, 3072, 1024, 1 << 20, 2) == 1  # always at least one
    assert gm.batch_that_fits(QWEN36_27B, 8, 4, 1 << 50, 2) == gm.MAX_BATCH


def test_batches_split_where_the_longest_prompt_so_far_stops_fitting():
    each = gm.sequence_bytes(QWEN36_27B, 100 + 10, 100, 2)
    free = int(3 * each / gm.FREE_SHARE) + 1  # three prompts of 100 tokens fit, not four
    assert gm.split_by_memory([100] * 7, 10, QWEN36_27B, free, 2) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    # a long prompt widens its batch: it starts a new one once the padded width no longer fits
    assert gm.split_by_memory([10, 10, 100, 100, 100, 100], 10, QWEN36_27B, free, 2) == [
        slice(0, 3),
        slice(3, 6),
    ]


def test_regenerate_command_with_a_hybrid_target_reports_its_batch_and_new_tokens_per_second(
    tmp_path, capsys
):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n" for i in range(3)
        )
    )
    def regenerate(out: str, *flags: str) -> int:
        return data_main(["regenerate", "--target", HYBRID, "--in", str(src), "--out", str(tmp_path / out), *flags])

    assert regenerate("o.jsonl", "--max-new-tokens", "3") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dflash-train data: regenerated 3 records") and "new tokens/s" in line
    assert "batches up to 3 (CPU default)" in line
    assert regenerate("p.jsonl", "--batch-size", "lots") == 2
    assert "--batch-size 'lots' is not a number" in capsys.readouterr().err


def test_cache_features_of_a_hybrid_target_are_its_features_and_train_a_drafter(tmp_path, capsys):
    config = {
        "target.spec": HYBRID,
        "target.layer_ids": [1, 3, 5],
        "data.seq_len": 32,
        "data.synthetic.num_samples": 6,
        "train.batch_size": 2,
        "train.num_anchors": 4,
        "eval.every": 0,
        "run.drafter_devices": ["cpu"],
    }
    sets = [f"{k}={json.dumps(v)}" for k, v in config.items()]
    out = tmp_path / "features"
    argv = ["cache-features", "--config", "tiny-cpu", "--out", str(out), "--batch-size", "4"]
    assert data_main(argv + [a for s in sets for a in ("--set", s)]) == 0
    assert "feature cache complete: 6 sequences" in capsys.readouterr().out
    cfg = load_config(
        "tiny-cpu",
        {
            **config,
            "output_dir": str(tmp_path / "run"),
            "max_steps": 2,
            "data.source": "features",
            "data.path": str(out),
        },
    )
    target = load_target(HYBRID, "cpu", torch.float32, layer_ids=[1, 3, 5], tiny=cfg.target.tiny or None)
    manifest = json.loads((out / "manifest.json").read_text())
    cached = open_cache(str(out), {k: manifest[k] for k in ("target", "layer_ids", "seq_len")})
    rows = torch.arange(len(cached))
    ids, mask = cached.input_ids[rows], cached.attention_mask[rows]
    expected = target.features(ids, attention_mask=mask)
    got = cached.features(rows).float()
    on = mask.bool()
    torch.testing.assert_close(got[on], expected[on].to(torch.bfloat16).float())  # bf16 on disk
    assert train(cfg, out=io.StringIO()).steps_done == 2


def test_a_generator_that_knows_its_free_memory_batches_by_it(generator, monkeypatch):
    two = int(2 * gm.sequence_bytes(generator.config, 16 + 6, 16, generator.dtype_bytes) / gm.FREE_SHARE) + 1
    monkeypatch.setattr(generator, "free_bytes", two)
    assert generator.batches([16] * 5) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert generator.batch_rule() == "free memory" and generator.records_per_chunk() >= 1
