"""Prompts read from JSONL (trainer/data/prompts.py): token ids as given, chats rendered with a generation
prompt and without the reference answer, and every bad record one DataError naming file:line."""

from __future__ import annotations

import json

import pytest

from trainer.data.dataset import DataError
from trainer.data.prompts import load_prompts


class Tokenizer:
    """Renders a chat as `role:content` parts and encodes each part as its length."""

    chat_template = "x"

    def __init__(self):
        self.kwargs = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        assert tokenize is False and add_generation_prompt is True
        self.kwargs.append(kwargs)
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False, "the template already placed the special tokens"
        return [len(part) for part in text.split("|")]


def prompts_file(tmp_path, *records, raw: str = "") -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw, encoding="utf-8")
    return str(path)


def test_ids_are_taken_as_given_and_blank_lines_skipped(tmp_path):
    path = prompts_file(
        tmp_path, {"input_ids": [5, 6]}, raw="\n   \n" + json.dumps({"input_ids": [0]}) + "\n"
    )
    assert load_prompts(path, vocab_size=7) == [[5, 6], [0]]
    assert load_prompts(path) == [[5, 6], [0]], "no vocabulary given: nothing to check against"


def test_a_chat_is_rendered_without_its_final_answer_and_with_the_runs_template_arguments(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answered = chat + [{"role": "assistant", "content": "hello there"}]
    path = prompts_file(tmp_path, {"messages": answered}, {"messages": chat})
    tokenizer = Tokenizer()
    prompts = load_prompts(path, tokenizer, 512, {"enable_thinking": False})
    assert prompts == [[len("system:be brief"), len("user:hi")]] * 2
    assert tokenizer.kwargs == [{"enable_thinking": False}] * 2


@pytest.mark.parametrize(
    "record, words",
    [
        ({"input_ids": []}, "input_ids must be a non-empty list of integers."),
        ({"input_ids": [1, True]}, "input_ids must be a non-empty list of integers."),
        ({"input_ids": [1.0]}, "input_ids must be a non-empty list of integers."),
        ({"input_ids": "1 2"}, "input_ids must be a non-empty list of integers."),
        ({"input_ids": [3, 9]}, "token 9 is outside the target's vocabulary (0..7). Fix: tokenize with"),
        ({"input_ids": [-1]}, "token -1 is outside the target's vocabulary"),
        ({"text": "hi"}, 'expected {"messages": [...]} or {"input_ids": [...]}.'),
        ([1, 2], 'expected {"messages": [...]} or {"input_ids": [...]}.'),
        ({"messages": []}, 'messages must be a non-empty list of {"role": one of'),
        ({"messages": [{"role": "user", "content": 5}]}, "messages must be a non-empty list"),
        (
            {"messages": [{"role": "assistant", "content": "x"}]},
            "only an assistant turn: nothing to prompt with.",
        ),
    ],
)
def test_a_bad_record_names_its_line_and_the_fix(tmp_path, record, words):
    path = prompts_file(tmp_path, {"input_ids": [1]}, record)
    with pytest.raises(DataError) as err:
        load_prompts(path, Tokenizer(), vocab_size=8)
    assert str(err.value).startswith(f"{path}:2: ") and words in str(err.value)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


@pytest.mark.parametrize("tokenizer", [None, type("NoTemplate", (), {"chat_template": None})()])
def test_chats_without_a_chat_template_ask_for_token_ids(tmp_path, tokenizer):
    path = prompts_file(tmp_path, {"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(
        DataError, match=r":1: record has messages, but the target has no tokenizer with a chat"
    ):
        load_prompts(path, tokenizer, 512)


def test_an_empty_or_missing_file_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"prompts.jsonl: no prompts. Fix: one JSON object per line."):
        load_prompts(prompts_file(tmp_path, raw="\n\n"))
    with pytest.raises(DataError, match=r"missing.jsonl: prompts file not found. Fix: pass an existing"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match=r"prompts.jsonl:1: not valid JSON \(.* at column 2\)"):
        load_prompts(prompts_file(tmp_path, raw="{x\n"))
