"""`dflash-train report METRICS.jsonl [-o report.png|report.html]`: the picture of a run on disk.

Exit codes: 0 written; 2 no such file, no step record in it yet, or matplotlib missing.
"""

from __future__ import annotations

import argparse
import os
import sys

REPORT_HELP = """\
Draw a run from its metrics file: loss, tau measured and expected from accuracy, acceptance per
block position (latest eval against earliest), tokens/s with relaunch and stop markers.

  dflash-train report runs/tiny/metrics.jsonl -o tiny.png
  dflash-train report runs/tiny/metrics.jsonl -o tiny.html    (PNG embedded, a summary table)
"""


def report_parser() -> argparse.ArgumentParser:
    from trainer.cli.options import command_parser

    p = command_parser("dflash-train report", REPORT_HELP)
    p.add_argument("metrics", metavar="METRICS.jsonl", help="a metrics file (the trainer's --metrics-file)")
    p.add_argument(
        "-o",
        "--out",
        default="report.png",
        metavar="FILE",
        help="report.png (default) or a .html file embedding it",
    )
    return p


def run_report(args: argparse.Namespace) -> int:
    from trainer import metrics_history, report_plot, run_summary

    def fail(message: str) -> int:
        print(f"dflash-train report: {message}", file=sys.stderr)
        return 2

    try:
        report_plot.format_of(args.out)
    except report_plot.UnknownFormat as exc:
        return fail(f"-o {exc}")
    if not os.path.isfile(args.metrics):
        return fail(
            f"{args.metrics}: no such file. Fix: give the run's metrics file "
            "(default <output-dir>/metrics.jsonl)"
        )
    try:
        read = metrics_history.read_thinned(args.metrics)
    except OSError as exc:
        return fail(f"cannot read {args.metrics}: {exc.strerror}")
    path = os.path.abspath(args.metrics)
    # <output-dir>/metrics.jsonl is named by its run dir; any other file by its own name
    name = os.path.basename(path).removesuffix(".jsonl").removesuffix(".metrics")
    if os.path.basename(path) == "metrics.jsonl":
        name = os.path.basename(os.path.dirname(path))
    history = run_summary.history_from_lines(name, [read["lines"]])
    try:
        report_plot.write([history], args.out, title=f"DFlash run {name}")
    except report_plot.NoMetrics:
        return fail(f"{args.metrics}: no step record yet; nothing to draw")
    except ImportError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {args.out}: {exc.strerror}")
    print(f"dflash-train report: {history.summary_line()} -> {args.out}")
    return 0
