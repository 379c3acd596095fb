"""Write a safetensors file from tensors given in pieces, hashing the bytes as they are written.

A ~2 GiB shard arrives in thousands of pieces; `save_file` would need a concatenated copy and a
re-read for the checksum. The bytes are exactly what `save_file` writes for the whole tensors.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from trainer.data.chunk_digest import THREADS, ChunkHasher

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
CHUNK = 1 << 24
# Threads writing a piece's chunks at once (pwrite at their offsets): one thread copying into the
# page cache moves less than the target produces at paper dims; the sha256 runs beside them.
WRITERS = 4


def layout_of(name: str, pieces: list[torch.Tensor]) -> tuple[torch.dtype, list[int]]:
    if not pieces or pieces[0].dtype not in _DTYPES:
        raise ValueError(f"{name}: give at least one piece of a dtype in {sorted(_DTYPES.values())}")
    first = pieces[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in pieces):
        raise ValueError("pieces of one tensor must share dtype and trailing shape")
    return first.dtype, [sum(int(p.shape[0]) for p in pieces), *first.shape[1:]]


class StreamedFile:
    """A safetensors file of `layout` {name: (dtype, shape)}: `write` takes pieces in file order,
    `finish` checks every byte came and fsyncs: (bytes, chunk digest)."""

    def __init__(self, path: str, layout: dict[str, tuple[torch.dtype, list[int]]], chunk: int = CHUNK):
        self.order = sorted(layout, key=lambda n: (-_ORDER[_DTYPES[layout[n][0]]], n))
        entries, offset, self._sizes = {}, 0, []
        for name in self.order:
            dtype, shape = layout[name]
            size = math.prod(shape) * dtype.itemsize
            entries[name] = {"dtype": _DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
            self._sizes.append(size)
            offset += size
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        head = len(text).to_bytes(8, "little") + text
        self.path, self._chunk, self._layout = path, chunk, layout
        self._at, self._left = 0, self._sizes[0] if self._sizes else 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._io = ThreadPoolExecutor(WRITERS, thread_name_prefix="safetensors-write")
        self._hashing = ThreadPoolExecutor(THREADS, thread_name_prefix="safetensors-hash")
        self._digest, self.size = ChunkHasher(self._hashing), len(head)
        self._digest.update(head)
        self._write_at(head, 0)
        self._skip_empty()

    def _write_at(self, data, offset: int) -> None:
        while data:  # pwrite may write less than asked
            done = os.pwrite(self._fd, data, offset)
            data, offset = data[done:], offset + done

    @property
    def current(self) -> str | None:
        """The tensor whose pieces `write` takes next (None when all are written)."""
        return self.order[self._at] if self._at < len(self.order) else None

    def write(self, name: str, piece: torch.Tensor) -> None:
        if piece.numel() == 0 and name in self._layout:
            return  # an empty sequence: nothing to write, wherever the file stands
        if name != self.current or piece.dtype != self._layout[name][0]:
            raise ValueError(f"{self.path}: got a {piece.dtype} piece of {name}, expected {self.current}")
        raw = piece.detach().contiguous().view(-1).view(torch.uint8).numpy()
        if len(raw) > self._left:
            raise ValueError(f"{self.path}: {name} is longer than its shape says")
        chunks = [raw[at : at + self._chunk].data for at in range(0, len(raw), self._chunk)]  # views, no copy
        written = [
            self._io.submit(self._write_at, c, self.size + i * self._chunk) for i, c in enumerate(chunks)
        ]
        for chunk in chunks:
            self._digest.update(chunk)
        for future in written:
            future.result()
        self._digest.settle()  # the piece's buffer is the caller's again
        self.size += len(raw)
        self._left -= len(raw)
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._left == 0 and self._at < len(self.order):
            self._at += 1
            self._left = self._sizes[self._at] if self._at < len(self.order) else 0

    def finish(self) -> tuple[int, str]:
        if self.current is not None:
            raise ValueError(f"{self.path}: {self.current} is short of {self._left} bytes")
        self.close()
        return self.size, self._digest.hexdigest()

    def close(self) -> None:
        """Close the file (fsynced when complete); idempotent."""
        if self._fd < 0:
            return
        self._io.shutdown(wait=True)
        self._hashing.shutdown(wait=True)
        try:
            if self.current is None:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


def write_pieces(path: str, tensors: dict[str, list[torch.Tensor]], chunk: int = CHUNK) -> tuple[int, str]:
    """Write `path` (fsynced) holding each name's pieces concatenated on dim 0: (bytes, chunk digest)."""
    out = StreamedFile(path, {name: layout_of(name, pieces) for name, pieces in tensors.items()}, chunk)
    try:
        for name in out.order:
            for piece in tensors[name]:
                out.write(name, piece)
        return out.finish()
    finally:
        out.close()
