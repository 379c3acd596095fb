"""The shard checksum: the same digest however the bytes are split, from a file or a stream,
and equal to its definition (sha256 over the 16 MiB pieces' sha256)."""
import hashlib
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainer.data import chunk_digest


def by_definition(data: bytes, chunk: int) -> str:
    pieces = [data[at:at + chunk] for at in range(0, max(len(data), 1), chunk)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 4097, 3 * 4096, 10_000])
def test_any_split_of_the_stream_and_the_file_give_the_defined_digest(tmp_path, monkeypatch, size):
    monkeypatch.setattr(chunk_digest, "CHUNK", 4096)
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    rng = random.Random(1)
    with ThreadPoolExecutor(3) as pool:
        hasher = chunk_digest.ChunkHasher(pool)
        at = 0
        while at < size:
            step = rng.choice([1, 7, 4095, 4096, 5000])
            buffer = bytearray(data[at:at + step])
            hasher.update(buffer)
            hasher.settle()
            buffer[:] = bytes(len(buffer))  # the caller reuses its buffer once settle returns
            at += step
        streamed = hasher.hexdigest()
    expected = by_definition(data, 4096)
    assert streamed == expected == chunk_digest.file_digest(str(tmp_path / "f"))
    assert size <= 4096 or expected != hashlib.sha256(data).hexdigest()
