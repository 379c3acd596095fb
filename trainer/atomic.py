"""Crash-safe small files: a reader sees the old content or the new, never a mix."""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write a sibling temp file, fsync it, rename it over `path`, fsync the directory."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
