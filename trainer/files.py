"""File modes: files the trainer writes follow the process umask, like any other file it creates."""

from __future__ import annotations

import os


def current_umask() -> int:
    """The process umask, read without changing it (other threads may be creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: the only portable way to read it is to set it
    os.umask(mask)
    return mask


def follow_umask(path) -> None:
    """safetensors creates its files 0600; give them the mode open() would have (0644 under 022)."""
    os.chmod(path, 0o666 & ~current_umask())
