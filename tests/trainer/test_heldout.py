"""Evaluation prompts training never sees (trainer/data/heldout.py): the held-out split as a partition
fixed by (seed, rows, fraction), a row's prompt as its real tokens before its first trained one, and
where eval_prompts takes its prompts from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.data.dataset import DataError, Dataset
from trainer.data.heldout import eval_prompts, eval_split, heldout_count, prompts_of, split_heldout


def numbered(rows: int, width: int = 5) -> Dataset:
    """Row r holds the tokens r*100 .. r*100+width-1, trained from position 2 on."""
    ids = torch.arange(width).repeat(rows, 1) + 100 * torch.arange(rows).unsqueeze(1)
    loss = torch.zeros(rows, width, dtype=torch.bool)
    loss[:, 2:] = True
    return Dataset(ids, loss, torch.ones(rows, width, dtype=torch.bool), "d.jsonl")


def row_numbers(dataset: Dataset) -> list[int]:
    return [int(r) // 100 for r in dataset.input_ids[:, 0]]


@pytest.mark.parametrize("rows, fraction", [(10, 0.1), (10, 0.25), (7, 0.5), (100, 0.01), (3, 0.001)])
def test_the_split_is_a_partition_kept_in_row_order(rows, fraction):
    kept, held = split_heldout(numbered(rows), fraction, seed=4)
    assert len(held) == heldout_count(rows, fraction) == max(1, round(rows * fraction))
    kept_rows, held_rows = row_numbers(kept), row_numbers(held)
    assert sorted(kept_rows + held_rows) == list(range(rows))
    assert kept_rows == sorted(kept_rows) and held_rows == sorted(held_rows)
    assert torch.equal(held.loss_mask, numbered(rows).loss_mask[held_rows]), "masks travel with their rows"
    assert kept.source == f"d.jsonl ({len(held)} held out)" and held.source == "d.jsonl (held-out split)"


def test_the_split_depends_only_on_seed_rows_and_fraction():
    data = numbered(50)
    first = row_numbers(split_heldout(data, 0.2, seed=1)[1])
    torch.manual_seed(123)  # the global RNG plays no part
    assert row_numbers(split_heldout(data, 0.2, seed=1)[1]) == first
    others = {tuple(row_numbers(split_heldout(data, 0.2, seed=s)[1])) for s in range(2, 6)}
    assert len(others | {tuple(first)}) > 1, "other seeds hold out other rows"


def test_no_fraction_holds_nothing_out_and_a_fraction_that_takes_everything_is_refused():
    data = numbered(4)
    kept, held = split_heldout(data, 0.0, seed=0)
    assert kept is data and held is None and heldout_count(4, -1) == 0
    with pytest.raises(
        DataError, match=r"^d.jsonl: data.eval_fraction 0.9 holds out all 4 sequences. Fix: lower"
    ):
        split_heldout(data, 0.9, seed=0)


def test_a_prompt_is_the_real_tokens_before_the_first_trained_one():
    ids = torch.tensor([[0, 0, 7, 8, 9, 4], [5, 6, 7, 8, 0, 0], [1, 2, 3, 4, 5, 6], [3, 3, 3, 3, 3, 3]])
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1] * 6, [1] * 6], dtype=torch.bool)
    loss = torch.zeros(4, 6, dtype=torch.bool)
    loss[0, 4:] = True  # left padded: the prompt skips the padding
    loss[2, 0:] = True  # trained from the first token: no prompt, the row is skipped
    # row 1 and row 3 have no trained token: the prompt is the whole of their real tokens
    prompts = prompts_of(Dataset(ids, loss, real, "x"))
    assert prompts == [[7, 8], [5, 6, 7, 8], [3, 3, 3, 3, 3, 3]]


def test_eval_prompts_come_from_the_file_then_the_split_then_fresh_synthetic_ones(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [i, i + 1]}) + "\n" for i in range(5)))
    target = SimpleNamespace(tokenizer=None, vocab_size=512, mask_token_id=511)
    from_file = load_config("tiny-cpu", {"eval.path": str(path)})
    assert eval_prompts(from_file, target, numbered(3), 3) == [[0, 1], [1, 2], [2, 3]]
    assert eval_split(from_file) == "held-out"
    synthetic = load_config("tiny-cpu", {})
    assert eval_split(synthetic) == "held-in"
    assert eval_prompts(synthetic, target, numbered(3), 2) == [[0, 1], [100, 101]], "the split comes first"
    fresh = eval_prompts(synthetic, target, None, 4)
    assert len(fresh) == 4 and all(len(p) == synthetic.data.synthetic.prompt_len for p in fresh)
    assert all(t != 511 for p in fresh for t in p)
    jsonl = load_config("tiny-cpu", {"data.source": "jsonl", "data.path": "d.jsonl"})
    with pytest.raises(
        ConfigError, match=r"no evaluation prompts: .* Fix: set one of them, or pass --prompts"
    ):
        eval_prompts(jsonl, target, None, 4)


def test_eval_path_chats_render_for_a_tiny_target_as_eval_prompts_do_and_a_missing_one_names_eval_path(tmp_path):
    """A tiny target has no tokenizer: eval.path's {"messages"} rows failed ("no tokenizer with a chat
    template", exit 2) where `eval --prompts` renders them with the byte-level ChatML one; a missing
    eval.path said "Fix: pass an existing .jsonl file to --prompts" during training."""
    from trainer.data.chat_tokenizer import byte_chat_tokenizer
    from trainer.data.prompts import load_prompts

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    target = SimpleNamespace(tokenizer=None, vocab_size=512, mask_token_id=511)
    cfg = load_config("tiny-cpu", {"eval.path": str(path)})
    assert eval_prompts(cfg, target, None, 3) == load_prompts(str(path), byte_chat_tokenizer(512), 512)
    missing = load_config("tiny-cpu", {"eval.path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(DataError, match=r"prompts file not found. Fix: pass an existing .jsonl file to eval.path.$"):
        eval_prompts(missing, target, None, 3)
