#!/usr/bin/env python3
"""Race regression harness: fresh-process trials of the REAL trainer, per compile-lock mode and
activation-checkpointing setting.

Each trial runs `python -m trainer` with a fresh, empty inductor and triton cache, one target
worker and N drafter threads on one GPU that start their first compiled flex_attention
forward+backward together. The default drafter (5 layers, head_dim 64, intermediate 512) is a
size where the unprotected start fails: with the 1-layer tiny drafter the compiles are too short
to overlap and even the unprotected start comes out clean.

Every trial runs under `timeout -k KILL_AFTER TIMEOUT`: at TIMEOUT its process group gets SIGTERM
(the trainer, with run.stop_grace_s = --stop-grace, must then exit by itself even with a thread
stuck in a compile), KILL_AFTER seconds later SIGKILL. A trial is counted as:
  fx     the FX-tracing race error (trainer.metrics_format.FX_TRACING_ERROR)
  mask   the create_block_mask race (KeyError: 'custom')
  other  any other non-zero exit
  hang   no exit within --timeout (a failure); split into "left on SIGTERM" / "ended by its stop
         watchdog" (its Python code could not run; trainer.train.stop_watchdog) / "needed SIGKILL"
  clean  exit 0 after --steps steps
Trials of all (mode, checkpointing) cells share one pool of --parallel slots; trials that have
not started when --budget seconds are up are reported as skipped.

  python benchmarks/gpu_race.py --modes none,lock --checkpointing none,layers --trials-none 8 \\
      --trials 20 --parallel 8 --out benchmarks/results/race-checkpointing.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import doc_parser, versions  # noqa: E402
from trainer.metrics_format import FX_TRACING_ERROR  # noqa: E402

OUTCOMES = ("fx", "mask", "other", "hang", "clean")
TIMEOUT_RC = 124  # `timeout`: the command timed out and left on SIGTERM
KILLED_RC = 137  # `timeout`: ... and needed the SIGKILL
# After -k expires, GNU `timeout` SIGKILLs its whole process group, itself included: the trial's
# process then reports death by SIGKILL rather than timeout's own 137.
KILLED_GROUP_RC = -9
HANG_EXITS = {TIMEOUT_RC: "SIGTERM", KILLED_RC: "SIGKILL", KILLED_GROUP_RC: "SIGKILL"}
WATCHDOG_LINE = "dflash-train watchdog:"  # the trainer's stop watchdog SIGKILLed it (137 as well)


def hang_exit_of(returncode: int, text: str) -> str | None:
    """How a hung trial ended: "SIGTERM" (by itself), "watchdog" (its stop watchdog), "SIGKILL" (by
    `timeout`)."""
    how = HANG_EXITS.get(returncode)
    return "watchdog" if how and WATCHDOG_LINE in text else how


def trainer_argv(mode: str, checkpointing: str, tmp: str, args) -> list[str]:
    sizes = [
        "--set",
        f"drafter.num_layers={args.layers}",
        "--set",
        f"drafter.head_dim={args.head_dim}",
        "--set",
        f"drafter.intermediate_size={args.intermediate}",
    ]
    return [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        args.config,
        "--output-dir",
        f"{tmp}/out",
        "--max-steps",
        str(args.steps),
        "--compile-lock",
        mode,
        "--attention",
        args.attention,
        "--target-devices",
        args.device,
        "--drafter-devices",
        ",".join([args.device] * args.threads),
        "--metrics-file",
        f"{tmp}/metrics.jsonl",
        *sizes,
        "--set",
        f"train.activation_checkpointing={checkpointing}",
        "--set",
        f"run.stop_grace_s={args.stop_grace}",
    ] + args.extra


def classify(returncode: int, text: str) -> str:
    if returncode in HANG_EXITS:
        return "hang"
    if FX_TRACING_ERROR in text:
        return "fx"
    if "KeyError: 'custom'" in text:
        return "mask"
    return "clean" if returncode == 0 else "other"


def trial(mode: str, checkpointing: str, index: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"race-{mode}-{checkpointing}-{index}-") as tmp:
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
            TRITON_CACHE_DIR=f"{tmp}/triton",
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
        )
        argv = [
            "timeout",
            "-k",
            str(args.kill_after),
            str(args.timeout),
            *trainer_argv(mode, checkpointing, tmp, args),
        ]
        started = time.monotonic()
        # The whole trial gets its own session; after `timeout` is done nothing of it may survive.
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            text, _ = proc.communicate(timeout=args.timeout + args.kill_after + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            text, _ = proc.communicate()
        seconds = time.monotonic() - started
    outcome = classify(proc.returncode, text)
    if outcome == "clean" and f"activation checkpointing: {checkpointing}" not in text:
        outcome = "other"  # the setting did not reach the trainer: the trial measured something else
    lines = [line for line in text.strip().splitlines() if line.strip()]
    hang_exit = hang_exit_of(proc.returncode, text)
    return {
        "mode": mode,
        "checkpointing": checkpointing,
        "trial": index,
        "outcome": outcome,
        "seconds": round(seconds, 1),
        "rc": proc.returncode,
        "hang_exit": hang_exit,
        # from the trainer's compile log lines (trainer.compile_lock.compile_reason)
        "recompute_compiles": text.count("in checkpoint recompute"),
        "unexclusive_compiles": text.count("NOT exclusive"),
        "last_line": lines[-1][:300] if lines and outcome != "clean" else "",
    }


def cells(args) -> list[tuple[str, str, int]]:
    """(mode, checkpointing, trials); unprotected first so their hangs overlap the lock trials."""
    modes = sorted(args.modes.split(","), key=lambda m: m != "none")
    return [
        (mode, ckpt, args.trials_none if (mode == "none" and args.trials_none) else args.trials)
        for mode in modes
        for ckpt in args.checkpointing.split(",")
    ]


def summarise(rows: list[dict], plan: list[tuple[str, str, int]]) -> list[dict]:
    table = []
    for mode, ckpt, planned in plan:
        mine = [r for r in rows if r["mode"] == mode and r["checkpointing"] == ckpt]
        counts = {o: sum(r["outcome"] == o for r in mine) for o in OUTCOMES}
        times = sorted(r["seconds"] for r in mine)
        first = next((r["last_line"] for r in mine if r["outcome"] != "clean"), "")
        table.append(
            {
                "mode": mode,
                "checkpointing": ckpt,
                "planned": planned,
                "trials": len(mine),
                **counts,
                "hang_sigterm": sum(r["hang_exit"] == "SIGTERM" for r in mine),
                "hang_watchdog": sum(r["hang_exit"] == "watchdog" for r in mine),
                "hang_sigkill": sum(r["hang_exit"] == "SIGKILL" for r in mine),
                "recompute_compiles": sum(r["recompute_compiles"] for r in mine),
                "unexclusive_compiles": sum(r["unexclusive_compiles"] for r in mine),
                "median_s": times[len(times) // 2] if times else None,
                "first_failure": first,
            }
        )
    return table


def render(table: list[dict], args, command: str) -> str:
    lines = [
        f"\n### {args.label or 'race'} — {datetime.date.today()}\n",
        f"`{command}`\n",
        ", ".join(f"{k} {v}" for k, v in versions(args.device).items()) + "\n",
        f"Drafter: {args.layers} layers, head_dim {args.head_dim}, intermediate {args.intermediate} "
        f"(config {args.config}); {args.threads} drafter threads + 1 target worker on {args.device}; "
        f"{args.steps} steps; fresh caches per trial; hang = no exit within {args.timeout:g} s "
        f"(then SIGTERM; SIGKILL {args.kill_after:g} s later; trainer stop grace {args.stop_grace:g} s).\n",
        "| mode | checkpointing | trials | FX errors | mask KeyErrors | other errors | "
        "hangs (left on SIGTERM / ended by its watchdog / needed SIGKILL) | clean | median trial s | "
        "compiles in recompute / not exclusive | first failure |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        skipped = f" ({t['planned'] - t['trials']} skipped: budget)" if t["trials"] < t["planned"] else ""
        median = f"{t['median_s']:.1f}" if t["median_s"] is not None else "n/a"
        lines.append(
            f"| {t['mode']} | {t['checkpointing']} | {t['trials']}{skipped} | {t['fx']} | {t['mask']} | "
            f"{t['other']} | {t['hang']} ({t['hang_sigterm']} / {t['hang_watchdog']} / "
            f"{t['hang_sigkill']}) | {t['clean']} | "
            f"{median} | {t['recompute_compiles']} / {t['unexclusive_compiles']} | "
            f"{t['first_failure'][:120].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__)
    parser.add_argument("--modes", default="none,lock")
    parser.add_argument(
        "--checkpointing", default="none,layers", help="train.activation_checkpointing values"
    )
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--trials-none", type=int, default=8, help="trials for mode none (0: --trials)")
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=5, help="drafter.num_layers")
    parser.add_argument("--head-dim", type=int, default=64, help="drafter.head_dim")
    parser.add_argument("--intermediate", type=int, default=512, help="drafter.intermediate_size")
    parser.add_argument(
        "--parallel", type=int, default=8, help="trials run side by side (each is its own process)"
    )
    parser.add_argument("--timeout", type=float, default=150, help="seconds; then SIGTERM (a hang)")
    parser.add_argument("--kill-after", type=float, default=20, help="seconds after the SIGTERM: SIGKILL")
    parser.add_argument("--stop-grace", type=float, default=10, help="the trainer's run.stop_grace_s")
    parser.add_argument(
        "--budget", type=float, default=480, help="seconds; trials not started by then are skipped"
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--attention", default="flex")
    parser.add_argument("--config", default="tiny-cpu")
    parser.add_argument("--label", default="", help="a name for this table in the results")
    parser.add_argument("--out", default=None, help="append a markdown table here")
    parser.add_argument("extra", nargs="*", help="more trainer arguments (after --)")
    return parser


def _run_trials(args, plan: list, jobs: list) -> list[dict]:
    """The trials, --parallel at a time, each one's row printed (and appended to the .trials.jsonl
    beside --out) as it ends: a run cut short by the budget still leaves its evidence."""
    began = time.monotonic()
    rows: list[dict] = []
    lock = threading.Lock()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def run(job):
        mode, ckpt, index = job
        if time.monotonic() - began > args.budget:
            return None
        row = trial(mode, ckpt, index, args)
        with lock:
            rows.append(row)
            if args.out:
                with open(os.path.splitext(args.out)[0] + ".trials.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(
                f"  [{time.monotonic() - began:5.0f}s] {mode:5} ckpt={ckpt:6} #{index}: {row['outcome']:5} "
                f"{row['seconds']:6.1f}s rc={row['rc']} {row['last_line'][:140]}",
                flush=True,
            )
        return row

    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run, jobs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.trials, args.threads, args.steps, args.parallel) < 1:
        parser.error("--trials, --threads, --steps and --parallel must be >= 1")

    plan = cells(args)
    jobs = [(mode, ckpt, i) for mode, ckpt, k in plan for i in range(k)]
    # one slot per cell in turn, so a cut by the budget leaves every cell some trials
    jobs.sort(key=lambda job: (job[2], [c[:2] for c in plan].index(job[:2])))
    print(
        f"race: {len(jobs)} trials {[(m, c, k) for m, c, k in plan]} on {args.device}, "
        f"{args.parallel} at a time, "
        f"budget {args.budget:g} s",
        flush=True,
    )
    table = summarise(_run_trials(args, plan, jobs), plan)
    for t in table:
        print(
            f"{args.label} {t['mode']:5} ckpt={t['checkpointing']:6} trials={t['trials']}/{t['planned']} "
            f"fx={t['fx']} "
            f"mask={t['mask']} other={t['other']} hang={t['hang']} (sigterm {t['hang_sigterm']}, watchdog "
            f"{t['hang_watchdog']}, sigkill {t['hang_sigkill']}) clean={t['clean']}",
            flush=True,
        )
    if args.out:
        command = "python " + shlex.join(
            ["benchmarks/gpu_race.py", *(sys.argv[1:] if argv is None else argv)]
        )
        with open(args.out, "a") as f:
            f.write(render(table, args, command))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
