"""flex_attention's kernel options at the drafter's paper-dims attention: forward + backward time each.

    python3 benchmarks/flex_kernel_options.py --device cuda:0 --out benchmarks/results/flex-options.json

One process, one DFlash BlockMask (trainer.masks, 512 anchors of block 16 over a 3072-token context, the
first quarter a prompt), bf16 q [1, 32, 8192, 128] and k/v [1, 8, 11264, 128] with GQA, as one drafter
layer calls it. Each option set compiles afresh (dynamo reset) and is timed with CUDA events: median of
`--repeats` forward+backward passes. The first row is torch's default choice for this GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any
import sys

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

# name -> kernel_options (fwd_/bwd_ prefixes reach one pass only); the mask has no empty row
OPTION_SETS: dict[str, dict] = {
    "default": {},
    "rows safe": {"ROWS_GUARANTEED_SAFE": True},
    "bwd 2 stages": {"bwd_num_stages": 2},
    "bwd 64/64/64/64 w4": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 4,
    },
    "bwd 32/128/128/32 w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_warps": 4,
    },
    "fwd 128/128 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2},
    "tma": {"USE_TMA": True},
    # 64-token mask tiles (trainer.masks.TILE): fewer partially visible tiles, kernel blocks to match
    "tile 64": {
        "tile": 64,
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 64,
        **{f"bwd_BLOCK_{x}": 64 for x in ("M1", "N1", "M2", "N2")},
    },
}


def paper_mask(device: str, small: bool, tile: int):
    import torch

    from trainer import masks
    from trainer.masks import build_block_mask, sample_anchors

    masks.TILE = tile

    anchors_n, ctx = (16, 256) if small else (512, 3072)
    loss_mask = torch.zeros(1, ctx, dtype=torch.bool)
    loss_mask[:, ctx // 4 :] = True
    anchors, valid = sample_anchors(loss_mask, anchors_n, 16, torch.Generator().manual_seed(0))
    return build_block_mask(anchors, valid, ctx, 16, device), anchors_n * 16, ctx


def elapsed_ms(fn, device: str) -> float:
    """`fn()`'s milliseconds: CUDA events on a GPU, the wall clock on a CPU (the smoke run)."""
    import time

    import torch

    if not device.startswith("cuda"):
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_options(options: Any, mask, q_len: int, ctx: int, args) -> dict:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    heads, kv_heads, dim = (4, 2, 16) if args.small else (32, 8, 128)
    gen = torch.Generator(args.device).manual_seed(1)

    def tensor(h: int, length: int):
        x = torch.randn(1, h, length, dim, generator=gen, device=args.device, dtype=torch.bfloat16)
        return x.requires_grad_(args.backward)

    q, k, v = tensor(heads, q_len), tensor(kv_heads, ctx + q_len), tensor(kv_heads, ctx + q_len)
    attend = torch.compile(flex_attention)
    grad = torch.randn_like(q)

    def once() -> None:
        out = attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)
        if args.backward:
            out.backward(grad)

    try:
        for _ in range(2):
            once()
        times = [elapsed_ms(once, args.device) for _ in range(args.repeats)]
    except Exception as exc:  # noqa: BLE001 - an option set the kernel refuses is a result too
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"median_ms": statistics.median(times), "times_ms": [round(t, 3) for t in times]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run)")
    parser.add_argument("--only", help="comma list of option set names (default: all)")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)
    args.backward = args.device.startswith("cuda")  # flex_attention has no CPU backward
    wanted = args.only.split(",") if args.only else list(OPTION_SETS)
    results = {}
    for name in wanted:
        options = dict(OPTION_SETS[name])
        mask, q_len, ctx = paper_mask(args.device, args.small, options.pop("tile", 128))
        results[name] = dict(time_options(options, mask, q_len, ctx, args), options=OPTION_SETS[name])
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
