"""A shard's checksum several cores compute at once: the sha256 of the sha256 digests of its
CHUNK-byte pieces (one sha256 on one core, ~1 GB/s, is slower than a target writes features)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK = 16 << 20
FIELD = "sha256_chunks"  # the manifest's name for it (older caches carry a whole-file "sha256")
THREADS = min(8, os.cpu_count() or 1)


def _digest(parts: list) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()


def _combined(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


class ChunkHasher:
    """Hashes each whole chunk of a file's bytes on `pool`; it may read the buffers until `settle`."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._chunks: list[Future] = []
        self._parts: list = []  # of the chunk being filled: an owned bytearray first, then views
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK - self._filled)
            self._parts.append(view[:take])
            self._filled, view = self._filled + take, view[take:]
            if self._filled == CHUNK:
                self._chunks.append(self._pool.submit(_digest, self._parts))
                self._parts, self._filled = [], 0

    def settle(self) -> None:
        """Wait for the pool and copy the partial chunk, so the caller may reuse its buffers."""
        for chunk in self._chunks:
            chunk.result()
        if self._parts:
            owned = self._parts[0] if isinstance(self._parts[0], bytearray) else bytearray(self._parts[0])
            for part in self._parts[1:]:
                owned += part
            self._parts = [owned]

    def hexdigest(self) -> str:
        digests = [chunk.result() for chunk in self._chunks]
        if self._parts or not digests:
            digests.append(_digest(self._parts))
        return _combined(digests)


def file_digest(path: str) -> str:
    """The chunk digest of a file on disk, its chunks read in order and hashed on a pool."""
    with ThreadPoolExecutor(THREADS, thread_name_prefix="chunk-digest") as pool, open(path, "rb") as f:
        chunks: list[Future] = []
        while True:
            if len(chunks) >= 2 * THREADS:
                chunks[-2 * THREADS].result()  # read ahead of the hashing by a bounded amount
            data = f.read(CHUNK)
            if not data and chunks:
                break
            chunks.append(pool.submit(_digest, [data]))
            if len(data) < CHUNK:
                break
        return _combined([chunk.result() for chunk in chunks])
