"""How playbook progress reaches a person: one line per finished step, and a step's transient
status ("waiting for the first step: 42 s …") rewritten in place on a terminal, or printed at most
once every `every_s` seconds where output goes to a file (cron, CI) and cannot be rewritten."""

from __future__ import annotations

import time
from typing import Callable

from .playbook import Progress, format_progress

STATUS_EVERY_S = 15.0
CLEAR_LINE = "\r\033[K"


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

    def __call__(self, progress: Progress) -> None:
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
