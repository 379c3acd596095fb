"""A run's progress for a person: one line per step; a step's status rewritten in place on a terminal,
or printed at most every `every_s` seconds to a file (cron, CI), which cannot be rewritten."""

from __future__ import annotations

import time
from typing import Callable

from dflash_ops.act.runner import DRY_RUN, FAILED, OK, SKIPPED, StepEvent

STATUS_EVERY_S = 15.0
CLEAR_LINE = "\r\033[K"


def format_progress(p: StepEvent, with_target: bool = False, show_commands: bool = True) -> str:
    """`[3/7] wait_gpu_free ... ok (4.2s) GPUs 1,2,3 free`; dry-run lists the commands below."""
    head = (f"[{p.target}] " if with_target else "") + f"[{p.number}/{p.total}] {p.step} ..."
    if p.event == "start":
        return head
    if p.event in ("log", "status"):
        return (f"[{p.target}] " if with_target else "") + f"      {p.message}"
    r = p.report
    assert r is not None
    line = f"{head} {r.status}"
    if r.status in (OK, FAILED, DRY_RUN):
        line += f" ({r.seconds:.1f}s)"
    if r.status == SKIPPED:
        return f"{line} ({r.message})"
    if r.message:
        first, *rest = r.message.splitlines()
        line += f" {first}" + "".join(f"\n      {x}" for x in rest)
    if show_commands and r.status == DRY_RUN:
        for command in r.commands:
            line += "\n      $ " + command.replace("\n", "\n        ")
    return line


class ProgressPrinter:
    def __init__(
        self,
        write: Callable[[str], None],
        is_tty: bool,
        with_target: bool = False,
        every_s: float = STATUS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.write, self.is_tty, self.with_target = write, is_tty, with_target
        self.every_s, self.clock = every_s, clock
        self._live = False  # a status line is on screen without its newline
        self._last_status: float | None = None

    def __call__(self, progress: StepEvent) -> None:
        if progress.event == "start":
            self._last_status = self.clock()  # the first status line comes every_s into the step
            return  # the end line carries the timing
        text = format_progress(progress, with_target=self.with_target)
        if progress.event == "status":
            if self.is_tty:
                self.write(CLEAR_LINE + text.strip()[: _width()])
                self._live = True
            elif self._last_status is None or self.clock() - self._last_status >= self.every_s:
                self.write(text + "\n")
                self._last_status = self.clock()
            return
        if self._live:
            self.write(CLEAR_LINE)
            self._live = False
        self.write(text + "\n")


def _width() -> int:
    import shutil

    return max(20, shutil.get_terminal_size().columns - 1)
