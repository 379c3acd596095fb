"""How every dflash-train command reports bad input: one line on stderr, no traceback, exit 2.

Input errors carry `exit_code = 2` and propagate to `run_command`, caught once here rather than
where they arise. No torch here: input errors come before it.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO


def input_error(exc: BaseException) -> BaseException | None:
    """`exc` (or the worker's exception it carries) when it is bad input, with an `exit_code`."""
    for candidate in (exc, getattr(exc, "original", None)):
        if isinstance(getattr(candidate, "exit_code", None), int):
            return candidate
    return None


def run_command(prog: str, command: Callable[[], int], err: TextIO | None = None) -> int:
    """`command()`'s exit status; bad input becomes one line `PROG: error: MESSAGE` and its exit code."""
    try:
        return command()
    except Exception as exc:
        error = input_error(exc)
        if error is None:
            raise
        print(f"{prog}: error: {error}", file=err if err is not None else sys.stderr)
        return error.exit_code  # type: ignore[attr-defined]
