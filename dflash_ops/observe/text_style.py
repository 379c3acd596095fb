"""The terminal colours status paints with, one per verdict level."""

from __future__ import annotations

LEVEL_COLORS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}
BOLD = "1"


def paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text
