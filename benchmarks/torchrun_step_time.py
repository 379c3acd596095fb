"""Step time of the torchrun launcher (nproc 1) against the threaded launcher's single replica.

    python benchmarks/torchrun_step_time.py --out $OUT/torchrun.md             # one GPU, compiled flex
    python benchmarks/torchrun_step_time.py --small --out /tmp/torchrun.md     # CPU smoke (sdpa, gloo)

Both runs are the real trainer (`python -m trainer`), each in a fresh process with fresh, empty
inductor/triton caches, on the same config: the tiny-random Qwen3 target widened to a mid-size
model so a step is GPU work rather than Python overhead, synthetic data, one drafter replica whose
target shares its GPU. threads: `--target-devices cuda:0 --drafter-devices cuda:0`; torchrun:
`torchrun --standalone --nproc-per-node 1 -m trainer --launcher torchrun` (DDP over NCCL).

Step time = median interval between consecutive `step` records of the metrics file, after the
first --warmup steps (which hold the compiles). Runs alternate threads, torchrun, threads, ... for
--repeats rounds, so drift of the machine hits both alike. The goal: torchrun within 5 % of threads.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import doc_parser, fresh_compile_env, versions  # noqa: E402

GOAL = 0.05
SMALL_CONFIG = "small CPU smoke (sdpa, gloo)"
MID_CONFIG = "mid-size (hidden 1024, 3 drafter layers, ctx 1024, 128 anchors x 2 seqs), compiled flex, NCCL"
# A mid-size target and drafter (hidden 1024, head_dim 64) on a 1024-token context.
GPU_SETTINGS = {
    "target.tiny.hidden_size": 1024,
    "target.tiny.intermediate_size": 2816,
    "target.tiny.num_hidden_layers": 8,
    "target.tiny.num_attention_heads": 16,
    "target.tiny.num_key_value_heads": 8,
    "target.tiny.head_dim": 64,
    "target.tiny.vocab_size": 32000,
    "target.layer_ids": "[1, 3, 5]",
    "drafter.num_layers": 3,
    "drafter.block_size": 16,
    "drafter.num_heads": 16,
    "drafter.num_kv_heads": 8,
    "drafter.head_dim": 64,
    "drafter.intermediate_size": 2816,
    "data.seq_len": 1024,
    "data.synthetic.num_samples": 64,
    "data.synthetic.prompt_len": 768,
    "train.batch_size": 2,
    "train.num_anchors": 128,
    "train.gamma": 7.0,
    "train.epochs": 1000,
    "run.checkpoint_every": 100000,
    "run.log_every": 20,
}
SMALL_SETTINGS = {
    "data.seq_len": 64,
    "data.synthetic.num_samples": 16,
    "train.batch_size": 2,
    "train.num_anchors": 8,
    "train.epochs": 1000,
    "run.checkpoint_every": 100000,
    "run.log_every": 20,
}


def command(launcher: str, small: bool, steps: int, out_dir: str, metrics: str) -> list[str]:
    settings = SMALL_SETTINGS if small else GPU_SETTINGS
    args = [
        "-m",
        "trainer",
        "--config",
        "tiny-cpu",
        "--output-dir",
        out_dir,
        "--metrics-file",
        metrics,
        "--max-steps",
        str(steps),
        "--attention",
        "sdpa" if small else "flex",
    ]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    if launcher == "threads":
        device = "cpu" if small else "cuda:0"
        return [sys.executable, *args, "--target-devices", device, "--drafter-devices", device]
    device = "cpu" if small else "cuda"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        *args,
        "--launcher",
        "torchrun",
        "--target-devices",
        device,
        "--drafter-devices",
        device,
    ]


def run_once(launcher: str, small: bool, steps: int, warmup: int, timeout_s: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"trstep-{launcher}-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        env = fresh_compile_env(tmp, PYTHONUNBUFFERED="1")
        cmd = ["timeout", "-k", "10", str(timeout_s)] + command(
            launcher, small, steps, os.path.join(tmp, "out"), metrics
        )
        print(f"[{launcher}] {' '.join(cmd[4:])}", flush=True)
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-40:]
            if line.startswith(("step ", "compile ", "done ", "dflash-train:")) or "error" in line.lower():
                print(f"  [{launcher}] {line.rstrip()}", flush=True)
        code = proc.wait()
        records = []
        if os.path.exists(metrics):
            records = [json.loads(x) for x in open(metrics, encoding="utf-8") if x.strip()]
    step_times = [r["time"] for r in records if r.get("event") == "step"]
    intervals = [b - a for a, b in zip(step_times[warmup:], step_times[warmup + 1 :], strict=False)]
    compiles = [r for r in records if r.get("event") == "compile"]
    result = {
        "launcher": launcher,
        "exit": code,
        "steps": len(step_times),
        "median_step_s": statistics.median(intervals) if intervals else None,
        "mean_step_s": statistics.fmean(intervals) if intervals else None,
        "tokens_per_s": statistics.median(
            [r["tokens_per_s"] for r in records if r.get("event") == "step"][warmup:] or [0.0]
        ),
        "compiles": len(compiles),
        "compile_s": sum(c.get("duration_s", 0.0) for c in compiles),
    }
    if code != 0 or not intervals:
        result["tail"] = tail
    print(f"[{launcher}] {json.dumps({k: v for k, v in result.items() if k != 'tail'})}", flush=True)
    return result


def report(results: list[dict], args, info: dict) -> str:
    by = {
        name: [r for r in results if r["launcher"] == name and r["median_step_s"]]
        for name in ("threads", "torchrun")
    }
    med = {name: statistics.median(r["median_step_s"] for r in rs) if rs else None for name, rs in by.items()}
    lines = [
        "# torchrun (nproc 1) vs threads (1 replica): step time",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        f"Config: {SMALL_CONFIG if args.small else MID_CONFIG}; "
        f"{args.steps} steps per run, first {args.warmup} skipped; fresh caches per run.",
        "",
        "| run | launcher | exit | steps | median step (ms) | mean step (ms) | block tok/s | compiles "
        "| compile s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(results, 1):
        ms = lambda v: f"{v * 1000:.2f}" if v else "-"  # noqa: E731
        lines.append(
            f"| {i} | {r['launcher']} | {r['exit']} | {r['steps']} | {ms(r['median_step_s'])} | "
            f"{ms(r['mean_step_s'])} | {r['tokens_per_s']:,.0f} | {r['compiles']} | {r['compile_s']:.1f} |"
        )
    lines.append("")
    if med["threads"] and med["torchrun"]:
        ratio = med["torchrun"] / med["threads"] - 1
        verdict = "within" if ratio <= GOAL else "NOT within"  # faster is fine
        lines.append(
            f"torchrun median step {med['torchrun'] * 1000:.2f} ms vs threads "
            f"{med['threads'] * 1000:.2f} ms: "
            f"{ratio:+.1%} ({verdict} the {GOAL:.0%} goal)."
        )
    else:
        lines.append("A launcher produced no step times; see the tails below.")
    for r in results:
        if "tail" in r:
            lines += ["", f"## {r['launcher']} (exit {r['exit']}) output tail", "```", *r["tail"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--out", required=True, help="markdown file to write (a .json copy goes next to it)")
    p.add_argument("--small", action="store_true", help="CPU smoke: tiny dims, sdpa, gloo")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 80 GPU, 30 small)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out (default 10 GPU, 5 small)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of threads+torchrun")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run before it is killed")
    args = p.parse_args()
    args.steps = args.steps or (30 if args.small else 80)
    args.warmup = args.warmup if args.warmup is not None else (5 if args.small else 10)
    info = versions("cpu" if args.small else "cuda:0")
    results = []
    for _ in range(args.repeats):
        for launcher in ("threads", "torchrun"):
            results.append(run_once(launcher, args.small, args.steps, args.warmup, args.timeout))
    text = report(results, args, info)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump({"info": info, "args": vars(args), "results": results}, f, indent=2)
    print(text, flush=True)
    return 0 if all(r["exit"] == 0 and r["median_step_s"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
