"""`eval` and `data regenerate` agree on {"messages"} prompts for tiny-random: both render them
with the one chat tokenizer that target is used with (chat_tokenizer_of), so eval takes what
regenerate takes instead of refusing it."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.data.target import load_target
from trainer.data.prompts import load_prompts

try:
    from tests.trainer.test_eval_cli import run, run_dir  # noqa: F401 (run_dir: a fixture)
except ImportError:  # tests/trainer is not a package: pytest put it on sys.path
    from test_eval_cli import run, run_dir  # noqa: F401

pytestmark = pytest.mark.timeout(240)
MESSAGES = [
    {"role": "user", "content": "sort a list in python"},
    {"role": "assistant", "content": "sorted(x)"},
]


def test_eval_takes_the_messages_prompts_regenerate_takes(run_dir, tmp_path):
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    code, out, err = run(
        ["--checkpoint", str(run_dir), "--prompts", str(prompts), "--max-new-tokens", "4", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["prompts"] == 1


def test_both_render_a_chat_to_the_same_tokens(tmp_path):
    from trainer.data.chat_tokenizer import chat_tokenizer_of

    target = load_target("tiny-random", "cpu", torch.float32, layer_ids=[0], seed=0)
    tokenizer = chat_tokenizer_of(target, "tiny-random")
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    [ids] = load_prompts(str(prompts), tokenizer, target.vocab_size)
    text = tokenizer.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    assert ids == list(tokenizer.encode(text, add_special_tokens=False))  # regenerate's prompt_ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(60)
def test_the_byte_chat_tokenizer_builds_at_a_real_vocabulary_and_decodes_every_id():
    """At Qwen3.6's 248,320 ids (a real-size tiny target): all ids exist, reserved ones decode to
    nothing, and it builds in seconds (the wrapper's special-token path took minutes)."""
    from trainer.data.chat_tokenizer import byte_chat_tokenizer

    tok = byte_chat_tokenizer(248_320)
    ids = tok.apply_chat_template([{"role": "user", "content": "hé"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(tok) == 248_320
    assert tok.decode(ids + [248_319, 200_000], skip_special_tokens=True) == "user\nhé\nassistant\n"
