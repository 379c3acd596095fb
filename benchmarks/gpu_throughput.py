#!/usr/bin/env python3
"""Drafter training throughput at paper dims: compiled vs eager flex_attention, tokens/s, MFU.

One run prints one table. The eager run happens in a child process: eager flex_attention must
never share a process with compiled calls (it can leave the global FX-tracing flag set).

  python benchmarks/gpu_throughput.py --out benchmarks/results/throughput.md      # on a GPU
  python benchmarks/gpu_throughput.py --small                                     # CPU smoke run

Tokens/s counts BLOCK tokens trained (anchors x block size) per second; context tokens/s counts
the target hidden-state positions consumed per second. MFU = model FLOPs / measured bf16 matmul
peak, FLOPs counted for forward + backward: trainable matmuls 3x forward (input and weight
grads), attention 3x forward over the unmasked query-key pairs only (no recompute counted),
fc 2x (its input needs no grad), the frozen lm_head 2x (input grad only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PAPER = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288, layers=5, block=16,
             anchors=512, ctx=3072, vocab=151936, target_layers=5, batch=1)
SMALL = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, layers=2, block=8,
             anchors=16, ctx=128, vocab=512, target_layers=3, batch=1)


def model_flops(d: dict, anchors, valid) -> dict:
    """FLOPs of one training step, split by part."""
    H, B, T = d["hidden"], d["block"], d["ctx"]
    q_tokens = anchors.shape[0] * anchors.shape[1] * B
    kv_tokens = anchors.shape[0] * T + q_tokens
    q_out, kv_out = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    per_layer = (2 * q_tokens * H * q_out * 2            # q_proj, o_proj
                 + 2 * kv_tokens * H * kv_out * 2        # k_proj, v_proj over context + block
                 + 2 * q_tokens * H * d["inter"] * 3)    # gate, up, down
    a = anchors[valid].double()
    pairs = float((B * (a + B)).sum()) + float((~valid).sum()) * B  # padding blocks: themselves only
    attn = 4 * pairs * d["head_dim"] * d["heads"]        # QK^T and PV, per layer
    fc = 2 * anchors.shape[0] * T * d["target_layers"] * H * H
    loss_rows = int(valid.sum()) * (B - 1)
    lm_head = 2 * loss_rows * H * d["vocab"]
    parts = {"layers": 3 * d["layers"] * per_layer, "attention": 3 * d["layers"] * attn,
             "fc": 2 * fc, "lm_head": 2 * lm_head}
    parts["total"] = sum(parts.values())
    return parts


def matmul_peak(device) -> float:
    import torch

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - start)


def run_child(d: dict, backend: str, steps: int, device: str) -> dict:
    import torch
    from torch import nn

    from trainer.compile_lock import CompileGuard
    from trainer.loss import block_labels
    from trainer.masks import build_block_mask, dense_mask, sample_anchors
    from trainer.model import DFlashDrafter, DrafterConfig

    guard = CompileGuard("lock")
    guard.install()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    H, V = d["hidden"], d["vocab"]
    embed = nn.Embedding(V, H).to(device, dtype).requires_grad_(False)
    lm_head = nn.Linear(H, V, bias=False).to(device, dtype).requires_grad_(False)
    layer_ids = list(range(1, 1 + d["target_layers"]))
    cfg = DrafterConfig(hidden_size=H, intermediate_size=d["inter"], num_heads=d["heads"], num_kv_heads=d["kv_heads"],
                        head_dim=d["head_dim"], vocab_size=V, mask_token_id=V - 1, target_layer_ids=layer_ids,
                        num_layers=d["layers"], block_size=d["block"], num_target_layers=max(layer_ids) + 3)
    model = DFlashDrafter(cfg, embed, lm_head).to(device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device.startswith("cuda"))
    Bs, T = d["batch"], d["ctx"]
    context = torch.randn(Bs, T, d["target_layers"] * H, device=device, dtype=dtype)
    input_ids = torch.randint(0, V - 1, (Bs, T), device=device)
    loss_mask = torch.ones(Bs, T, dtype=torch.bool, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    attn_backend = "sdpa" if backend == "sdpa" else backend
    times, flops = [], None
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        sync()
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(step)
        anchors, valid = sample_anchors(loss_mask, d["anchors"], d["block"], gen)
        build = dense_mask if backend == "sdpa" else build_block_mask
        mask = build(anchors, valid, T, d["block"], device)
        with guard.step("bench", step, (Bs, T)):
            hidden = model(context, input_ids, anchors, mask, attn_backend)
            labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, d["block"])
            loss, _acc = model.loss(hidden, labels, label_mask, 7.0)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        if flops is None:
            flops = model_flops(d, anchors.cpu(), valid.cpu())
    steady = times[min(3, len(times) - 1):]
    median = statistics.median(steady)
    block_tokens = d["batch"] * d["anchors"] * d["block"]
    out = {"backend": backend, "first_step_s": times[0], "median_step_s": median, "steps": steps,
           "block_tokens_per_s": block_tokens / median, "context_tokens_per_s": d["batch"] * T / median,
           "flops": flops, "achieved_tflops": flops["total"] / median / 1e12, "loss": float(loss),
           "compiles": [e for e in guard.events if e.get("event") == "compile"]}
    if device.startswith("cuda"):
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny dims on CPU (sdpa): a smoke test of this script")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backends", default="flex,flex_eager")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="print a torch profiler table of one compiled step")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dims = SMALL if args.small else PAPER
    device = "cpu" if args.small else args.device
    if args.child:
        print("RESULT " + json.dumps(run_child(dims, args.child, args.steps, device)), flush=True)
        return 0
    backends = ["sdpa"] if args.small else args.backends.split(",")
    results = []
    for backend in backends:
        argv = [sys.executable, os.path.abspath(__file__), "--child", backend, "--steps", str(args.steps),
                "--device", args.device] + (["--small"] if args.small else [])
        done = subprocess.run(argv, capture_output=True, text=True)
        line = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not line:
            print(f"{backend}: FAILED\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            return 1
        results.append(json.loads(line[0][7:]))
    peak = None if args.small else matmul_peak(args.device)
    header = ("| backend | median step s | first step s | block tok/s | context tok/s | TFLOP/s | MFU | peak mem GiB |\n"
              "|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        mfu = f"{100 * r['achieved_tflops'] * 1e12 / peak:.1f}%" if peak else "-"
        rows.append(f"| {r['backend']} | {r['median_step_s']:.4f} | {r['first_step_s']:.1f} | {r['block_tokens_per_s']:,.0f} | "
                    f"{r['context_tokens_per_s']:,.0f} | {r['achieved_tflops']:.1f} | {mfu} | {r.get('peak_mem_gib', 0):.1f} |")
    text = [header] + rows
    if peak:
        text.append(f"\nbf16 matmul peak measured in this run (8192^3): {peak / 1e12:.0f} TFLOP/s")
    if len(results) == 2:
        text.append(f"compiled / eager step-time speedup: {results[1]['median_step_s'] / results[0]['median_step_s']:.2f}x")
    f = results[0]["flops"]
    text.append("FLOPs per step (fwd+bwd): " + ", ".join(f"{k} {v / 1e12:.2f} T" for k, v in f.items()))
    print("\n".join(text))
    if args.out:
        import torch

        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        with open(args.out, "a") as fh:
            fh.write(f"\n### throughput — {datetime.date.today()}\n\n`{command}`\n\ntorch {torch.__version__}; dims {dims}\n\n"
                     + "\n".join(text) + "\n")
    if args.profile and not args.small:
        profile(dims, args.device)
    return 0


def profile(d, device):
    import torch
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        run_child(d, "flex", 4, device)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    sys.exit(main())
