"""How fast the CLI answers: whole-process wall time, median of N runs each.

    python benchmarks/startup.py [--runs 7] [--bin DIR [--bin DIR2]]

Measures, each as a fresh process:
  - `python -c "import click, yaml"` (the floor: the CLI's own two dependencies), against
    `dflash-ops --help` (goal: within 2.5x of that floor);
  - `dflash-ops status` on the embedded `local` target with no job (goal: median <= 0.5 s).

`--bin DIR` picks the `python` and `dflash-ops` of an environment (default: the one running this
script). Given twice (e.g. an environment with an older checkout installed), the two are measured
in turns, run by run, so both see the same machine load. The status runs use a throwaway HOME (so
`local`'s workdir holds no job), a throwaway TMUX_TMPDIR and no inventory file (an empty directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

FLOOR, HELP, STATUS = (
    "python -c 'import click, yaml'",
    "dflash-ops --help",
    "dflash-ops status (local, no job)",
)


def wall_time(argv: list[str], env: dict, cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--bin", action="append", help="directory with python and dflash-ops (repeatable)")
    args = parser.parse_args()
    bins = [os.path.abspath(b) for b in args.bin or [os.path.dirname(sys.executable)]]
    cases = {
        b: {
            FLOOR: [os.path.join(b, "python"), "-c", "import click, yaml"],
            HELP: [os.path.join(b, "dflash-ops"), "--help"],
            STATUS: [os.path.join(b, "dflash-ops"), "status"],
        }
        for b in bins
    }
    with tempfile.TemporaryDirectory(prefix="dflash-startup-") as tmp:
        home, tmux_dir, cwd = (os.path.join(tmp, d) for d in ("home", "tmux", "cwd"))
        for d in (home, tmux_dir, cwd):
            os.makedirs(d)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "TMUX_TMPDIR": tmux_dir,
            "LANG": "C.UTF-8",
        }
        times: dict = {b: {label: [] for label in cases[b]} for b in bins}
        for run in range(args.runs + 1):  # run 0 only warms the page cache
            for label in (FLOOR, HELP, STATUS):
                for b in bins:
                    seconds = wall_time(cases[b][label], env, cwd)
                    if run:
                        times[b][label].append(seconds)
    for b in bins:
        print(f"{b}  ({args.runs} runs each, whole process)")
        print(f"  {'command':36} {'median s':>9} {'min s':>7} {'max s':>7}")
        medians = {}
        for label, values in times[b].items():
            medians[label] = statistics.median(values)
            print(f"  {label:36} {medians[label]:9.3f} {min(values):7.3f} {max(values):7.3f}")
        print(f"  --help / import click, yaml: {medians[HELP] / medians[FLOOR]:.2f}x (goal <= 2.5x)")
        print(f"  status on local, no job: {medians[STATUS]:.3f} s (goal <= 0.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
