"""Feature-cache shard writing on this machine's CPU and disk: the streamed writer vs save_file.

A shard at paper dims: sequences of 3072 tokens x 5 layers x 4096 hidden in bf16 (120 MiB each)
plus ids, masks and offsets. `before` is the writer the cache used before: torch.cat of the pieces,
safetensors' save_file, fsync, then the file read back for its digest. `after` is
trainer.data.safetensors_stream.write_pieces (each piece hashed as it is written, then fsync).
Both write the same bytes, checked by the cache's one digest (trainer.data.chunk_digest).
The two alternate, `--repeats` times each.

    python benchmarks/shard_write.py --dir /tmp/shards --sequences 16 --repeats 3
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import doc_parser  # noqa: E402
from trainer.data.chunk_digest import file_digest  # noqa: E402
from trainer.data.safetensors_stream import write_pieces  # noqa: E402


def pieces(sequences: int, tokens: int, width: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    lengths = [tokens] * sequences
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return {
        "features": [torch.randn(n, width, generator=gen).to(torch.bfloat16) for n in lengths],
        "input_ids": [torch.randint(0, 151936, (n,), generator=gen, dtype=torch.int32) for n in lengths],
        "loss_mask": [torch.ones(n, dtype=torch.bool) for n in lengths],
        "offsets": [offsets],
    }


def before(path: str, parts: dict[str, list[torch.Tensor]]) -> str:
    from safetensors.torch import save_file

    save_file({name: torch.cat(p).contiguous() for name, p in parts.items()}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return file_digest(path)


def after(path: str, parts: dict[str, list[torch.Tensor]]) -> str:
    return write_pieces(path, parts)[1]


def main() -> int:
    ap = doc_parser(__doc__)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--width", type=int, default=5 * 4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    parts = pieces(args.sequences, args.tokens, args.width)
    times: dict[str, list[float]] = {"before": [], "after": []}
    hashes = set()
    size = 0
    for _ in range(args.repeats):
        for name, write in (("before", before), ("after", after)):
            path = os.path.join(args.dir, f"{name}.safetensors")
            t0 = time.perf_counter()
            hashes.add(write(path, parts))
            times[name].append(time.perf_counter() - t0)
            size = os.path.getsize(path)
            os.unlink(path)
    shape = f"{args.sequences} sequences x {args.tokens} tokens x {args.width} bf16"
    print(f"shard: {shape} = {size / 2**30:.2f} GiB; same bytes both ways: {len(hashes) == 1}")
    for name, runs in times.items():
        med = statistics.median(runs)
        each = ", ".join(f"{t:.2f}" for t in runs)
        print(f"{name:6s} median {med:.2f} s = {size / med / 1e9:.2f} GB/s  (runs: {each})")
    ratio = statistics.median(times["before"]) / statistics.median(times["after"])
    print(f"after/before: {ratio:.2f}x faster")
    return 0 if len(hashes) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
