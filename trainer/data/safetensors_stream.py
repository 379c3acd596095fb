"""Write a safetensors file from tensors given in pieces, hashing the bytes as they are written.

A feature-cache shard is ~2 GiB assembled from thousands of per-sequence pieces. `save_file` needs
each tensor whole (a `torch.cat` copy), and the shard's sha256 then means reading the file back.
Here each piece goes to the file once, through sha256 on its way: no concatenated copy, no re-read.
The bytes are exactly what `safetensors.torch.save_file` writes for the concatenated tensors.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

# safetensors' dtype names, in the order of its Dtype enum (it stores tensors highest first, then
# by name); only the dtypes the feature cache writes.
_DTYPES = {
    torch.bool: "BOOL",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
}
_ORDER = {name: rank for rank, name in enumerate(_DTYPES.values())}


def _shape(pieces: list[torch.Tensor]) -> list[int]:
    first = pieces[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in pieces):
        raise ValueError("pieces of one tensor must share dtype and trailing shape")
    return [sum(int(p.shape[0]) for p in pieces), *first.shape[1:]]


def _header(tensors: dict[str, list[torch.Tensor]]) -> tuple[bytes, list[str]]:
    names = sorted(tensors, key=lambda n: (-_ORDER[_DTYPES[tensors[n][0].dtype]], n))
    entries, offset = {}, 0
    for name in names:
        pieces = tensors[name]
        size = sum(p.numel() * p.element_size() for p in pieces)
        entries[name] = {
            "dtype": _DTYPES[pieces[0].dtype],
            "shape": _shape(pieces),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, names


def write_pieces(path: str, tensors: dict[str, list[torch.Tensor]], chunk: int = 1 << 24) -> tuple[int, str]:
    """Write `path` (fsynced) holding each name's pieces concatenated on dim 0: (bytes, sha256)."""
    for name, pieces in tensors.items():
        if not pieces or pieces[0].dtype not in _DTYPES:
            raise ValueError(f"{name}: give at least one piece of a dtype in {sorted(_DTYPES.values())}")
    head, names = _header(tensors)
    digest, written = hashlib.sha256(head), len(head)
    with open(path, "wb") as f:
        f.write(head)
        for name in names:
            for piece in tensors[name]:
                raw = piece.detach().contiguous().view(-1).view(torch.uint8).numpy()
                for at in range(0, len(raw), chunk):
                    view = raw[at : at + chunk].data  # a memoryview of the slice, no copy
                    digest.update(view)
                    f.write(view)
                written += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return written, digest.hexdigest()
