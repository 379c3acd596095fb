"""Fixtures the trainer tests share: the tiny-random target and a drafter whose weights every term of
the computation depends on (module-scoped: each test module gets its own), and one torch thread."""
from __future__ import annotations

import pytest
import torch

from trainer.model import DFlashDrafter, DrafterConfig
from trainer.data.target import load_target

EXPORT_BLOCK = 4
# the bundled tiny run (tiny-cpu) made short: 64 records of 32 tokens, an evaluation every 3 steps
SHORT_TINY_RUN = [
    "--set",
    "data.seq_len=32",
    "--set",
    "data.synthetic.num_samples=64",
    "--set",
    "train.batch_size=2",
    "--set",
    "train.num_anchors=6",
    "--set",
    "eval.every=3",
    "--set",
    "eval.num_prompts=2",
    "--set",
    "eval.max_new_tokens=8",
]


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: on a shared 2-core machine torch's default pool spins, and
    generation runs ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FakeClock:
    """A monotonic clock the test moves by hand: `clock.now += 3`."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()
