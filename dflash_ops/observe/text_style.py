"""The terminal colours per verdict level, and text from the target shown inert."""

from __future__ import annotations

LEVEL_COLORS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}
BOLD = "1"


def paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def inert(text: str) -> str:
    """Control characters shown as escapes like \\x1b (tabs stay): the target cannot drive the terminal."""
    return "".join(ch if ch.isprintable() or ch == "\t" else _escaped(ch) for ch in str(text))


def inert_log_line(line: str) -> str:
    """A log line as a terminal would leave it (only what follows a carriage return), then inert."""
    shown = [part for part in line.split("\r") if part]
    return inert(shown[-1] if shown else "")


def _escaped(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
