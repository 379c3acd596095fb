"""Tau on a device: train tiny-cpu with the evaluation on, measure its overhead, then `dflash-train eval`.

    python benchmarks/tau_session.py --device cuda:0 --out benchmarks/results/tau.md
    python benchmarks/tau_session.py --device cpu --max-steps 60 --eval-every 30 --out /tmp/tau.md   (smoke)

1. `dflash-train --config tiny-cpu` with eval on (compiled flex on CUDA), and the same run with
   eval.every 0; eval overhead = summed eval seconds / wall time of the run (and the wall difference).
2. `dflash-train eval --json` on the finished run's held-out prompts: tau, acceptance per block
   position, target-only vs speculative tokens/s, the lossless check.
Every child runs under `timeout -k`; its output streams to stdout. Markdown (+ .json) goes to --out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import doc_parser, popen_text, tiny_train_argv, under_timeout, versions  # noqa: E402
from trainer import metrics_format  # noqa: E402


def stream(cmd: list[str], limit_s: int, env: dict) -> tuple[int, str]:
    """Run `cmd` under `timeout -k 10 limit_s`, echoing its output; (exit code, output)."""
    print("$ " + " ".join(cmd), flush=True)
    proc = popen_text(under_timeout(cmd, limit_s), env, stderr=subprocess.STDOUT)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not line.startswith("step ") or "eval" in line:  # per-step lines would flood the log
            print("  " + line.rstrip(), flush=True)
    return proc.wait(), "".join(lines)


def train(args, out_dir: Path, eval_every: int, env: dict) -> dict:
    cmd = tiny_train_argv(out_dir, "--set", f"eval.every={eval_every}", "--set", "run.log_every=1000")
    if args.max_steps:
        cmd += ["--max-steps", str(args.max_steps)]
    if args.device.startswith("cuda"):
        cmd += [
            "--attention",
            "flex",
            "--target-devices",
            args.device,
            "--drafter-devices",
            ",".join([args.device] * 2),
        ]
    code, output = stream(cmd, args.timeout, env)
    records = (
        metrics_format.parse_lines((out_dir / "metrics.jsonl").read_text())
        if (out_dir / "metrics.jsonl").is_file()
        else []
    )
    evals = [r for r in records if r["event"] == "eval"]
    steps = [r for r in records if r["event"] == "step"]
    wall = records[-1]["time"] - records[0]["time"] if len(records) > 1 else float("nan")
    # after the first step: without startup and the first compile
    steady = records[-1]["time"] - steps[0]["time"] if steps else float("nan")
    return {
        "exit": code,
        "wall_s": wall,
        "steady_s": steady,
        "eval_s": sum(r["seconds"] for r in evals),
        "evals": evals,
        "expected_tau": metrics_format.expected_tau(steps[-1]["acc"]) if steps else None,
        "tail": output.splitlines()[-3:],
    }


def evaluate(args, run_dir: Path, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "eval",
        "--checkpoint",
        str(run_dir),
        "--device",
        args.device,
        "--num-prompts",
        str(args.num_prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--json",
    ]
    code, output = stream(cmd, args.timeout, env)
    objects = [line for line in output.splitlines() if line.startswith("{")]
    try:
        result = json.loads(objects[-1]) if objects else {}
    except ValueError:
        result = {}
    return dict(result, exit=code)


def markdown(args, info, with_eval, without, ev) -> str:
    pct = 100 * with_eval["eval_s"] / with_eval["wall_s"] if with_eval["wall_s"] else float("nan")
    steady_pct = 100 * with_eval["eval_s"] / with_eval["steady_s"] if with_eval["steady_s"] else float("nan")
    diff = with_eval["steady_s"] - without["steady_s"]
    lines = [
        f"# Tau on {info.get('gpu', args.device)}",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        f"`python benchmarks/tau_session.py --device {args.device}"
        + (f" --max-steps {args.max_steps}" if args.max_steps else "")
        + "`",
        "",
        "## Eval overhead during training (tiny-cpu"
        + (", compiled flex" if args.device.startswith("cuda") else "")
        + ")",
        "",
        "Each run starts with empty compile caches. Steady = from the first step's record to the end.",
        "",
        "| run | exit | wall s | steady s | eval s | eval share of wall | of steady |",
        "|---|---|---|---|---|---|---|",
        f"| eval on | {with_eval['exit']} | {with_eval['wall_s']:.1f} | {with_eval['steady_s']:.1f} | "
        f"{with_eval['eval_s']:.2f} | {pct:.1f} % | {steady_pct:.1f} % |",
        f"| eval.every 0 | {without['exit']} | {without['wall_s']:.1f} | {without['steady_s']:.1f} "
        "| 0 | - | - |",
        "",
        f"Steady-time difference (eval on - off): {diff:+.1f} s. Evaluations logged during training:",
        "",
        "| step | tau | acceptance by position | lossless | prompts | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for e in with_eval["evals"]:
        lines.append(
            f"| {e['step']} | {e['tau']:.3f} | {' '.join(f'{a:.2f}' for a in e['acceptance'])} | "
            f"{e['lossless']} | {e['prompts']} | {e['seconds']:.2f} |"
        )
    if with_eval["expected_tau"] is not None:
        lines += ["", f"Expected tau from the last step's training accuracy: {with_eval['expected_tau']:.3f}"]
    lines += ["", "## `dflash-train eval` on the finished run (prompts it never trained on)", ""]
    if ev.get("tau") is None:
        lines.append(f"failed (exit {ev.get('exit')})")
    else:
        lines += [
            f"- tau **{ev['tau']:.3f}** over {ev['rounds']} rounds, {ev['prompts']} prompts, "
            f"{ev['new_tokens']} new tokens, block {ev['block_size']}",
            "- acceptance by block position: "
            + " ".join(f"{k}:{a:.2f}" for k, a in enumerate(ev["acceptance"], 1)),
            f"- tokens/s: target-only {ev['target_tokens_per_s']:.1f}, speculative "
            f"{ev['speculative_tokens_per_s']:.1f}, speedup **{ev['speedup']:.2f}x**",
            f"- lossless: {ev['lossless']} (floating-point ties: {ev['ties']}), exit {ev['exit']}",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=None, help="shorten the tiny run (smoke tests)")
    p.add_argument("--eval-every", type=int, default=240)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--timeout", type=int, default=240, help="seconds per child process")
    args = p.parse_args()
    info = versions(args.device)
    print("versions: " + json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)

        def env(name: str) -> dict:  # fresh compile caches per run: both pay the same compiles
            return dict(
                os.environ,
                PYTHONUNBUFFERED="1",
                TORCHINDUCTOR_CACHE_DIR=str(tmp / name / "inductor"),
                TRITON_CACHE_DIR=str(tmp / name / "triton"),
            )

        with_eval = train(args, tmp / "eval", args.eval_every, env("eval"))
        without = train(args, tmp / "no-eval", 0, env("no-eval"))
        ev = evaluate(args, tmp / "eval", env("eval"))
    text = markdown(args, info, with_eval, without, ev)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps(
            {"versions": info, "with_eval": with_eval, "without_eval": without, "eval": ev},
            indent=2,
            default=str,
        )
    )
    print(text, flush=True)
    return 0 if with_eval["exit"] == 0 and ev.get("exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
