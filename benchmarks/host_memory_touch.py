"""How fast this host hands out memory it has not handed out before, against memory it has.

    python benchmarks/host_memory_touch.py --dir /tmp --gib 16 [--out results.json]

A feature cache writes gigabytes into the page cache. On a virtual machine the first touch of a guest
page can cost a trip to the hypervisor, so a process's first cache may pay for memory the second
one gets back warm. This measures that cost on its own, each twice in a row:
1. page cache: write --gib GiB into a fresh file in --dir (no fsync), then delete it;
2. anonymous memory: fill a fresh --gib GiB buffer, then free it.
Pass 2 of each reuses what pass 1 freed; pass 1 / pass 2 GB/s near 1 means first touches are free.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time

CHUNK = 64 << 20  # one write of the page-cache pass


def page_cache_gbps(directory: str, total: int) -> float:
    """GB/s writing `total` bytes into a new file in `directory` (no fsync), the file then deleted."""
    block = os.urandom(1 << 20) * (CHUNK >> 20)
    fd, path = tempfile.mkstemp(prefix="touch-", dir=directory)
    try:
        began = time.perf_counter()
        for _ in range(total // CHUNK):
            os.write(fd, block)
        seconds = time.perf_counter() - began
    finally:
        os.close(fd)
        os.unlink(path)
    return total / seconds / 1e9


def anonymous_gbps(total: int) -> float:
    """GB/s filling a fresh anonymous mapping of `total` bytes (each page faulted in by the write)."""
    area = mmap.mmap(-1, total)
    block = b"\1" * CHUNK
    try:
        began = time.perf_counter()
        for offset in range(0, total, CHUNK):
            area[offset : offset + CHUNK] = block
        return total / (time.perf_counter() - began) / 1e9
    finally:
        area.close()


def measure(directory: str, gib: int) -> dict:
    total = gib << 30
    result: dict = {"dir": directory, "gib": gib}
    for name, run in (
        ("page_cache", lambda: page_cache_gbps(directory, total)),
        ("anonymous", lambda: anonymous_gbps(total)),
    ):
        first, second = run(), run()
        result[name] = {"first_gbps": first, "second_gbps": second, "first_over_second": first / second}
        print(
            f"{name}: first pass {first:.2f} GB/s, second {second:.2f} GB/s ({first / second:.2f}x)",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the page-cache pass writes")
    parser.add_argument("--gib", type=int, default=8, help="GiB each pass writes")
    parser.add_argument("--out", help="a JSON copy of the result")
    args = parser.parse_args(argv)
    if args.gib < 1:
        parser.error("--gib: at least 1")
    result = measure(args.dir, args.gib)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
