"""What the run tells the world: JSON-lines records (trainer/metrics_format.py) plus readable lines.

The metrics file is the contract with dflash-ops (it tails it); stdout is for people. Records are
flushed one whole line at a time so a reader never sees half a record for long.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Sequence, TextIO

from trainer import metrics_format
from trainer.compile_lock import exception_chain
from trainer.progress import bar_line, format_duration
from trainer.train.trackers import Trackers

if TYPE_CHECKING:
    from trainer.train.workers import Failure


def error_kind(exc: BaseException | None) -> str:
    """The metrics `error.kind` for an exception: fx_tracing, cuda_oom, block_mask (the
    create_block_mask race, KeyError: 'custom', see compile_lock.MASK_LOCK) or exception."""
    for link in exception_chain(exc):
        text = f"{type(link).__name__}: {link}"
        if metrics_format.FX_TRACING_ERROR in text:
            return "fx_tracing"
        if "OutOfMemoryError" in type(link).__name__ or "CUDA out of memory" in text:
            return "cuda_oom"
        if isinstance(link, KeyError) and link.args == ("custom",):
            return "block_mask"
    return "exception"


class Throughput:
    """Tokens per second over the last step and an ETA from the mean step time so far; `step_s`, the
    last step's seconds (inf before the first)."""

    def __init__(self, start_step: int, total_steps: int, clock=time.monotonic):
        self.clock, self.total_steps, self.first_step = clock, total_steps, start_step
        self.t0 = self.last = clock()
        self.step_s = math.inf

    def update(self, step: int, tokens: int) -> tuple[float, float]:
        now = self.clock()
        interval, self.last = max(now - self.last, 1e-9), now
        self.step_s = interval
        mean_step = (now - self.t0) / max(step - self.first_step, 1)
        return tokens / interval, mean_step * max(self.total_steps - step, 0)


def _known(**fields) -> dict:
    """The optional fields that have a value: a record leaves out what was not measured."""
    return {name: value for name, value in fields.items() if value is not None}


class MetricsWriter:
    """Writes metrics records to `path` and readable lines to `out`. Safe to call from any thread.
    `report_to` names experiment trackers (trainer.train.trackers) that get each record as written to
    `path`, reporting into `report_dir`; only the process that speaks for the run passes any."""

    def __init__(
        self,
        path: str,
        out: TextIO | None = None,
        tty: bool | None = None,
        log_every: int = 1,
        report_to: Sequence[str] = (),
        report_dir: str = ".",
    ):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self.out = out if out is not None else sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.log_every = log_every
        self._lock = threading.Lock()
        self._bar_open = False  # a progress bar line is on screen without its newline
        self.trackers = Trackers(report_to, report_dir, self.say) if report_to else None

    def record(self, event: str, **fields) -> None:
        line = metrics_format.encode(event, **fields)
        with self._lock:
            self._file.write(line)
            self._file.flush()
        if self.trackers:  # the record exactly as the file holds it
            self.trackers.feed(json.loads(line))

    def say(self, text: str) -> None:
        with self._lock:
            if self._bar_open:
                self.out.write("\n")
                self._bar_open = False
            self.out.write(text + "\n")
            self.out.flush()

    def start(
        self,
        config: dict,
        devices: list[str],
        compile_lock: str,
        total_steps: int,
        summary_lines: Sequence[str] = (),
        gated_deltanet: dict | None = None,
    ) -> None:
        self.record(
            "start",
            config=config,
            devices=list(devices),
            compile_lock=compile_lock,
            total_steps=total_steps,
            pid=os.getpid(),
            **_known(gated_deltanet=gated_deltanet),
        )
        for line in summary_lines:
            self.say(line)

    def step(
        self,
        *,
        step: int,
        total_steps: int,
        loss: float,
        acc: list[float],
        tokens_per_s: float,
        eta_s: float,
        lr: float,
        grad_norm: float,
        epoch: float,
        gpu_memory_gib: float | None = None,
    ) -> None:
        self.record(
            "step",
            step=step,
            total_steps=total_steps,
            loss=loss,
            acc=list(acc),
            tokens_per_s=tokens_per_s,
            eta_s=eta_s,
            lr=lr,
            grad_norm=grad_norm,
            epoch=epoch,
            **_known(gpu_memory_gib=gpu_memory_gib),
        )
        line = step_line(step, total_steps, loss, acc, tokens_per_s, eta_s, lr, grad_norm)
        permanent = step % self.log_every == 0 or step == total_steps
        if self.tty:
            with self._lock:
                self.out.write(bar_line(step, total_steps, line) + ("\n" if permanent else ""))
                self._bar_open = not permanent
                self.out.flush()
        elif permanent:
            self.say(line)

    def compile(self, thread: str, duration_s: float, step: int, reason: str) -> None:
        self.record("compile", thread=thread, duration_s=duration_s, step=step, reason=reason)
        self.say(f"compile  {thread} step {step}: {duration_s:.2f}s ({reason})")

    def checkpoint(self, step: int, path: str) -> None:
        self.record("checkpoint", step=step, path=path)
        self.say(f"checkpoint step {step}: {path}")

    def failed(self, failure: Failure, last_step: int, label: str = "") -> None:
        """The run's last words: `done` (interrupted) after a stop, else the traceback and an `error`
        record whose message starts with `label` (e.g. "rank 1: ")."""
        if failure.interrupted:
            self.say(f"aborted: {failure.raised}")
            self.done(last_step, "interrupted")
        else:
            if not failure.bad_input:  # bad input: the command says it in one line (cli/errors.py)
                self.say(f"error{failure.where}:\n{failure.traceback_text.rstrip()}")
            self.record("error", message=label + failure.summary(), kind=error_kind(failure.original))

    def done(self, step: int, reason: str) -> None:
        self.record("done", step=step, reason=reason)
        self.say(f"done     step {step} ({reason})")

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
        with self._lock:
            if not self._file.closed:
                self._file.close()


def step_line(step, total_steps, loss, acc, tokens_per_s, eta_s, lr, grad_norm) -> str:
    acc1 = acc[0] if acc else float("nan")
    acc_mean = sum(acc) / len(acc) if acc else float("nan")
    width = len(str(total_steps))
    return (
        f"step {step:>{width}}/{total_steps}  loss {loss:.4f}  acc@1 {acc1:.3f}  acc_avg {acc_mean:.3f}  "
        f"{tokens_per_s:,.0f} tok/s  lr {lr:.2e}  gnorm {grad_norm:.3f}  eta {format_duration(eta_s)}"
    )
