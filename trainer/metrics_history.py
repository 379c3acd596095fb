"""A metrics file's history, thinned to a bounded size for a picture of the run.

Standard library only, Python >= 3.8: `dflash-train report` reads a local file with it, and
dflash-ops sends this file's text to the target (dflash_ops.remote.bundle) so the remote side
thins the files there and one bounded answer comes back.

Kept: the first line (the run's `start` record), every later non-step record up to MAX_OTHER
(the newest ones), and step records evenly spaced, at most 2 x `max_steps` of them, the last one
always. A file larger than `max_scan_bytes` is read from its first line and its last
`max_scan_bytes` bytes only; lines longer than MAX_LINE_BYTES (no real record is) are skipped.
"""

from __future__ import annotations

import collections
import os

MAX_STEP_POINTS = 2000
MAX_OTHER = 500
MAX_LINE_BYTES = 16 * 1024
MAX_FIRST_LINE_BYTES = 256 * 1024  # the start record carries the whole config
MAX_SCAN_BYTES = 64 * 1024 * 1024
_STEP = b'"event":"step"'  # how metrics_format.encode writes a step record


class Thinned:
    """Lines fed in order; `lines()` gives what is kept, in order."""

    def __init__(self, max_steps=MAX_STEP_POINTS):
        self.max_steps = max(1, int(max_steps))
        self.first = None
        self.steps = []  # (index, line): every `stride`-th step line
        self.stride = 1
        self.step_count = 0
        self.last_step = None
        self.others = collections.deque(maxlen=MAX_OTHER)
        self.index = 0

    def add(self, line):
        index, self.index = self.index, self.index + 1
        if self.first is None:
            self.first = (index, line)
        elif _STEP in line:
            if self.step_count % self.stride == 0:
                self.steps.append((index, line))
                if len(self.steps) > 2 * self.max_steps:
                    self.steps = self.steps[::2]
                    self.stride *= 2
            self.step_count += 1
            self.last_step = (index, line)
        else:
            self.others.append((index, line))

    def lines(self):
        extras = [extra for extra in (self.first, self.last_step) if extra is not None]
        kept = dict(self.steps + list(self.others) + extras)
        return [kept[i] for i in sorted(kept)]


def _lines(f, limit):
    """The file's lines from its position on (bytes, without the newline), skipping longer ones."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):  # the rest of the long line
                line = f.readline(1 << 20)
            continue
        yield line.rstrip(b"\r\n")


def read_thinned(path, max_steps=MAX_STEP_POINTS, max_scan_bytes=MAX_SCAN_BYTES):
    """{"path", "size", "mtime", "lines": [str], "scanned_from": byte offset of the scan}."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        thinned = Thinned(max_steps)
        first = f.readline(MAX_FIRST_LINE_BYTES)
        scanned_from = 0
        if first:
            if first.endswith(b"\n"):
                thinned.add(first.rstrip(b"\r\n"))
            if st.st_size - f.tell() > max_scan_bytes:
                scanned_from = st.st_size - max_scan_bytes
                f.seek(scanned_from)
                f.readline(MAX_LINE_BYTES)  # the rest of a cut line
            for line in _lines(f, MAX_LINE_BYTES):
                if line.strip():
                    thinned.add(line)
    return {
        "path": path,
        "size": st.st_size,
        "mtime": st.st_mtime,
        "lines": [line.decode("utf-8", "replace") for line in thinned.lines()],
        "scanned_from": scanned_from,
    }
