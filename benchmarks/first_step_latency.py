#!/usr/bin/env python3
"""The compile lock's cost: time from trainer start to each drafter thread's first finished step,
with `--compile-lock lock` and `none`, fresh caches each. Reads the trainer's own metrics file.

  python benchmarks/first_step_latency.py --device cuda:0 --threads 3
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/i", TRITON_CACHE_DIR=f"{tmp}/t", PYTHONPATH=str(REPO))
        argv = [sys.executable, "-m", "trainer", "--config", args.config, "--output-dir", f"{tmp}/out",
                "--max-steps", "2", "--compile-lock", mode, "--attention", "flex", "--target-devices", args.device,
                "--drafter-devices", ",".join([args.device] * args.threads), "--metrics-file", f"{tmp}/m.jsonl"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
        records = [json.loads(l) for l in pathlib.Path(f"{tmp}/m.jsonl").read_text().splitlines() if l.strip()]
    start = next(r["time"] for r in records if r["event"] == "start")
    first = next((r["time"] for r in records if r["event"] == "step"), None)
    compiles = [r for r in records if r["event"] == "compile"]
    return {"mode": mode, "exit": done.returncode, "first_step_s": None if first is None else first - start,
            "compile_s_by_thread": {t: round(sum(c.get("duration_s", 0) for c in compiles if c.get("thread") == t), 2)
                                    for t in sorted({c.get("thread") for c in compiles})}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--modes", default="lock,none")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    for mode in args.modes.split(","):
        print(json.dumps(run(mode, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
