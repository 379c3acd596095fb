"""What the ops tests share beyond fixtures: the dflash-ops command line, and waiting for a condition."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def ops_argv(inventory: Path | str, *args: str) -> list[str]:
    """`python -m dflash_ops --inventory INVENTORY ARGS…` with this interpreter."""
    return [sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), *args]


def wait_for(predicate, seconds: float = 20.0, what: str = "condition", every: float = 0.1):
    """The predicate's first true value, asked every `every` s; AssertionError after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {seconds:g}s waiting for {what}")
