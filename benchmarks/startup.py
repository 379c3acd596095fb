"""How fast the CLI answers: whole-process wall time, median of N runs each.

    python benchmarks/startup.py [--runs 7] [--bin DIR]

Measures, each as a fresh process:
  - `python3 -c "import click, yaml"` (the floor: the CLI's own two dependencies), against
    `dflash-ops --help` (goal: within 2.5x of that floor);
  - `dflash-ops status` on the embedded `local` target with no job (goal: median <= 0.5 s).

`--bin DIR` picks the `python` and `dflash-ops` of another environment (e.g. one with an older
checkout installed) so two versions are compared on the same machine in the same session. The
status run uses a throwaway HOME (so `local`'s workdir holds no job), a throwaway TMUX_TMPDIR and no
inventory file (it runs from an empty directory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def wall_times(argv: list[str], runs: int, env: dict, cwd: str) -> list[float]:
    times = []
    for _ in range(runs + 1):  # the first run only warms the page cache
        start = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument(
        "--bin", default=os.path.dirname(sys.executable), help="directory with python and dflash-ops"
    )
    args = parser.parse_args()
    python, cli = os.path.join(args.bin, "python"), os.path.join(args.bin, "dflash-ops")
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
        cases = [
            ("python3 -c 'import click, yaml'", [python, "-c", "import click, yaml"]),
            ("dflash-ops --help", [cli, "--help"]),
            ("dflash-ops status (local, no job)", [cli, "status"]),
        ]
        medians = {}
        print(f"{'command':36} {'median s':>9} {'min s':>7} {'max s':>7}  ({args.runs} runs, {args.bin})")
        for label, argv in cases:
            times = wall_times(argv, args.runs, env, cwd)
            medians[label] = statistics.median(times)
            print(f"{label:36} {medians[label]:9.3f} {min(times):7.3f} {max(times):7.3f}")
        ratio = medians["dflash-ops --help"] / medians["python3 -c 'import click, yaml'"]
        status_s = medians["dflash-ops status (local, no job)"]
        print(f"--help / import click, yaml: {ratio:.2f}x (goal <= 2.5x)")
        print(f"status on local, no job: {status_s:.3f} s (goal <= 0.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
