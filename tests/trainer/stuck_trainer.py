"""The real trainer CLI with drafter1 stuck inside a compile from step STUCK_AT_STEP on.

    python tests/trainer/stuck_trainer.py MARKER_DIR [--hold-gil] -- <dflash-train arguments>

At that step drafter1 compiles a function through a backend that never returns (as a hung
inductor compile would): it writes MARKER_DIR/stuck when it is inside, then waits forever. With
--hold-gil it waits until MARKER_DIR/hold-gil exists and then holds the GIL (a regex that
backtracks for ever), so that not even the main thread can run Python any more.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from trainer.train import loop as train_module  # noqa: E402
from trainer.cli.main import main  # noqa: E402

STUCK_AT_STEP = 2


def stuck_backend_factory(marker_dir: str, hold_gil: bool):
    def stuck_backend(graph_module, example_inputs):
        with open(os.path.join(marker_dir, "stuck"), "w") as fh:
            fh.write(threading.current_thread().name)
        if hold_gil:
            while not os.path.exists(os.path.join(marker_dir, "hold-gil")):
                time.sleep(0.05)
            re.match(r"(a+)+$", "a" * 64 + "b")  # never returns, never lets go of the GIL
        threading.Event().wait()
        return graph_module

    return stuck_backend


def install(marker_dir: str, hold_gil: bool) -> None:
    original = train_module.make_loss_fn
    backend = stuck_backend_factory(marker_dir, hold_gil)

    def make_loss_fn(cfg):
        compute = original(cfg)

        def compute_with_a_hung_compile(replica, batch):
            if replica.index == 1 and batch.step >= STUCK_AT_STEP:
                torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(3))
            return compute(replica, batch)

        return compute_with_a_hung_compile

    train_module.make_loss_fn = make_loss_fn


if __name__ == "__main__":
    split = sys.argv.index("--")
    own, trainer_args = sys.argv[1:split], sys.argv[split + 1:]
    install(own[0], "--hold-gil" in own)
    sys.exit(main(trainer_args))
