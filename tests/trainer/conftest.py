"""Fixtures the export tests share: the tiny-random target and a drafter whose weights every term of
the computation depends on (module-scoped: each test module gets its own)."""
from __future__ import annotations

import pytest
import torch

from trainer.model import DFlashDrafter, DrafterConfig
from trainer.data.target import load_target

EXPORT_BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-random", "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(0)
    model = DFlashDrafter(DrafterConfig.for_target(target, num_layers=2, block_size=EXPORT_BLOCK),
                          target.embed_tokens, target.lm_head)
    with torch.no_grad():  # weights far from init, so every term of the computation matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    return model.eval()
