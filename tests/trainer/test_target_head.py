"""The target's embedding and lm_head read alone from a model directory (trainer/data/target_head.py):
from one file or a sharded index, tied or not, and a directory that cannot give them is one line
naming target.spec and the fix."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ConfigError
from trainer.data.target import tiny_target
from trainer.data.target_head import load_target_head, weight_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def saved(tmp_path, name: str, **save) -> tuple[object, str]:
    """A tiny target and the directory it was saved to."""
    model = tiny_target("cpu", torch.float32, 0, save.pop("tiny", None))
    path = tmp_path / name
    model.save_pretrained(path, **save)
    return model, str(path)


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    model, path = saved(tmp_path, "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the test needs more than one shard"
    head = load_target_head(path, torch.float32)
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight)
    assert head.vocab_size == 512 and head.hidden_size == 64 and head.num_layers == 6
    assert head.layer_ids == load_target_head("tiny-random", torch.float32).layer_ids, "the same default taps"


def test_tied_embeddings_give_one_weight_for_both(tmp_path):
    model, path = saved(tmp_path, "tied", tiny={"tie_word_embeddings": True})
    head = load_target_head(path, torch.bfloat16)
    assert head.lm_head.weight is head.embed_tokens.weight and head.dtype == torch.bfloat16
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight.bfloat16())
    assert not head.lm_head.weight.requires_grad
    logits = head.lm_head(torch.ones(1, head.hidden_size, dtype=torch.bfloat16))
    assert logits.shape == (1, head.vocab_size)


def test_the_head_is_frozen_and_its_layer_ids_are_checked(tmp_path):
    _, path = saved(tmp_path, "plain")
    head = load_target_head(path, torch.float32, layer_ids=[0, 5])
    assert head.layer_ids == [0, 5] and not head.embed_tokens.weight.requires_grad
    with pytest.raises(ConfigError, match="layer"):
        load_target_head(path, torch.float32, layer_ids=[6])


def test_a_directory_without_safetensors_weights_is_one_line_with_the_fix(tmp_path):
    model, path = saved(tmp_path, "bin")
    for weights in (tmp_path / "bin").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ConfigError) as err:
        load_target_head(path, torch.float32)
    message = str(err.value)
    assert message.startswith(f"target.spec: {path!r} has no model.safetensors(.index.json)")
    assert "Fix:" in message and "\n" not in message


def test_weights_without_an_embedding_are_named(tmp_path):
    from safetensors.torch import save_file

    model, path = saved(tmp_path, "renamed")
    weights = {"model.norm.weight": model.model.norm.weight.detach().clone()}
    save_file(weights, str(tmp_path / "renamed" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"^target.spec: no \*embed_tokens.weight tensor in "):
        load_target_head(path, torch.float32)


def test_a_spec_that_is_neither_tiny_nor_a_directory_says_what_to_point_it_at(tmp_path):
    with pytest.raises(ConfigError, match="is neither a tiny-random spec nor a local directory. Fix: point"):
        load_target_head(str(tmp_path / "Qwen/Qwen3-8B"), torch.float32)


def test_what_a_head_only_load_saves_is_everything_but_embedding_and_head(tmp_path):
    untied, _ = saved(tmp_path, "u")
    tied, _ = saved(tmp_path, "t", tiny={"tie_word_embeddings": True})
    for model, tables in ((untied, 2), (tied, 1)):
        sizes = weight_bytes(model.config, bytes_per_param=4)
        total = sum(p.numel() for p in model.parameters()) * 4
        assert sizes["total"] == total
        assert sizes["embed_and_lm_head"] == tables * 512 * 64 * 4
        assert sizes["saved"] == total - sizes["embed_and_lm_head"]


def _no_weight_map(d):
    (d / "model.safetensors.index.json").write_text("{}")


def _index_a_list(d):
    (d / "model.safetensors.index.json").write_text("[1]")


def _a_shard_missing(d):
    sorted(d.glob("model-*.safetensors"))[0].unlink()


def _config_a_directory(d):
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


@pytest.mark.parametrize("damage, said", [
    (_no_weight_map, "cannot read the embedding and lm_head from {path!r}: KeyError: 'weight_map'. Fix: "),
    (_index_a_list, "cannot read the embedding and lm_head from {path!r}: TypeError: "),
    (_a_shard_missing, "cannot read the embedding and lm_head from {path!r}: FileNotFoundError: "),
    (_config_a_directory, "cannot read the model config in {path!r}: ValueError: "),
])
def test_a_damaged_model_directory_is_one_config_error_for_the_head_and_the_whole_target(tmp_path, damage, said):
    """A feature-cache run's head (and the whole target eval and training load) raised KeyError, TypeError,
    FileNotFoundError or ValueError from deep inside transformers: a traceback, or 'training failed', exit 1."""
    from trainer.data.target import load_target

    _, path = saved(tmp_path, "damaged", max_shard_size="100KB")
    damage(tmp_path / "damaged")
    with pytest.raises(ConfigError) as err:
        load_target_head(path, torch.float32)
    message = str(err.value)
    assert message.startswith("target.spec: " + said.format(path=path)) and "\n" not in message, message
    with pytest.raises(ConfigError, match="^target.spec: cannot (load a causal LM from|read the model config in)"):
        load_target(path, "cpu", torch.float32, layer_ids=[0])


def test_damaged_safetensors_weights_are_one_config_error(tmp_path):
    from trainer.data.target import load_target

    _, path = saved(tmp_path, "cut")
    (tmp_path / "cut" / "model.safetensors").write_text("not safetensors")
    with pytest.raises(ConfigError, match=r"^target.spec: cannot read the embedding and lm_head from .*: SafetensorError: "):
        load_target_head(path, torch.float32)
    with pytest.raises(ConfigError, match=r"^target.spec: cannot load a causal LM from .*: SafetensorError: .*Fix: "):
        load_target(path, "cpu", torch.float32, layer_ids=[0])
