"""Training data: JSONL records, chat templates, bad records named by file:line, deterministic order."""
from __future__ import annotations

import json
import random

import pytest
import torch

from trainer.data.dataset import BatchPlan, DataError, derive_seed, load_jsonl, make_batch, synthetic_dataset

VOCAB = 100


def write_jsonl(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")
    return str(path)


# ---- pre-tokenized ------------------------------------------------------------------------

def test_records_are_padded_and_truncated_to_seq_len(tmp_path):
    path = write_jsonl(tmp_path, [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": list(range(10, 20)), "loss_mask": [1] * 10},
        "",  # blank lines are allowed
    ])
    ds = load_jsonl(path, seq_len=6, vocab_size=VOCAB, pad_id=99)
    assert ds.input_ids.tolist() == [[5, 6, 7, 99, 99, 99], [10, 11, 12, 13, 14, 15]]
    assert ds.loss_mask.tolist() == [[False, True, True, False, False, False], [True] * 6]
    assert ds.attention_mask.tolist() == [[True, True, True, False, False, False], [True] * 6]
    assert ds.input_ids.dtype == torch.long and ds.loss_mask.dtype == torch.bool


@pytest.mark.parametrize("bad, says", [
    ('{"input_ids": [1, 2], "loss_mask": [1]', "not valid JSON"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask has 1 entries but input_ids has 2"),
    ({"input_ids": [1, 2]}, "loss_mask is missing"),
    ({"input_ids": [1, "x"], "loss_mask": [1, 1]}, "list of integers"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "0/1"),
    ({"input_ids": [1, 100], "loss_mask": [1, 1]}, "input_ids[1] = 100 is outside the target's vocabulary"),
    ({"text": "hello"}, "expected"),
    ([1, 2, 3], "JSON object"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no tokenizer"),
])
def test_a_bad_record_is_named_by_file_and_line(tmp_path, bad, says):
    good = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    path = write_jsonl(tmp_path, [good, good, bad, good])  # the bad one is on line 3
    with pytest.raises(DataError) as err:
        load_jsonl(path, seq_len=8, vocab_size=VOCAB)
    assert str(err.value).startswith(f"{path}:3: ")
    assert says in str(err.value)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_jsonl(str(tmp_path / "nope.jsonl"), 8, VOCAB)
    with pytest.raises(DataError, match="no records"):
        load_jsonl(write_jsonl(tmp_path, [""]), 8, VOCAB)


def test_data_with_nothing_to_learn_inside_seq_len_is_refused(tmp_path):
    path = write_jsonl(tmp_path, [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}])
    with pytest.raises(DataError, match="raise data.seq_len"):
        load_jsonl(path, seq_len=2, vocab_size=VOCAB)


# ---- chat messages ------------------------------------------------------------------------

WORDS = ["<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system",
         "hello", "world", "hi", "there", "how", "are", "you", "fine", "thanks"]
CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word_tokenizer(template: str):
    """A real transformers fast tokenizer over a word vocabulary, with a ChatML-like template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    tok.chat_template = template
    return tok


def ids(*words):
    return [WORDS.index(w) for w in words]


def test_messages_train_on_assistant_turns_only(tmp_path):
    conversation = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi there"},
                    {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}]
    path = write_jsonl(tmp_path, [{"messages": conversation}])
    ds = load_jsonl(path, seq_len=24, vocab_size=len(WORDS), tokenizer=word_tokenizer(CHATML))
    # Expected by hand from the template: each turn is "<|im_start|> role content <|im_end|>".
    user1 = ids("<|im_start|>", "user", "hello", "world", "<|im_end|>")
    asst1_prompt, asst1 = ids("<|im_start|>", "assistant"), ids("hi", "there", "<|im_end|>")
    user2 = ids("<|im_start|>", "user", "how", "are", "you", "<|im_end|>")
    asst2_prompt, asst2 = ids("<|im_start|>", "assistant"), ids("fine", "thanks", "<|im_end|>")
    expected_ids = user1 + asst1_prompt + asst1 + user2 + asst2_prompt + asst2
    expected_mask = ([0] * len(user1 + asst1_prompt) + [1] * len(asst1) + [0] * len(user2 + asst2_prompt)
                     + [1] * len(asst2))
    n = len(expected_ids)
    assert ds.input_ids[0, :n].tolist() == expected_ids
    assert ds.loss_mask[0, :n].int().tolist() == expected_mask
    assert not ds.loss_mask[0, n:].any() and not ds.attention_mask[0, n:].any()


def test_template_that_rewrites_earlier_turns_is_reported(tmp_path):
    # Drops the content of every assistant turn but the last (like templates that strip reasoning).
    rewriting = ("{% for m in messages %}<|im_start|> {{ m['role'] }} "
                 "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }} {% endif %}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                    {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}]
    path = write_jsonl(tmp_path, [{"messages": conversation}])
    with pytest.raises(DataError, match=rf"{path}:1: .*messages\[1\].*pre-tokenize"):
        load_jsonl(path, 32, len(WORDS), tokenizer=word_tokenizer(rewriting))


def test_malformed_messages_are_named(tmp_path):
    path = write_jsonl(tmp_path, [{"messages": [{"role": "user", "content": "hi"},
                                                {"role": "robot", "content": "hello"}]}])
    with pytest.raises(DataError, match=r":1: messages\[1\] must be"):
        load_jsonl(path, 32, len(WORDS), tokenizer=word_tokenizer(CHATML))
    path = write_jsonl(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}], name="u.jsonl")
    with pytest.raises(DataError, match="no assistant turn"):
        load_jsonl(path, 32, len(WORDS), tokenizer=word_tokenizer(CHATML))


# ---- order ----------------------------------------------------------------------------------

def test_each_epoch_visits_every_full_step_once_and_epochs_differ():
    plan = BatchPlan(num_samples=23, batch_size=2, num_replicas=3, seed=7)
    assert plan.steps_per_epoch == 3  # 23 // 6, the remainder is dropped
    for epoch in range(2):
        seen = [int(i) for pos in range(3) for r in range(3)
                for i in plan.indices(epoch * 3 + pos, r)]
        assert len(seen) == len(set(seen)) == 18 and all(0 <= i < 23 for i in seen)
    assert plan.indices(0, 0).tolist() != plan.indices(3, 0).tolist() or \
        plan.indices(0, 1).tolist() != plan.indices(3, 1).tolist()
    assert plan.position(7) == {"step": 7, "epoch": 2, "position": 1}


def test_batch_for_a_step_is_independent_of_call_order_and_instance():
    calls = [(s, r) for s in range(12) for r in range(2)]
    first = BatchPlan(40, 3, 2, seed=11)
    expected = {c: first.indices(*c).tolist() for c in calls}
    shuffled = calls[:]
    random.Random(0).shuffle(shuffled)  # like threads asking in any order, or a resumed run
    second = BatchPlan(40, 3, 2, seed=11)
    assert {c: second.indices(*c).tolist() for c in shuffled} == expected
    other_seed = BatchPlan(40, 3, 2, seed=12)
    assert [other_seed.indices(*c).tolist() for c in calls] != [expected[c] for c in calls]


def test_too_little_data_for_one_step_says_what_to_change():
    with pytest.raises(DataError, match="train.batch_size"):
        BatchPlan(num_samples=5, batch_size=3, num_replicas=2, seed=0)


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(1, 2) == derive_seed(1, 2)
    assert len({derive_seed(0, s, r) for s in range(50) for r in range(4)}) == 200
    assert 0 <= derive_seed(123, 456) < 2 ** 63


# ---- synthetic ------------------------------------------------------------------------------

def test_synthetic_data_is_the_targets_own_greedy_continuation(tiny_target_fixture):
    target = tiny_target_fixture
    ds = synthetic_dataset(target, num_samples=6, prompt_len=4, seq_len=12, seed=3)
    assert ds.input_ids.shape == (6, 12)
    assert ds.loss_mask[:, :4].sum() == 0 and ds.loss_mask[:, 4:].all()
    assert (ds.input_ids[:, :4] != target.mask_token_id).all()
    # Independent check: one full forward over the finished sequences; every continuation token
    # must be the argmax of the target at the position before it.
    with torch.no_grad():
        logits = target.model(input_ids=ds.input_ids, use_cache=False).logits
    assert torch.equal(logits[:, 3:-1].argmax(-1), ds.input_ids[:, 4:])
    again = synthetic_dataset(target, num_samples=6, prompt_len=4, seq_len=12, seed=3)
    assert torch.equal(again.input_ids, ds.input_ids)
    other = synthetic_dataset(target, num_samples=6, prompt_len=4, seq_len=12, seed=4)
    assert not torch.equal(other.input_ids[:, :4], ds.input_ids[:, :4])


def test_make_batch_takes_the_planned_rows(tmp_path):
    rows = [{"input_ids": [i + 1] * 4, "loss_mask": [1] * 4} for i in range(8)]
    ds = load_jsonl(write_jsonl(tmp_path, rows), 4, VOCAB)
    plan = BatchPlan(8, 2, 2, seed=0)
    batch = make_batch(ds, plan, step=1, replica=1)
    picked = plan.indices(1, 1)
    assert batch.input_ids[:, 0].tolist() == [int(i) + 1 for i in picked]
    assert (batch.step, batch.replica) == (1, 1)


@pytest.fixture(scope="module")
def tiny_target_fixture():
    from trainer.data.target import load_target

    return load_target("tiny-random", "cpu", torch.float32, seed=0)


def test_a_truncated_line_is_reported_at_its_real_column(tmp_path):
    good = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    cut = '{"input_ids": [1, 2, 3],'  # 24 characters: the record stops after the comma
    path = write_jsonl(tmp_path, [good, cut, good])
    with pytest.raises(DataError) as info:
        load_jsonl(path, seq_len=6, vocab_size=VOCAB)
    assert f"{path}:2" in str(info.value) and f"at column {len(cut) + 1})" in str(info.value)


def test_a_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    """A byte that is not UTF-8 raised UnicodeDecodeError: a traceback, or 'training failed' (exit 1)."""
    from trainer.data.prompts import load_prompts

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n{"input_ids": [1], "note": "caf\xe9"}\n')
    for load in (lambda: load_jsonl(str(path), 8, VOCAB), lambda: load_prompts(str(path))):
        with pytest.raises(DataError) as err:
            load()
        assert str(err.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at offset 31). Fix: save the file as UTF-8."
