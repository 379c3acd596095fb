"""Did training move the RMSNorm weights? A pure-bf16 update rounds away and leaves them at 1.0.

    python benchmarks/precision_check.py --run bf16-mixed=RUN_DIR [--run fp32=RUN_DIR ...] --out result.md

For each training output dir: its latest checkpoint's RMSNorm weights (initialised to 1.0): how
many tensors moved (every element off 1.0), min and max |w - 1| over all their elements, and the
weight dtype; plus the mean loss of the last 5 logged steps (from <RUN_DIR>/metrics.jsonl).
With two or more runs, the loss of each relative to the first. Exit 1 when any norm weight of
any run still has an element at exactly 1.0.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import doc_parser  # noqa: E402


def norm_stats(checkpoint: str) -> dict:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(checkpoint, "drafter.safetensors"))
    norms = {name: w.float() for name, w in weights.items() if name.endswith("norm.weight")}
    offsets = [(w - 1.0).abs() for w in norms.values()]
    return {
        "norm_tensors": len(norms),
        "moved_tensors": sum(bool((off > 0).all()) for off in offsets),
        "elements_at_one": sum(int((off == 0).sum()) for off in offsets),
        "elements": sum(off.numel() for off in offsets),
        "min_abs_w_minus_1": min(float(off.min()) for off in offsets),
        "max_abs_w_minus_1": max(float(off.max()) for off in offsets),
        "dtype": sorted({str(w.dtype).replace("torch.", "") for w in weights.values()}),
    }


def final_loss(run_dir: str, last: int = 5) -> float | None:
    from trainer import metrics_format

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        losses = [r["loss"] for r in metrics_format.parse_lines(f.read()) if r.get("event") == "step"]
    return sum(losses[-last:]) / len(losses[-last:]) if losses else None


def check(runs: list[tuple[str, str]]) -> list[dict]:
    from trainer.train.checkpoint import latest_checkpoint

    rows: list[dict] = []
    for label, run_dir in runs:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            rows.append({"run": label, "failed": f"no checkpoint in {run_dir}"})
            continue
        rows.append(
            {
                "run": label,
                "checkpoint": checkpoint,
                **norm_stats(checkpoint),
                "final_loss": final_loss(run_dir),
            }
        )
    return rows


def render(rows: list[dict], label: str) -> str:
    lines = [
        f"# RMSNorm weights after training — {label}",
        "",
        "| run | norm tensors moved | elements still 1.0 | min abs(w-1) | max abs(w-1) | weight dtype "
        "| loss, last 5 steps | vs first run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = next((r.get("final_loss") for r in rows if r.get("final_loss") is not None), None)
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['run']} | failed: {r['failed']} | | | | | | |")
            continue
        loss = r["final_loss"]
        rel = f"{100 * (loss - base) / base:+.2f}%" if loss is not None and base else "n/a"
        lines.append(
            f"| {r['run']} | {r['moved_tensors']}/{r['norm_tensors']} "
            f"| {r['elements_at_one']}/{r['elements']} "
            f"| {r['min_abs_w_minus_1']:.3g} | {r['max_abs_w_minus_1']:.3g} | {', '.join(r['dtype'])} "
            f"| {'n/a' if loss is None else format(loss, '.4f')} | {rel} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="LABEL=RUN_DIR",
        help="a training output dir, labelled (repeatable; the first is the loss baseline)",
    )
    parser.add_argument("--label", default="", help="what ran (device, steps, lr) for the heading")
    parser.add_argument("--out", help="markdown file to write")
    args = parser.parse_args(argv)
    runs = []
    for item in args.run:
        label, sep, run_dir = item.partition("=")
        if not sep or not run_dir:
            parser.error(f"--run {item!r}: expected LABEL=RUN_DIR")
        runs.append((label, run_dir))
    rows = check(runs)
    text = render(rows, args.label or ", ".join(label for label, _ in runs))
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    stuck = [r["run"] for r in rows if "failed" in r or r["elements_at_one"]]
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main())
