"""Training data: fixed-length token sequences with a loss mask, in a resumable deterministic order.

Sources: JSONL records of `input_ids`+`loss_mask` or chat `messages` (loss on assistant turns), or
`synthetic` greedy target continuations. Sequences are padded to `seq_len` (a new shape recompiles);
a (step, replica)'s batch is a pure function of (seed, epoch, position), so a resume replays exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing

import torch

from trainer.data import kv_cache

ROLES = ("system", "user", "assistant", "tool")


class DataError(Exception):
    """A bad data file or record; the message names file:line and the fix."""

    exit_code = 2

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from a tuple of ints (seed, epoch, ...), stable across runs and platforms."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclasses.dataclass
class Dataset:
    input_ids: torch.Tensor  # [N, T] long
    loss_mask: torch.Tensor  # [N, T] bool: positions the drafter learns to predict
    attention_mask: torch.Tensor  # [N, T] bool: real tokens (False = padding)
    source: str
    # indices -> [B, T, K*H] target features, when they come from a cache (trainer.data.feature_cache)
    features: typing.Optional[typing.Callable[[torch.Tensor], torch.Tensor]] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclasses.dataclass
class Batch:
    step: int  # 0-based index of the optimizer step this batch is for
    replica: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    features: torch.Tensor | None = None  # target hidden states, filled in by a target worker
    # the step's anchors and attention mask, drawn ahead by the target worker (trainer.train.loop.Blocks)
    blocks: typing.Any = None


class BatchPlan:
    """Which sequences go to which (step, replica): a fixed shuffle per epoch, drop the remainder."""

    def __init__(self, num_samples: int, batch_size: int, num_replicas: int, seed: int, source: str = "data"):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.seed = seed
        self.per_step = batch_size * num_replicas
        if num_samples < self.per_step:
            raise DataError(
                source,
                f"{num_samples} sequences, but one step needs {self.per_step} "
                f"(train.batch_size {batch_size} x {num_replicas} drafter replicas). "
                f"Fix: add data, or lower train.batch_size / the number of drafter devices.",
            )
        self.steps_per_epoch = num_samples // self.per_step
        self._perm_cache: dict[int, torch.Tensor] = {}

    def total_steps(self, epochs: int, max_steps: int | None) -> int:
        total = epochs * self.steps_per_epoch
        return min(total, max_steps) if max_steps else total

    def position(self, step: int) -> dict:
        """Where step `step` (0-based) reads: epoch and step-within-epoch."""
        return {"step": step, "epoch": step // self.steps_per_epoch, "position": step % self.steps_per_epoch}

    def permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=gen)
            self._perm_cache = {epoch: perm}  # one epoch at a time is all anyone reads
        return perm

    def indices(self, step: int, replica: int) -> torch.Tensor:
        pos = self.position(step)
        start = pos["position"] * self.per_step + replica * self.batch_size
        return self.permutation(pos["epoch"])[start : start + self.batch_size]


def make_batch(dataset: Dataset, plan: BatchPlan, step: int, replica: int) -> Batch:
    idx = plan.indices(step, replica)
    features = dataset.features(idx) if dataset.features is not None else None
    return Batch(
        step, replica, dataset.input_ids[idx], dataset.loss_mask[idx], dataset.attention_mask[idx], features
    )


def jsonl_records(path: str, what: str, missing_fix: str):
    """(file:line, parsed record) for each non-blank line; DataError names the file or the line."""
    if not os.path.isfile(path):
        raise DataError(path, f"{what} file not found. Fix: {missing_fix}")
    with open(path, "rb") as f:  # decoded line by line: a byte that is not UTF-8 is named by its line
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = f"byte {raw[exc.start]:#04x} at offset {exc.start}"
                raise DataError(where, f"not UTF-8 text ({bad}). Fix: save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:  # without its line end, the error's column is the real one
                yield where, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DataError(
                    where, f"not valid JSON ({exc.msg} at column {exc.colno}). Fix: one JSON object per line."
                ) from None


def load_jsonl(
    path: str,
    seq_len: int,
    vocab_size: int,
    tokenizer=None,
    pad_id: int = 0,
    chat_template_kwargs: dict | None = None,
) -> Dataset:
    """Read and check every record; raises DataError at the first bad one (file:line)."""
    rows = []  # (input_ids, loss_mask, attention_mask) of each record, padded to seq_len
    for where, record in jsonl_records(path, "data", "set data.path to an existing .jsonl file."):
        if not isinstance(record, dict):
            raise DataError(where, "expected a JSON object with input_ids+loss_mask or messages.")
        if "messages" in record:
            ids, mask = _tokenize_messages(record["messages"], tokenizer, where, chat_template_kwargs)
        elif "input_ids" in record:
            ids, mask = _check_pretokenized(record, where)
        else:
            raise DataError(
                where,
                f'record has keys {sorted(record)}; expected {{"input_ids", "loss_mask"}} or {{"messages"}}.',
            )
        for i, tok in enumerate(ids):
            if not 0 <= tok < vocab_size:
                raise DataError(
                    where,
                    f"input_ids[{i}] = {tok} is outside the target's vocabulary "
                    f"(0..{vocab_size - 1}). Fix: tokenize with the target's tokenizer.",
                )
        ids, mask = ids[:seq_len], mask[:seq_len]
        pad = seq_len - len(ids)
        rows.append((ids + [pad_id] * pad, mask + [0] * pad, [1] * len(ids) + [0] * pad))
    if not rows:
        raise DataError(path, "no records. Fix: one JSON object per line.")
    rows_ids, rows_mask, rows_attn = zip(*rows, strict=True)
    dataset = Dataset(
        torch.tensor(rows_ids, dtype=torch.long),
        torch.tensor(rows_mask, dtype=torch.bool),
        torch.tensor(rows_attn, dtype=torch.bool),
        source=path,
    )
    if not dataset.loss_mask.any():
        raise DataError(
            path,
            f"no record has a loss_mask position inside the first {seq_len} tokens. "
            f"Fix: mark the tokens to learn with loss_mask 1, or raise data.seq_len.",
        )
    return dataset


def check_input_ids(ids, where: str) -> list[int]:
    """`ids` when it is a non-empty list of integers, else DataError."""
    integers = isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    if not ids or not integers:
        raise DataError(where, "input_ids must be a non-empty list of integers.")
    return ids


def _check_pretokenized(record: dict, where: str) -> tuple[list[int], list[int]]:
    ids, mask = check_input_ids(record.get("input_ids"), where), record.get("loss_mask")
    if mask is None:
        raise DataError(
            where, "loss_mask is missing. Fix: add a list of 0/1, one per input_id (1 = train on this token)."
        )
    if not isinstance(mask, list) or not all(v in (0, 1) for v in mask):  # True/False compare equal to 1/0
        raise DataError(where, "loss_mask must be a list of 0/1 values.")
    if len(mask) != len(ids):
        raise DataError(
            where,
            f"loss_mask has {len(mask)} entries but input_ids has {len(ids)}. "
            f"Fix: one loss_mask value per token.",
        )
    return ids, [int(v) for v in mask]


def _tokenize_messages(
    messages, tokenizer, where: str, chat_template_kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation; loss_mask 1 on the tokens each assistant turn adds to the prompt
    before it (with the generation prompt)."""
    if tokenizer is None:
        raise DataError(
            where,
            "record has messages, but the target has no tokenizer (tiny-random). "
            "Fix: use pre-tokenized input_ids/loss_mask records, or a real target.",
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(where, "the target's tokenizer has no chat template. Fix: pre-tokenize the data.")
    if not isinstance(messages, list) or not messages:
        raise DataError(where, "messages must be a non-empty list of {role, content} objects.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise DataError(
                where,
                f'messages[{i}] must be {{"role": one of {"/".join(ROLES)}, '
                f'"content": string}}, got {json.dumps(m)[:120]}.',
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(where, "conversation has no assistant turn, so nothing to learn. Fix: drop it.")

    def encode(msgs, generation_prompt=False) -> list[int]:
        return render_chat(tokenizer, msgs, generation_prompt, chat_template_kwargs) if msgs else []

    ids = encode(messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(encode(messages[:i], generation_prompt=True))
        upto = encode(messages[: i + 1])
        if ids[: len(upto)] != upto:
            raise DataError(
                where,
                f"the chat template renders messages[{i}] differently inside the whole "
                f"conversation (it rewrites earlier turns), so assistant tokens cannot be "
                f"located. Fix: pre-tokenize into input_ids/loss_mask.",
            )
        mask[start : len(upto)] = [1] * (len(upto) - start)
    return ids, mask


def render_chat(
    tokenizer, messages: list, generation_prompt: bool, template_kwargs: dict | None
) -> list[int]:
    """Token ids of `messages` through the chat template, which adds the special tokens itself."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **(template_kwargs or {})
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@torch.no_grad()
def synthetic_dataset(
    target, num_samples: int, prompt_len: int, seq_len: int, seed: int, chunk: int = 256
) -> Dataset:
    """Random prompts (seeded) continued greedily by the target, so the continuation is learnable."""
    prompts = random_prompts(target.vocab_size, target.mask_token_id, num_samples, prompt_len, (seed, 0x5E1F))
    rows = [
        greedy_continue(target.model, prompts[i : i + chunk].to(target.device), seq_len - prompt_len).cpu()
        for i in range(0, num_samples, chunk)
    ]
    input_ids = torch.cat(rows)
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    return Dataset(
        input_ids, loss_mask, attention_mask, source=f"synthetic({num_samples} greedy continuations)"
    )


def random_prompts(
    vocab_size: int, mask_token_id: int, count: int, length: int, seed_parts: tuple
) -> torch.Tensor:
    """Seeded random prompts without the mask token: at inference it only ever fills draft slots."""
    gen = torch.Generator().manual_seed(derive_seed(*seed_parts))
    prompts = torch.randint(0, vocab_size, (count, length), generator=gen)
    prompts[prompts == mask_token_id] = (mask_token_id + 1) % vocab_size
    return prompts


def greedy_continue(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens] by argmax decoding with the target's KV cache."""
    cache = kv_cache.new_cache(model)
    columns = [prompts]
    logits = kv_cache.forward(model, prompts, cache).logits[:, -1]
    for i in range(new_tokens):
        columns.append(logits.argmax(-1, keepdim=True))
        if i + 1 < new_tokens:
            logits = kv_cache.forward(model, columns[-1], cache).logits[:, -1]
    return torch.cat(columns, dim=1)
