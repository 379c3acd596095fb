"""Storing a file on an ssh target: its bytes go on the command's stdin to a small bash script."""

from __future__ import annotations

import shlex


def _put_script(remote_path: str, mode: int, size: int) -> str:
    """bash that stores stdin at remote_path atomically: temp file in the same dir, then rename.

    The size check keeps a transfer cut short (lost connection: the reader just sees EOF) from
    replacing a good file with a truncated one.
    """
    q = shlex.quote(remote_path)
    return f"""set -e
dest={q}
dir=$(dirname -- "$dest")
mkdir -p -- "$dir"
tmp=$(mktemp -- "$dir/.$(basename -- "$dest").tmp.XXXXXX")
trap 'rm -f -- "$tmp"' EXIT
cat > "$tmp"
got=$(stat -c %s -- "$tmp")
if [ "$got" != {size} ]; then echo "put: received $got of {size} bytes; $dest left unchanged" >&2; exit 1; fi
chmod {mode:o} -- "$tmp"
mv -f -- "$tmp" "$dest"
trap - EXIT
"""


def put_timeout_s(size: int) -> float:
    return 60 + size / 1e6  # at least 1 MB/s
