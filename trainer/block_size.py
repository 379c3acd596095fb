"""The drafted block (an anchor token, then block_size - 1 masked positions): its default and lower
bound. trainer/hf_modeling ships standalone and keeps its own default."""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 16  # the paper's block
MIN_BLOCK_SIZE = 2  # position 0 is the anchor: a smaller block has nothing to draft


def block_size_problem(block_size: int) -> str | None:
    """What is wrong with `block_size` (to follow its name in a message), or None."""
    if block_size < MIN_BLOCK_SIZE:
        return f"must be >= {MIN_BLOCK_SIZE} (position 0 is the anchor), got {block_size}"
    return None
