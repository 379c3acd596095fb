"""Scripts that run ON the target. Each is standalone (standard library only, Python >= 3.8)
because the target may have nothing but a system python3; dflash-ops sends their text."""
from __future__ import annotations

import pathlib


def script_source(filename: str) -> str:
    """The text of a script in this package, to hand to `python -c` on the target."""
    return (pathlib.Path(__file__).parent / filename).read_text(encoding="utf-8")
