"""Export format, and trainer logits == inference-side reference logits on real target features."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.conftest import EXPORT_BLOCK as BLOCK
from tests.trainer.reference_drafter import ReferenceDrafter
from trainer.infer.export import (
    WEIGHTS_FILE,
    drafter_config_from_export,
    export_drafter,
    export_weights,
)
from trainer.masks import dense_mask
from trainer.model import DFlashDrafter, DrafterConfig


@pytest.fixture(scope="module")
def exported(drafter, tmp_path_factory):
    return export_drafter(drafter, tmp_path_factory.mktemp("export"))


def expected_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


def test_export_files_and_config(exported, target):
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == BLOCK
    assert config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 2, 3]}
    assert config["num_hidden_layers"] == 2
    weights = load_file(str(exported / "model.safetensors"))
    assert set(weights) == expected_names(2)
    assert weights["fc.weight"].shape == (64, 3 * 64)
    assert not (exported / "model.safetensors.tmp").exists()


def test_config_loads_as_a_qwen3_config(exported, target):
    from transformers import Qwen3Config

    cfg = Qwen3Config.from_pretrained(exported)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 2, 16, 512)
    assert cfg.intermediate_size == target.config.intermediate_size
    assert cfg.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]


def test_trainer_logits_equal_inference_reference(drafter, exported, target):
    g = torch.Generator().manual_seed(11)
    seq_len = 20
    input_ids = torch.randint(0, 511, (2, seq_len), generator=g)
    context = target.features(input_ids)
    # first position (empty cache), interior, and last possible anchor (block runs off the end)
    anchors = torch.tensor([[0, 5, 6, 13, seq_len - 2], [2, 9, 17, 0, 0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    mask = dense_mask(anchors, valid, seq_len, BLOCK, "cpu")
    with torch.no_grad():
        logits = drafter.logits(drafter(context, input_ids, anchors, mask, backend="sdpa"))
    logits = logits.view(2, 5, BLOCK, -1).double()

    reference = ReferenceDrafter(exported, target.embed_tokens.weight, target.lm_head.weight)
    checked = 0
    for b in range(2):
        for n in range(5):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            # at inference the cache holds target features of positions 0..a-1; the anchor is next
            ref = reference.block_logits(context[b, :a], int(input_ids[b, a]))
            assert ref.shape == (BLOCK, 512)
            scale = ref.abs().max()
            assert torch.allclose(logits[b, n], ref, atol=2e-5 * scale, rtol=1e-4), (b, n, a)
            checked += 1
    assert checked == 8


def test_reference_would_notice_a_context_off_by_one(drafter, exported, target):
    # Guard for the test above: feeding the anchor's own feature changes the reference output,
    # so a training mask that showed it (`<=`) could not match.
    ids = torch.randint(0, 511, (1, 12), generator=torch.Generator().manual_seed(2))
    context = target.features(ids)[0]
    reference = ReferenceDrafter(exported, target.embed_tokens.weight, target.lm_head.weight)
    strict = reference.block_logits(context[:6], int(ids[0, 6]))
    inclusive = reference.block_logits(context[:7], int(ids[0, 6]))
    assert not torch.allclose(strict, inclusive, atol=1e-3)


def load_drafter(export_dir, embed_tokens, lm_head) -> DFlashDrafter:
    """A trainer-side DFlashDrafter from an export directory."""
    drafter = DFlashDrafter(drafter_config_from_export(export_dir), embed_tokens, lm_head)
    weights = load_file(str(export_dir / WEIGHTS_FILE))
    drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) for k, v in weights.items()})
    return drafter


def test_load_drafter_round_trip(drafter, exported, target):
    again = load_drafter(exported, target.embed_tokens, target.lm_head)
    assert again.cfg == drafter.cfg
    for name, value in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_bf16_export(drafter, target, tmp_path):
    export_drafter(drafter, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert all(w.dtype == torch.bfloat16 for w in weights.values())


def test_export_needs_the_target_layer_count(target, tmp_path):
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BLOCK, num_target_layers=None)
    with pytest.raises(ValueError, match="num_target_layers.*Fix"):
        export_drafter(DFlashDrafter(cfg, target.embed_tokens, target.lm_head), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_reference_refuses_a_foreign_layout(exported, target, tmp_path):
    weights = load_file(str(exported / "model.safetensors"))
    weights["layers.0.self_attn.query.weight"] = weights.pop("layers.0.self_attn.q_proj.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((exported / "config.json").read_text())
    with pytest.raises(ValueError, match="q_proj"):
        ReferenceDrafter(tmp_path, target.embed_tokens.weight, target.lm_head.weight)


def test_export_from_a_state_dict_without_a_target(drafter, exported, tmp_path):
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    export_weights(state, drafter.cfg, tmp_path)
    assert (tmp_path / "config.json").read_text() == (exported / "config.json").read_text()
    a, b = load_file(str(tmp_path / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        export_weights(state, drafter.cfg, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
