#!/usr/bin/env python3
"""Race regression harness: K fresh-process trials of the REAL trainer, per compile-lock mode.

Each trial runs `python -m trainer` with a fresh, empty inductor and triton cache, one target
worker and N drafter threads on one GPU that start their first compiled flex_attention
forward+backward together. A trial is counted as:
  fx     the FX-tracing race error ("Detected that you are using FX to symbolically trace …")
  mask   the create_block_mask race (KeyError: 'custom')
  other  any other non-zero exit
  hang   no exit within --timeout (killed; a hang is a failure)
  clean  exit 0 after --steps steps

  python benchmarks/gpu_race.py --modes none,lock,patch --trials 20 --parallel 6 --out benchmarks/results/race.md
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import versions  # noqa: E402
FX = "Detected that you are using FX to symbolically trace"


def trial(mode: str, index: int, args) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"race-{mode}-{index}-") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton",
                   PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "trainer", "--config", args.config, "--output-dir", f"{tmp}/out",
                "--max-steps", str(args.steps), "--compile-lock", mode, "--attention", "flex",
                "--target-devices", args.device, "--drafter-devices", ",".join([args.device] * args.threads),
                "--metrics-file", f"{tmp}/metrics.jsonl"] + args.extra
        started = time.monotonic()
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return "hang", time.monotonic() - started, out[-2000:]
        seconds = time.monotonic() - started
        text = done.stdout + done.stderr
        if FX in text:
            return "fx", seconds, text[-3000:]
        if "KeyError: 'custom'" in text:
            return "mask", seconds, text[-3000:]
        if done.returncode != 0:
            return "other", seconds, text[-3000:]
        return "clean", seconds, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,lock,patch")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--trials-none", type=int, default=None, help="trials for mode none (default --trials)")
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=4, help="trials run side by side (each is its own process)")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--label", default="", help="a name for this row group in the results")
    parser.add_argument("--out", default=None, help="append a markdown table here")
    parser.add_argument("extra", nargs="*", help="more trainer arguments (after --)")
    args = parser.parse_args()

    rows = []
    for mode in args.modes.split(","):
        k = args.trials_none if (mode == "none" and args.trials_none) else args.trials
        counts = {"fx": 0, "mask": 0, "other": 0, "hang": 0, "clean": 0}
        times, sample = [], ""
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            for outcome, seconds, tail in pool.map(lambda i: trial(mode, i, args), range(k)):
                counts[outcome] += 1
                times.append(seconds)
                if outcome != "clean" and not sample:
                    sample = tail.strip().splitlines()[-1] if tail.strip() else outcome
        times.sort()
        rows.append((mode, k, counts, times[len(times) // 2], sample))
        print(f"{args.label} {mode:6} trials={k} fx={counts['fx']} mask={counts['mask']} other={counts['other']} "
              f"hang={counts['hang']} clean={counts['clean']} median_s={times[len(times) // 2]:.1f} {sample[:160]}",
              flush=True)
    if args.out:
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        lines = [f"\n### {args.label or 'race'} — {datetime.date.today()}\n", f"`{command}`\n", ", ".join(f"{k} {v}" for k, v in versions(args.device).items()) + "\n",
                 "| mode | trials | FX error | mask KeyError | other error | hang | clean | median trial s | first failure |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for mode, k, c, median, sample in rows:
            lines.append(f"| {mode} | {k} | {c['fx']} | {c['mask']} | {c['other']} | {c['hang']} | {c['clean']} | "
                         f"{median:.1f} | {sample[:120].replace('|', '/')} |")
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
