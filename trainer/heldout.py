"""The held-out split: sequences training never sees, kept for the acceptance-length evaluation.

Which rows are held out depends only on (seed, number of rows, fraction), so `dflash-train eval`
on a finished run finds the very rows the run held out. A prompt is what comes before the first
trained position of a row: the part the target answers, not the answer itself.
"""
from __future__ import annotations

import torch

from .data import DataError, Dataset, derive_seed

_SPLIT_SALT = 0xE7A1


def heldout_count(num_rows: int, fraction: float) -> int:
    return 0 if fraction <= 0 else max(1, round(num_rows * fraction))


def split_heldout(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """(rows to train on, held-out rows or None). Raises DataError if nothing would be left."""
    count = heldout_count(len(dataset), fraction)
    if count == 0:
        return dataset, None
    if count >= len(dataset):
        raise DataError(dataset.source, f"data.eval_fraction {fraction} holds out all {len(dataset)} "
                                        f"sequences. Fix: lower data.eval_fraction or add data.")
    gen = torch.Generator().manual_seed(derive_seed(seed, _SPLIT_SALT))
    order = torch.randperm(len(dataset), generator=gen)
    held, kept = order[:count].sort().values, order[count:].sort().values

    def rows(index: torch.Tensor, what: str) -> Dataset:
        return Dataset(dataset.input_ids[index], dataset.loss_mask[index], dataset.attention_mask[index],
                       source=f"{dataset.source} ({what})")

    return rows(kept, f"{count} held out"), rows(held, "held-out split")


def prompts_of(dataset: Dataset) -> list[list[int]]:
    """Each row's real tokens before its first trained position (rows with no such prefix are skipped)."""
    prompts = []
    for ids, mask, real in zip(dataset.input_ids, dataset.loss_mask, dataset.attention_mask):
        trained = mask.nonzero()
        end = int(trained[0]) if len(trained) else int(real.sum())
        prompt = ids[:end][real[:end]].tolist()
        if prompt:
            prompts.append(prompt)
    return prompts
