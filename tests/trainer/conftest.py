"""Fixtures the trainer tests share: the tiny-random target and a drafter whose weights every term of
the computation depends on (module-scoped: each test module gets its own), and one torch thread."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from trainer.compile_lock import CompileGuard
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


@pytest.fixture
def installed_guard():
    """A compile guard in "lock" mode, installed for one test; (the guard, the events it logged)."""
    events = []
    guard = CompileGuard("lock", on_event=events.append).install()
    yield guard, events
    guard.uninstall()


def run_in_threads(n: int, work) -> list[Exception]:
    """`work(i)` for i < n, each in its own thread, all at once; the exceptions they raised."""
    errors: list[Exception] = []

    def guarded(i):
        try:
            work(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def loss_fn_failing(real, replica: int, step: int, message: str):
    """A stand-in for `make_loss_fn` (`real`) whose loss raises `message` on drafter `replica` at
    `step`: a drafter thread falling over mid-run."""

    def make(cfg):
        compute = real(cfg)

        def run(r, batch):
            if r.index == replica and batch.step == step:
                raise RuntimeError(message)
            return compute(r, batch)

        return run

    return make


def assert_same_replica(a, b, moment: str = "exp_avg_sq") -> None:
    """Two replicas hold equal weights, optimizer `moment`s and learning rate (a resume was exact)."""
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name]), name
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for index in state_a:
        assert torch.equal(state_a[index][moment], state_b[index][moment])
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()


def triton_interpret(code: str) -> str:
    """Run `code` in a fresh interpreter under Triton's interpreter (TRITON_INTERPRET=1 is read when a kernel
    is defined, so it cannot be switched on inside this process); its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=500
    )
    if INTERPRETER_NUMPY_DEFECT in proc.stderr and "triton/runtime/interpreter.py" in proc.stderr:
        pytest.skip("this Triton's interpreter calls int() on one-element arrays, which numpy >= 2.4 refuses")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Triton 3.6's interpreter fails so under numpy >= 2.4 (the GPU machine's image: triton 3.6.0, numpy 2.5);
# the kernels themselves run compiled there (benchmarks/decode_cost.py checks their tokens).
INTERPRETER_NUMPY_DEFECT = "only 0-dimensional arrays can be converted to Python scalars"
