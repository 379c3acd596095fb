"""Progress as people read it: durations, a bar, and a progress line for long data jobs (a bar with
items/s and ETA on a TTY, a plain line now and then elsewhere)."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):  # e.g. a metrics file's times a float's range apart: not an overflow
        return "?"
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_bar(step: int, total: int, width: int = 24) -> str:
    filled = int(width * step / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


CLEAR_LINE = "\r\x1b[2K"  # back to the line's start and erase it: a TTY bar redraws in place


def bar_line(step: int, total: int, text: str) -> str:
    """The bar with `text` after it, drawn over the current line."""
    return CLEAR_LINE + progress_bar(step, total) + " " + text


class ProgressLine:
    """`update(done)` as work completes; `finish()` ends the bar line. Rate and ETA count only
    this process's work (a resumed run starts at `done` without crediting it as speed)."""

    def __init__(
        self,
        what: str,
        total: int,
        done: int = 0,
        out: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = 30.0,
        clock=time.monotonic,
    ):
        self.what, self.total, self.first, self.done = what, total, done, done
        self.out = out if out is not None else sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.every_s, self.clock = every_s, clock
        self.began = self.last_line = clock()

    def rate(self) -> float:
        return (self.done - self.first) / max(self.clock() - self.began, 1e-9)

    def line(self, extra: str = "") -> str:
        rate = self.rate()
        eta = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        suffix = f"  {extra}" if extra else ""
        return f"{self.what} {self.done}/{self.total}  {rate:.2f}/s  ETA {eta}{suffix}"

    def update(self, done: int, extra: str = "") -> None:
        self.done = done
        now = self.clock()
        if self.tty:
            self.out.write(bar_line(done, self.total, self.line(extra)))
            self.out.flush()
        elif now - self.last_line >= self.every_s or done == self.total:
            self.last_line = now
            self.out.write(self.line(extra) + "\n")
            self.out.flush()

    def say(self, text: str) -> None:
        """A line of its own, now (on a TTY it takes the bar's place; the next update redraws the bar)."""
        self.out.write((CLEAR_LINE if self.tty else "") + text + "\n")
        self.out.flush()

    def finish(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()
