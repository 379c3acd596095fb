"""Is the fused lm_head + DFlash loss exact, and how fast is each chunk kernel?

    python benchmarks/fused_loss_check.py --device cuda:0 --out $OUT/fused-loss.md   # paper dims, bf16
    python benchmarks/fused_loss_check.py --small                                   # CPU smoke, fp32

At paper dims (512 anchors x 15 trained rows, hidden 4096, vocab 151936, bf16 drafter hidden states
and lm_head, some positions ignored and one block with nothing to train) each kernel of
trainer.loss.dflash_loss_fused is compared with an fp32 reference: the full fp32 logits of the same
(bf16-valued) inputs through trainer.loss.dflash_loss, and its autograd gradient. Reported per
kernel: loss relative error, ||grad - ref|| / ||ref||, the largest per-position accuracy difference,
the median forward+backward time (CUDA events) and the peak memory above the inputs. The kernels
also meet each other: the same bf16 logits, so loss and accuracy must agree much more tightly.

Tolerances (bf16 logits are rounded to 8 mantissa bits, which both kernels share): loss within
2e-3 relative, gradient within 2e-2, accuracy within 0.01 of the reference; compiled vs eager
kernel: loss within 1e-4 relative, accuracy equal, gradient within 1e-2. Exit 1 if one fails.
The Triton kernel runs where trainer.loss_kernel.available says (16-bit CUDA logits, or any under
TRITON_INTERPRET=1); --tiles also times its tilings against the compiled chunk on one chunk of logits.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import doc_parser  # noqa: E402

PAPER = {"anchors": 512, "block": 16, "hidden": 4096, "vocab": 151936}
SMALL = {"anchors": 8, "block": 4, "hidden": 16, "vocab": 96}
KERNELS = ("eager", "compiled", "triton")
# the Triton chunk kernel's tilings timed by --tiles, on one chunk of paper-dims logits
TILE_SWEEP = (
    {"BLOCK": 2048, "num_warps": 4},
    {"BLOCK": 4096, "num_warps": 8},
    {"BLOCK": 8192, "num_warps": 8},
    {"BLOCK": 8192, "num_warps": 16},
    {"BLOCK": 16384, "num_warps": 16},
)
TOLERANCE = {"loss_rel": 2e-3, "grad_rel": 2e-2, "acc_abs": 0.01}
BETWEEN = {"loss_rel": 1e-4, "grad_rel": 1e-2, "acc_abs": 0.0}


def make_inputs(torch, dims: dict, device: str, dtype):
    from trainer.loss import IGNORE_INDEX

    g = torch.Generator(device="cpu").manual_seed(0)
    n, block = dims["anchors"], dims["block"]
    hidden = (torch.randn(1, n * block, dims["hidden"], generator=g) * 2.0).to(device, dtype)
    weight = (torch.randn(dims["vocab"], dims["hidden"], generator=g) * 0.02).to(device, dtype)
    label_mask = torch.rand(1, n, block, generator=g) > 0.1
    label_mask[:, :, 0] = False
    label_mask[:, 3] = False  # a block with nothing to train
    labels = torch.randint(0, dims["vocab"], (1, n, block), generator=g)
    labels = torch.where(label_mask, labels, torch.full_like(labels, IGNORE_INDEX))
    return hidden, weight, labels.to(device), label_mask.to(device)


def rel(torch, a, b) -> float:
    return float(
        torch.linalg.vector_norm((a.double() - b.double()))
        / torch.linalg.vector_norm(b.double()).clamp_min(1e-30)
    )


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def run_kernel(torch, kernel: str, hidden, weight, labels, label_mask, repeats: int, device: str) -> dict:
    from trainer.loss import dflash_loss_fused

    cuda = device.startswith("cuda")
    times, out = [], None
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats + 2):  # the first call compiles
        h = hidden.detach().clone().requires_grad_(True)
        sync(torch, device)
        began = time.perf_counter()
        loss, acc = dflash_loss_fused(h, weight, labels, label_mask, 7.0, kernel=kernel)
        loss.backward()
        sync(torch, device)
        times.append(time.perf_counter() - began)
        out = (loss.detach(), acc.detach(), h.grad.detach())
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if cuda else None
    return {"out": out, "median_s": statistics.median(times[2:]), "first_s": times[0], "peak_gib": peak}


def _reference(torch, hidden, weight, labels, label_mask, device: str):
    """The fp32 reference over the same values: full logits, autograd. (loss, acc, grad of hidden)."""
    from trainer.loss import dflash_loss

    h_ref = hidden.detach().float().requires_grad_(True)
    loss, acc = dflash_loss(torch.nn.functional.linear(h_ref, weight.float()), labels, label_mask, 7.0)
    loss.backward()
    grad = h_ref.grad.detach()
    del h_ref
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return loss.detach(), acc, grad


def _compare(torch, args, inputs, reference) -> tuple[dict, dict, list[str]]:
    """(each kernel against the reference, the kernels against each other, the tolerances missed)."""
    ref_loss, ref_acc, ref_grad = reference
    from trainer import loss_kernel

    results, failures = {}, []
    hidden = inputs[0]
    for kernel in [k for k in KERNELS if k != "triton" or loss_kernel.available(hidden)]:
        hidden, weight, labels, label_mask = inputs
        r = run_kernel(torch, kernel, hidden, weight, labels, label_mask, args.repeats, args.device)
        loss, acc, grad = r.pop("out")
        r.update(
            loss=float(loss),
            loss_rel=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            grad_rel=rel(torch, grad, ref_grad),
            acc_abs=float((acc - ref_acc).abs().max()),
        )
        r["_out"] = (loss, acc, grad)
        results[kernel] = r
        failures += [f"{kernel}: {k} {r[k]:.3g} > {tol}" for k, tol in TOLERANCE.items() if r[k] > tol]
    la, aa, ga = results["eager"].pop("_out")
    between = {}
    for kernel in [k for k in results if k != "eager"]:
        lb, ab, gb = results[kernel].pop("_out")
        pair = {
            "loss_rel": abs(float(la) - float(lb)) / abs(float(la)),
            "grad_rel": rel(torch, gb, ga),
            "acc_abs": float((aa - ab).abs().max()),
        }
        between[kernel] = pair
        failures += [
            f"{kernel} vs eager: {k} {pair[k]:.3g} > {tol}" for k, tol in BETWEEN.items() if pair[k] > tol
        ]
    return results, between, failures


def tile_times(torch, device: str, vocab: int, repeats: int) -> dict[str, float]:
    """Median seconds of one 768-row chunk (the paper dims' chunk) through the compiled chunk and
    the Triton kernel at each tiling of TILE_SWEEP."""
    from trainer import loss, loss_kernel

    g = torch.Generator(device="cpu").manual_seed(1)
    logits = (torch.randn(768, vocab, generator=g) * 3).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (768,), generator=g).to(device)
    weights = torch.rand(768, generator=g).to(device)
    runs = {"compiled": functools.partial(loss.compiled_ce_chunk(), logits, targets, weights)}
    for tiles in TILE_SWEEP:
        name = f"triton BLOCK {tiles['BLOCK']}, {tiles['num_warps']} warps"
        runs[name] = functools.partial(loss_kernel.ce_chunk, logits, targets, weights, tiles)
    times = {}
    for name, run in runs.items():
        for _ in range(3):
            run()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for begin, end in events:
            begin.record()
            run()
            end.record()
        torch.cuda.synchronize(device)
        times[name] = statistics.median(b.elapsed_time(e) for b, e in events) / 1e3
    return times


def _markdown(args, given: str, dims: dict, dtype, ref_loss, results, between, failures) -> str:
    rows = dims["anchors"] * (dims["block"] - 1)
    lines = [
        f"# Fused lm_head + DFlash loss: exactness and speed ({args.device})",
        "",
        f"Command: `python benchmarks/fused_loss_check.py {given}`",
        "",
        f"Dims: {rows} trained rows x hidden {dims['hidden']} x vocab {dims['vocab']}, {str(dtype)[6:]} "
        f"inputs; fp32 reference loss {float(ref_loss):.6f}",
        "",
        "| kernel | loss rel err | grad rel err | acc max abs diff | fwd+bwd median s | first call s "
        "| peak above inputs GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for kernel, r in results.items():
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {kernel} | {r['loss_rel']:.2e} | {r['grad_rel']:.2e} | {r['acc_abs']:.4f} | "
            f"{r['median_s']:.4f} | {r['first_s']:.2f} | {peak} |"
        )
    lines += [
        "",
        *(
            f"{kernel} vs eager kernel: loss rel {b['loss_rel']:.2e}, grad rel {b['grad_rel']:.2e}, "
            f"acc max abs diff {b['acc_abs']:.4f}."
            for kernel, b in between.items()
        ),
        "",
        f"Tolerances vs the fp32 reference {TOLERANCE}; between kernels {BETWEEN}: "
        + ("all met." if not failures else "FAILED: " + "; ".join(failures)),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true", help="tiny dims on the CPU in fp32 (a smoke run)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="markdown results file (a .json copy next to it)")
    parser.add_argument("--tiles", action="store_true", help="time the Triton kernel's tilings (CUDA)")
    args = parser.parse_args(argv)
    import torch

    if args.small:
        args.device = "cpu"
    dims = SMALL if args.small else PAPER
    dtype = torch.float32 if args.small else torch.bfloat16
    inputs = make_inputs(torch, dims, args.device, dtype)
    hidden, weight, labels, label_mask = inputs
    reference = _reference(torch, hidden, weight, labels, label_mask, args.device)
    results, between, failures = _compare(torch, args, inputs, reference)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    text = _markdown(args, given, dims, dtype, reference[0], results, between, failures)
    tiles = tile_times(torch, args.device, dims["vocab"], args.repeats) if args.tiles else {}
    if tiles:
        text += "\n| one 768-row chunk | median ms |\n|---|---|\n"
        text += "".join(f"| {name} | {s * 1e3:.3f} |\n" for name, s in tiles.items())
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump(
                {"dims": dims, "results": results, "between": between, "failures": failures, "tiles": tiles},
                fh,
                indent=1,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
