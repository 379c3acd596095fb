"""The decode loop's cost model: T_target(1), T_verify(B), T_draft(B) and a whole speculative round on the
static loop (trainer.infer.static_decode), and the speed-up each tau would give.

    python benchmarks/decode_cost.py --device cuda:0 --shapes small,8b --out $OUT/decode-cost.md
    python benchmarks/decode_cost.py --device cpu --shapes tiny --out /tmp/decode-cost.md       (smoke)

Random weights (timing does not depend on them; no downloads): `small` is a ~30M Qwen3 (8 layers,
hidden 512, vocab 8192) with a 3-layer drafter; `8b` is Qwen3-8B's shape (36 layers, hidden 4096,
GQA 32/8, vocab 151936) with a paper-dims drafter (5 layers of the target's dims, 5 target layers).
Each part is timed two ways: back-to-back graph replays (the GPU's time, CUDA events) and the real
host loop (replay + the one host sync + flag read per iteration). For every block size B:
speed-up(tau) = tau * T_step / T_round (both host-loop times: a round costs T_round and emits tau
tokens on average; target-only emits one per T_step). The HF-eager reference loop is timed too
(trainer.infer.speculative.target_generate: the loop this replaces).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import QWEN3_8B_SHAPE, built_on, doc_parser, versions  # noqa: E402


class Shape(TypedDict):
    target: dict[str, int]  # Qwen3Config fields
    drafter_layers: int
    layer_ids: list[int]
    prompt: int  # tokens
    new: int  # tokens decoded


SHAPES: dict[str, Shape] = {
    "tiny": {
        "target": {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        "drafter_layers": 1,
        "layer_ids": [1],
        "prompt": 32,
        "new": 32,
    },
    "small": {
        "target": {
            "vocab_size": 8192,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        "drafter_layers": 3,
        "layer_ids": [1, 3, 5],
        "prompt": 256,
        "new": 128,
    },
    "8b": {
        "target": QWEN3_8B_SHAPE,
        "drafter_layers": 5,
        "layer_ids": [1, 9, 17, 25, 33],
        "prompt": 512,
        "new": 256,
    },
}
TAUS = (2.0, 2.8, 3.5, 4.0, 5.0, 6.5)


def build(shape: str, device: str, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.infer.export import qwen3_dims
    from trainer.model import DFlashDrafter, DrafterConfig

    spec = SHAPES[shape]
    dims: dict = dict(spec["target"])  # Qwen3Config's keyword types are wider than these ints
    cfg = Qwen3Config(**dims, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dcfg = DrafterConfig(
        **qwen3_dims(dims),
        mask_token_id=dims["vocab_size"] - 1,
        target_layer_ids=spec["layer_ids"],
        num_layers=spec["drafter_layers"],
        block_size=16,
    )
    with built_on(device, dtype):
        model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
        drafter = DFlashDrafter(dcfg, model.get_input_embeddings(), model.get_output_embeddings())
    drafter.eval().requires_grad_(False)
    return model, drafter


def with_block(drafter, block: int):
    """The same drafter (shared weights) with another block size."""
    import copy
    import dataclasses

    other = copy.copy(drafter)
    other.cfg = dataclasses.replace(drafter.cfg, block_size=block)
    return other


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def gpu_ms(run, device, iterations: int) -> float:
    """Back-to-back calls: the device's time per call (CUDA events; wall clock on the CPU)."""
    run()
    _sync(device)
    if str(device).startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iterations
    t0 = time.perf_counter()
    for _ in range(iterations):
        run()
    return (time.perf_counter() - t0) * 1e3 / iterations


def loop_ms(run, decoder, iterations: int) -> float:
    """What the decode loop pays per iteration: the call, one host sync, the flag read."""
    run()
    decoder.sync()
    t0 = time.perf_counter()
    for _ in range(iterations):
        run()
        decoder.sync()
        bool(decoder.host_flag[0])
    return (time.perf_counter() - t0) * 1e3 / iterations


# How the static loop's layers run: (compiled, q/k/v and gate/up fused, one-row reduction kernels,
# decode_kernels' Triton products). A fused variant fuses the model's weights for good (views), so
# unfused variants must come first.
KERNELS = {
    "eager": (False, False, False, False),
    "compiled": (True, False, False, False),
    "fused": (True, True, False, False),
    "fused-rowwise": (True, True, True, False),
    "triton": (True, True, False, True),
}


ROW_NAME = {"verify": "verify", "draft": "draft", "target": "step", "speculative": "round"}


def parts_of(dec) -> dict:
    """The four calls timed, as functions of a StaticDecoder's state: a target-only step, a verify of
    a block, a draft (context extension + proposals) and a whole speculative round."""
    k, offsets, block = dec.kernels, dec.offsets, dec.block

    def verify():
        where = dec.start.unsqueeze(1) + offsets
        ids = torch.cat([dec.anchor.unsqueeze(1), dec.anchor.unsqueeze(1).expand(-1, block - 1)], 1)
        dec.target.logits(dec.target.hidden(ids, where, k).hidden, k).argmax(-1)

    def draft():
        dec.drafter.extend(dec.pending, dec.pending_start, k)
        dec.drafter.proposals(dec.anchor, dec.start, k)

    return {"verify": verify, "draft": draft, "target": dec.target_step, "speculative": dec.speculative_round}


def measure(model, drafter, shape: str, block: int, kernels: str, device: str, iterations: int) -> dict:
    from trainer.fused_projections import fuse_projections
    from trainer.infer.static_decode import StaticDecoder

    compile, fused, rowwise, triton = KERNELS[kernels]
    if fused:
        fuse_projections(model)

    spec = SHAPES[shape]
    gen = torch.Generator().manual_seed(block)
    vocab = spec["target"]["vocab_size"]
    prompt = torch.randint(0, vocab - 1, (spec["prompt"],), generator=gen).tolist()
    d = with_block(drafter, block)

    def decoder(**how) -> StaticDecoder:
        """One row of this shape's prompt and budget, decoded `how` (compiled, rowwise, graphs)."""
        layers = d.cfg.target_layer_ids
        return StaticDecoder(
            model, layers, d, rows=1, max_prompt=spec["prompt"], max_new_tokens=spec["new"], **how
        )

    t0 = time.perf_counter()
    dec = decoder(compile=compile, rowwise=rowwise, triton=triton)
    dec.prepare([prompt])
    with torch.no_grad():
        # keyed by the row's names; the runners' names are the loop's, so decode() replays these graphs
        parts = {ROW_NAME[name]: dec.runner(name, run) for name, run in parts_of(dec).items()}
        setup_s = time.perf_counter() - t0
        dec.prefill([prompt], spec["new"], True)  # positions at the end of the prompt, as in decoding
        row: dict[str, Any] = {"block": block, "kernels": kernels, "graphs": dec.graphs, "setup_s": setup_s}
        for name, run in parts.items():
            row[f"{name}_gpu_ms"] = gpu_ms(run, device, iterations)
            row[f"{name}_loop_ms"] = loop_ms(run, dec, iterations)
        # the real loop, end to end: target-only tokens/s over the whole budget, three times
        speeds = []
        for _ in range(3):
            out = dec.decode([prompt], spec["new"], speculative=False)
            speeds.append(len(out.results[0].tokens) / out.seconds)
        row["target_only_tok_s"] = statistics.median(speeds)
        row["target_only_tok_s_runs"] = speeds
        # the graph loop against the same static code run eagerly, and speculative against target-only
        spec_out = dec.decode([prompt], spec["new"], speculative=True).results[0].tokens
        eager = decoder(graphs=False, triton=False)
        eager_out = eager.decode([prompt], spec["new"], speculative=False).results[0].tokens
        row["graph_tokens_equal_eager"] = out.results[0].tokens == eager_out
        row["speculative_equals_target_only"] = spec_out == out.results[0].tokens
        del eager
    row["speedup"] = {str(tau): tau * row["step_loop_ms"] / row["round_loop_ms"] for tau in TAUS}
    row["draft_plus_verify_over_step"] = (row["draft_gpu_ms"] + row["verify_gpu_ms"]) / row["step_gpu_ms"]
    return row


def reference_loop(model, shape: str, tokens: int) -> dict:
    from trainer.infer.speculative import target_generate

    spec = SHAPES[shape]
    prompt = list(range(3, 3 + spec["prompt"]))
    target_generate(model, prompt, 4)
    runs = [target_generate(model, prompt, tokens) for _ in range(3)]
    return {"hf_eager_ms_per_token": [1e3 * r.seconds / len(r.tokens) for r in runs]}


def markdown(args, info, results) -> str:
    lines = [
        f"# Decode cost model on {info.get('gpu', args.device)}",
        "",
        f"`python benchmarks/decode_cost.py --device {args.device} --shapes {args.shapes}` "
        f"(torch {info.get('torch')}, transformers {info.get('transformers')}; random weights, "
        "bf16 on CUDA, batch 1).",
        "",
        "T = milliseconds per call. gpu: back-to-back graph replays (CUDA events). loop: replay + the "
        "loop's one host sync + flag read. step = target-only decode step (1 token); verify = target "
        "forward over B tokens; draft = drafter context extension + block forward + proposals; round "
        "= draft + verify + acceptance + bookkeeping (one speculative iteration).",
        "",
    ]
    for shape, part in results.items():
        lines += [f"## {shape}", ""]
        ref = part.get("reference")
        if ref:
            ms = ref["hf_eager_ms_per_token"]
            lines += [
                "HF-eager reference loop (trainer.infer.speculative.target_generate): "
                + ", ".join(f"{m:.2f}" for m in ms)
                + " ms/token (3 runs)",
                "",
            ]
        lines += [
            "| B | kernels | step gpu / loop | verify gpu / loop | draft gpu / loop | round gpu / loop | "
            "(draft+verify)/step | target-only tok/s (3 runs) | setup s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in part["rows"]:
            speeds = ", ".join(f"{v:,.0f}" for v in r["target_only_tok_s_runs"])
            lines.append(
                f"| {r['block']} | {r['kernels']} | {r['step_gpu_ms']:.3f} / {r['step_loop_ms']:.3f} | "
                f"{r['verify_gpu_ms']:.3f} / {r['verify_loop_ms']:.3f} | "
                f"{r['draft_gpu_ms']:.3f} / {r['draft_loop_ms']:.3f} | "
                f"{r['round_gpu_ms']:.3f} / {r['round_loop_ms']:.3f} | "
                f"{r['draft_plus_verify_over_step']:.2f} | "
                f"{r['target_only_tok_s']:,.0f} ({speeds})"
                f" | {r['setup_s']:.1f} |"
            )
        lines += [
            "",
            "Speed-up each tau would give (tau x T_step / T_round, loop times):",
            "",
            "| B | kernels | " + " | ".join(f"tau {t}" for t in TAUS) + " |",
            "|---|---|" + "---|" * len(TAUS),
        ]
        for r in part["rows"]:
            lines.append(
                f"| {r['block']} | {r['kernels']} | "
                + " | ".join(f"{r['speedup'][str(t)]:.2f}x" for t in TAUS)
                + " |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", default="small,8b")
    p.add_argument("--blocks", default="8,16")
    p.add_argument(
        "--kernels",
        default="eager,compiled,fused",
        help=f"comma list of {', '.join(KERNELS)} (in this order: fusing is for good)",
    )
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--reference-tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    info = versions(device)
    import transformers

    info["transformers"] = transformers.__version__
    results = {}
    for shape in args.shapes.split(","):
        print(f"== {shape}", flush=True)
        model, drafter = build(shape, device, dtype)
        rows: list[dict] = []
        part = {"rows": rows, "reference": reference_loop(model, shape, args.reference_tokens)}
        print(f"  reference {part['reference']}", flush=True)
        for kernels in sorted(args.kernels.split(","), key=list(KERNELS).index):
            for block in [int(b) for b in args.blocks.split(",")]:
                row = measure(model, drafter, shape, block, kernels, device, args.iterations)
                print("  " + json.dumps(row), flush=True)
                rows.append(row)
                results[shape] = part
                Path(args.out).with_suffix(".json").write_text(json.dumps({"info": info, "results": results}))
        del model, drafter
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    text = markdown(args, info, results)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
