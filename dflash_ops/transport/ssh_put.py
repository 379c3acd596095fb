"""Storing a file on an ssh target: its bytes go on the command's stdin to a small bash script."""

from __future__ import annotations

from dflash_ops.remote import shell_command


def put_script(remote_path: str, mode: int, size: int) -> str:
    """bash that stores stdin at remote_path atomically (remote/put_file.sh: temp file in the same
    dir, size check, rename)."""
    return shell_command("put_file.sh", remote_path, f"{mode:o}", str(size))


def put_timeout_s(size: int) -> float:
    return 60 + size / 1e6  # at least 1 MB/s
