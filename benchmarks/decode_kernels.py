"""decode_kernels against what they replace on a decode step's shapes: the products (residual fused)
against cuBLAS (F.linear) per tiling, as bandwidth (a step reads every weight once, so bytes of weight
over time is what it is bound by), and the split attention against SDPA with the mask.

    python benchmarks/decode_kernels.py --device cuda:0 --out $OUT/decode-kernels.json
    python benchmarks/decode_kernels.py --device cpu --shapes tiny --out /tmp/dk.json  (smoke: reference)

Each product is timed on COPIES distinct weights in turn (more bytes than the L2 holds), back to back in
one CUDA graph, at 1 row (a step) and 16 rows (a block-16 verify); cuBLAS does the product alone, the
kernel adds the residual too. Attention: one layer's cache, at S cached positions, half of them seen.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import QWEN3_8B_SHAPE, doc_parser, versions  # noqa: E402
from trainer.infer import decode_kernels  # noqa: E402

COPIES = 4


def products(shape: dict) -> dict[str, tuple[int, int, str]]:
    """name: (output width, input width, what is fused) of one decoder layer and the head."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv, dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    return {
        "qkv": ((heads + 2 * kv) * dim, hidden, "none"),
        "o": (hidden, heads * dim, "residual"),
        "gate_up": (2 * inter, hidden, "none"),
        "down": (hidden, inter, "residual"),
        "head": (shape["vocab_size"], hidden, "none"),
    }


SHAPES = {
    "8b": QWEN3_8B_SHAPE,
    "tiny": {**QWEN3_8B_SHAPE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}  # fmt: skip
TILINGS = [
    {"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for n, k, w, s in [(16, 256, 4, 4), (32, 256, 4, 3), (64, 256, 4, 4), (32, 512, 4, 3), (16, 512, 4, 4),
                       (32, 128, 4, 4), (64, 256, 8, 3), (64, 128, 4, 5)]
]  # fmt: skip


def timed(calls, device: str, repeats: int = 20) -> float:
    """Microseconds per call of `calls` (a list run in order), replayed as one CUDA graph."""
    if not device.startswith("cuda"):
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats / len(calls)


def measure(name: str, width: int, depth: int, fused: str, rows: int, device: str, tilings) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    weights = [torch.randn(width, depth, device=device, dtype=dtype) / 64 for _ in range(COPIES)]
    x = torch.randn(rows, depth, device=device, dtype=dtype)
    residual = torch.randn(rows, width, device=device, dtype=dtype) if fused == "residual" else None

    def kernel(w, tiles):
        return lambda: decode_kernels.linear(x, w, residual=residual, tiles=tiles)

    want = decode_kernels.reference_linear(x, weights[0], residual=residual).float()
    error = ((kernel(weights[0], None)().float() - want).abs().max() / want.abs().max()).item()
    megabytes = weights[0].numel() * weights[0].element_size() / 1e6
    row = {"product": name, "rows": rows, "fused": fused, "MB": round(megabytes, 1), "rel_error": error}
    if not device.startswith("cuda"):
        return row
    row["cublas_us"] = timed([lambda w=w: torch.nn.functional.linear(x, w) for w in weights], device)
    row["kernel_us"] = timed([kernel(w, None) for w in weights], device)
    row["tilings"] = [{**t, "us": timed([kernel(w, t) for w in weights], device)} for t in tilings]
    row["best"] = min(row["tilings"], key=lambda t: t["us"])
    for key in ("cublas", "kernel"):
        row[f"{key}_TBps"] = megabytes / row[f"{key}_us"]  # MB per microsecond = TB/s
    return row


def measure_attention(shape: dict, positions: int, length: int, device: str) -> dict:
    from trainer.infer.static_decode import grouped_attention, grouped_mask

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    kv, dim = shape["num_key_value_heads"], shape["head_dim"]
    group = shape["num_attention_heads"] // kv
    q = torch.randn(1, kv, group * length, dim, device=device, dtype=dtype)
    keys = [torch.randn(1, kv, positions, dim, device=device, dtype=dtype) for _ in range(COPIES)]
    values = [torch.randn(1, kv, positions, dim, device=device, dtype=dtype) for _ in range(COPIES)]
    where = torch.arange(length, device=device).unsqueeze(0) + positions // 2
    new_k, new_v = (torch.randn(1, length, kv, dim, device=device, dtype=dtype) for _ in range(2))
    got = decode_kernels.attention(q, keys[0], values[0], where, new_k, new_v, where).float()
    want = decode_kernels.reference_attention(q, keys[0], values[0], where, new_k, new_v, where).float()
    row = {
        "attention": True,
        "positions": positions,
        "rows": length,
        "max_abs_error": (got - want).abs().max().item(),
    }
    if device.startswith("cuda"):
        mask = grouped_mask(decode_kernels.grouped_visibility(where, positions, group), dtype)
        rows = torch.zeros(1, 1, dtype=torch.long, device=device)

        def sdpa(k, v):  # what the compiled loop ran: the cache writes, then SDPA with the mask
            k[rows, :, where], v[rows, :, where] = new_k, new_v
            return grouped_attention(q, k, v, mask)

        pairs = list(zip(keys, values, strict=True))
        row["sdpa_us"] = timed([lambda k=k, v=v: sdpa(k, v) for k, v in pairs], device)
        row["kernel_us"] = timed(
            [
                lambda k=k, v=v: decode_kernels.attention(q, k, v, where, new_k, new_v, where)
                for k, v in pairs
            ],
            device,
        )
    return row


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", default="8b")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    results: dict[str, Any] = {
        "info": versions(args.device),
        "default": decode_kernels.LINEAR_TILES,
        "rows": [],
    }
    for shape in args.shapes.split(","):
        for positions, length in ((784, 1), (784, 16), (4096, 1), (4096, 16)):
            row = measure_attention(SHAPES[shape], positions, length, args.device) | {"shape": shape}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        for name, (width, depth, fused) in products(SHAPES[shape]).items():
            for rows in (1, 16):
                row = measure(name, width, depth, fused, rows, args.device, TILINGS) | {"shape": shape}
                results["rows"].append(row)
                short = {k: v for k, v in row.items() if k != "tilings"}
                print(json.dumps(short), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
