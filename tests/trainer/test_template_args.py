"""Chat-template arguments travel with the data: regenerate records them, the run renders with them and
keeps them in its config (hence its checkpoints), export and eval use them, eval warns when told otherwise."""

from __future__ import annotations

import argparse
import io
import json
import types

import pytest

from trainer.cli.data import main as data_main
from trainer.cli.eval import _template_kwargs
from trainer.infer.serve_recipe import recipe_for_checkpoint
from trainer.config import load_config
from trainer.data.dataset import load_jsonl
from trainer.template_args import read_for_data, side_file, write_for_data

NO_THINKING = {"enable_thinking": False}


def test_regenerate_records_its_template_arguments_beside_the_data(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    code = data_main(
        [
            "regenerate",
            "--target",
            "tiny-random",
            "--in",
            str(src),
            "--out",
            str(out),
            "--max-new-tokens",
            "2",
            "--chat-template-kwargs",
            json.dumps(NO_THINKING),
        ]
    )
    assert code == 0
    assert read_for_data(str(out)) == NO_THINKING


def _jsonl_config(tmp_path, **overrides):
    data = tmp_path / "data.jsonl"
    data.write_text("")
    return load_config("tiny-cpu", {"data.source": "jsonl", "data.path": str(data), **overrides}), data


def test_a_run_takes_the_datas_template_arguments_unless_set(tmp_path):
    cfg, data = _jsonl_config(tmp_path)
    assert cfg.data.chat_template_kwargs is None  # nothing recorded yet
    write_for_data(str(data), NO_THINKING)
    cfg, _ = _jsonl_config(tmp_path)
    assert cfg.data.chat_template_kwargs == NO_THINKING
    cfg, _ = _jsonl_config(tmp_path, **{"data.chat_template_kwargs": {"enable_thinking": True}})
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True}


class RecordingTokenizer:
    chat_template = "stub"

    def __init__(self):
        self.seen = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        self.seen.append(kwargs)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 100 for c in text]


def test_training_data_is_rendered_with_them(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        + "\n"
    )
    tokenizer = RecordingTokenizer()
    load_jsonl(str(path), 64, 100, tokenizer, 0, NO_THINKING)
    assert tokenizer.seen and all(kwargs == NO_THINKING for kwargs in tokenizer.seen)


def _eval_args(checkpoint, asked=None):
    return argparse.Namespace(checkpoint=str(checkpoint), chat_template_kwargs=asked)


def test_eval_uses_the_runs_arguments_and_warns_when_told_otherwise(tmp_path):
    run_config = {"data": {"chat_template_kwargs": NO_THINKING}}
    err = io.StringIO()
    assert _template_kwargs(_eval_args(tmp_path), run_config, err) == NO_THINKING and err.getvalue() == ""
    assert _template_kwargs(_eval_args(tmp_path, '{"enable_thinking": true}'), run_config, err) == {
        "enable_thinking": True
    }
    assert err.getvalue().count("\n") == 1 and '{"enable_thinking": false}' in err.getvalue()


def test_export_and_eval_of_an_export_carry_them(tmp_path):
    state = types.SimpleNamespace(
        config={"target": {"spec": "tiny-random"}, "data": {"chat_template_kwargs": NO_THINKING}},
        drafter_config={"block_size": 8},
    )
    recipe = recipe_for_checkpoint(state, tmp_path)
    assert recipe.chat_template_kwargs == NO_THINKING
    (tmp_path / "serve.json").write_text(json.dumps(recipe.to_dict()))
    assert _template_kwargs(_eval_args(tmp_path), None, io.StringIO()) == NO_THINKING
    assert side_file("x.jsonl") == "x.jsonl.chat-template.json"


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '{"chat_template_kwargs": ["enable_thinking"]}', "{}"]
)
def test_a_side_file_that_is_not_a_record_of_arguments_counts_as_none(tmp_path, text):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    (tmp_path / ("d.jsonl" + ".chat-template.json")).write_text(text)
    assert read_for_data(str(data)) is None
    assert read_for_data(None) is None and read_for_data(str(tmp_path / "absent.jsonl")) is None


def test_a_checkpoints_config_says_its_arguments_only_as_a_mapping():
    from trainer.template_args import run_chat_template_kwargs

    assert run_chat_template_kwargs({"data": {"chat_template_kwargs": NO_THINKING}}) == NO_THINKING
    for config in (None, {}, {"data": None}, {"data": {"chat_template_kwargs": "off"}}):
        assert run_chat_template_kwargs(config) is None


def test_the_warning_is_given_only_when_the_arguments_differ():
    from trainer.template_args import differs_warning

    assert differs_warning(None, {}) is None and differs_warning(NO_THINKING, dict(NO_THINKING)) is None
    warning = differs_warning(NO_THINKING, None)
    assert warning.startswith(
        'warning: the drafter\'s training data was rendered with chat_template_kwargs {"enable_thinking": false}, these prompts with {}'
    )
    assert "\n" not in warning
