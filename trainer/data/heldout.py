"""Evaluation prompts training never sees: a held-out split, a prompts file, or fresh synthetic prompts.

The split depends only on (seed, rows, fraction), so `dflash-train eval` finds the rows a run held
out. A prompt is a row's part before its first trained position.
"""

from __future__ import annotations

import torch

from trainer.config import ConfigError
from trainer.data.dataset import DataError, Dataset, derive_seed, random_prompts

_SPLIT_SALT = 0xE7A1
_FRESH_PROMPTS_SALT = 0xE7A2


def heldout_count(num_rows: int, fraction: float) -> int:
    return 0 if fraction <= 0 else max(1, round(num_rows * fraction))


def split_heldout(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """(rows to train on, held-out rows or None). Raises DataError if nothing would be left."""
    count = heldout_count(len(dataset), fraction)
    if count == 0:
        return dataset, None
    if count >= len(dataset):
        raise DataError(
            dataset.source,
            f"data.eval_fraction {fraction} holds out all {len(dataset)} "
            f"sequences. Fix: lower data.eval_fraction or add data.",
        )
    gen = torch.Generator().manual_seed(derive_seed(seed, _SPLIT_SALT))
    order = torch.randperm(len(dataset), generator=gen)
    held, kept = order[:count].sort().values, order[count:].sort().values

    def rows(index: torch.Tensor, what: str) -> Dataset:
        return Dataset(
            dataset.input_ids[index],
            dataset.loss_mask[index],
            dataset.attention_mask[index],
            source=f"{dataset.source} ({what})",
        )

    return rows(kept, f"{count} held out"), rows(held, "held-out split")


def prompts_of(dataset: Dataset) -> list[list[int]]:
    """Each row's real tokens before its first trained position (rows with no such prefix are skipped)."""
    prompts = []
    for ids, mask, real in zip(dataset.input_ids, dataset.loss_mask, dataset.attention_mask, strict=True):
        trained = mask.nonzero()
        end = int(trained[0]) if len(trained) else int(real.sum())
        prompt = ids[:end][real[:end]].tolist()
        if prompt:
            prompts.append(prompt)
    return prompts


def fresh_synthetic_prompts(
    vocab_size: int, mask_token_id: int, count: int, prompt_len: int, seed: int
) -> list[list[int]]:
    """Random prompts like the synthetic data's, from a seed stream the training data never uses."""
    return random_prompts(vocab_size, mask_token_id, count, prompt_len, (seed, _FRESH_PROMPTS_SALT)).tolist()


def eval_split(cfg) -> str:
    """ "held-out" (eval.path: another distribution) or "held-in" (unseen rows of the training one)."""
    return "held-out" if cfg.eval.path else "held-in"


def eval_prompts(cfg, target, heldout: Dataset | None, count: int) -> list[list[int]]:
    """Up to `count` evaluation prompts: eval.path, the held-out split, or fresh synthetic prompts;
    training and `dflash-train eval` share this."""
    if cfg.eval.path:
        from trainer.data.chat_tokenizer import chat_tokenizer_of
        from trainer.data.prompts import load_prompts

        kwargs = cfg.data.chat_template_kwargs  # rendered like the training data, and as `eval --prompts`
        tokenizer = chat_tokenizer_of(target, cfg.target.spec)
        return load_prompts(cfg.eval.path, tokenizer, target.vocab_size, kwargs, "eval.path")[:count]
    if heldout is not None:
        return prompts_of(heldout)[:count]
    if cfg.data.source == "synthetic":
        return fresh_synthetic_prompts(
            target.vocab_size, target.mask_token_id, count, cfg.data.synthetic.prompt_len, cfg.train.seed
        )
    raise ConfigError(
        f"{cfg.source}: no evaluation prompts: the run held no data out (data.eval_fraction 0) "
        f"and eval.path is unset. Fix: set one of them, or pass --prompts FILE.jsonl."
    )
