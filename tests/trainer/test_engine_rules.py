"""Export refuses what an inference engine would reject or serve wrongly (one test per rule), and
writes how to serve what it accepts."""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import torch

from trainer.cli.main import main
from trainer.infer.engine_rules import ExportRefused, check_engine_rules, engine_rule_problem
from trainer.infer.export import export_config
from trainer.infer.serve_recipe import ServeRecipe
from trainer.model import DrafterConfig

CFG = DrafterConfig(
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=512,
    mask_token_id=511,
    target_layer_ids=[1, 2, 3],
    num_layers=1,
    block_size=8,
    num_target_layers=6,
)


def clean():
    config = export_config(CFG, torch.float32)
    shapes = {"fc.weight": (64, 3 * 64), "norm.weight": (64,), "hidden_norm.weight": (64,)}
    return config, shapes


def refused(config, shapes) -> str:
    with pytest.raises(ExportRefused) as caught:
        check_engine_rules(config, shapes, CFG.rope_theta)
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    return str(caught.value)


def test_the_trainers_own_export_breaks_no_rule():
    assert engine_rule_problem(*clean(), CFG.rope_theta) is None


def test_fc_input_must_be_hidden_times_target_layers():
    config, shapes = clean()
    shapes["fc.weight"] = (64, 2 * 64)
    assert "fc.weight takes 128 inputs" in refused(config, shapes)


def test_a_mask_hidden_weight_is_refused():
    config, shapes = clean()
    shapes["mask_hidden"] = (64,)
    assert "mask_hidden" in refused(config, shapes)


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(layer_types=["sliding_attention"]),
        lambda c: c.update(is_causal=True),
        lambda c: c["dflash_config"].update(causal=True),
    ],
)
def test_causal_layers_are_refused(change):
    config, shapes = clean()
    change(config)
    assert "causal" in refused(config, shapes) or "sliding_attention" in refused(config, shapes)


@pytest.mark.parametrize(
    "change, word",
    [
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "yarn"),
        (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.25), "partial_rotary_factor"),
        (lambda c: c.update(is_neox_style=False), "neox"),
        (lambda c: c["rope_parameters"].update(rope_theta=1e4), "rope_theta"),
        (lambda c: c["rope_parameters"].update(mrope_section=[2, 3, 3]), "mrope"),
    ],
)
def test_a_rope_other_than_the_trained_one_is_refused(change, word):
    config, shapes = clean()
    change(config)
    assert word in refused(config, shapes)


@pytest.mark.parametrize("mask", [None, 512, -1, "511"])
def test_mask_token_id_missing_or_out_of_range(mask):
    config, shapes = clean()
    config["dflash_config"]["mask_token_id"] = mask
    assert "mask_token_id" in refused(config, shapes)


@pytest.mark.parametrize("ids", [None, [], [1, 2, 6], [1, 1, 3], [-1, 2, 3]])
def test_target_layer_ids_missing_or_out_of_range(ids):
    config, shapes = clean()
    config["dflash_config"]["target_layer_ids"] = ids
    assert "target_layer_ids" in refused(config, shapes)


def test_serve_recipe_counts_and_quotes():
    recipe = ServeRecipe(
        target="/models/my target's dir",
        draft="/out/draft dir",
        block_size=16,
        chat_template_kwargs={"enable_thinking": False},
    )
    vllm = shlex.split(recipe.vllm_command())
    assert vllm[:3] == ["vllm", "serve", "/models/my target's dir"] and vllm[3] == "--speculative-config"
    assert json.loads(vllm[4]) == {
        "method": "dflash",
        "model": "/out/draft dir",
        "num_speculative_tokens": 15,
    }
    sglang = shlex.split(recipe.sglang_command())
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "16"
    assert sglang[sglang.index("--model-path") + 1] == "/models/my target's dir"
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == "/out/draft dir"
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "DFLASH" and "--trust-remote-code" in sglang
    assert any('"enable_thinking": false' in note for note in recipe.notes())


def _tiny_checkpoint(tmp_path):
    """A real checkpoint of a 2-step tiny run."""
    out = tmp_path / "run"
    assert (
        main(
            [
                "--config",
                "tiny-cpu",
                "--output-dir",
                str(out),
                "--max-steps",
                "2",
                "--set",
                "eval.every=0",
                "--set",
                "run.log_every=100",
            ]
        )
        == 0
    )
    return out


def test_export_writes_and_prints_the_serve_recipe(tmp_path, capsys):
    run = _tiny_checkpoint(tmp_path)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "draft")]) == 0
    printed = capsys.readouterr().out
    recipe = json.loads((tmp_path / "draft" / "serve.json").read_text())
    assert recipe["block_size"] == 8 and recipe["vllm_speculative_config"]["num_speculative_tokens"] == 7
    assert recipe["vllm"] in printed and recipe["sglang"] in printed
    assert recipe["vllm"] in (tmp_path / "draft" / "SERVE.md").read_text()


def test_export_refuses_a_checkpoint_with_a_mask_hidden_weight(tmp_path, capsys):
    from trainer.train.checkpoint import load_checkpoint, resolve_export_source
    import trainer.train.checkpoint as checkpoint

    run = _tiny_checkpoint(tmp_path)
    state = load_checkpoint(resolve_export_source(str(run)))
    planted = copy.copy(state)
    planted.weights = dict(state.weights, mask_hidden=torch.zeros(64))
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "load_checkpoint", lambda path: planted)
        code = main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "draft")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(err) == 1 and "mask_hidden" in err[0] and err[0].startswith("dflash-train: error:")
    )
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c, s: c.pop("block_size"), "block_size is missing"),
        (lambda c, s: c.update(block_size=1), "block_size must be >= 2"),
        (lambda c, s: c["dflash_config"].update(target_layer_ids=[1, True, 3]), "must be whole numbers"),
        (lambda c, s: c["dflash_config"].update(target_layer_ids=[1, 2.0, 3]), "must be whole numbers"),
        (lambda c, s: c.pop("num_target_layers"), "num_target_layers is missing"),
        (lambda c, s: c.update(num_target_layers=0), "num_target_layers is missing"),
        (lambda c, s: s.pop("fc.weight"), "the weights have no 2-d fc.weight"),
        (lambda c, s: s.update({"fc.weight": (64 * 3,)}), "the weights have no 2-d fc.weight"),
        (lambda c, s: c["dflash_config"].update(mask_token_id=True), "mask_token_id is missing"),
        (lambda c, s: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (lambda c, s: c.update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ],
)
def test_each_remaining_rule_names_what_breaks_it(change, words):
    config, shapes = clean()
    change(config, shapes)
    message = refused(config, shapes)
    assert (
        words in message and message.startswith("cannot export: ") and "Fix: export the checkpoint" in message
    )


def test_the_first_broken_rule_is_the_one_reported():
    config, shapes = clean()
    config["dflash_config"]["mask_token_id"] = None
    shapes["mask_hidden"] = (64,)
    assert "mask_token_id" in engine_rule_problem(config, shapes, CFG.rope_theta), (
        "the config before the weights"
    )
    config["dflash_config"]["target_layer_ids"] = []
    assert "target_layer_ids" in engine_rule_problem(config, shapes, CFG.rope_theta)
