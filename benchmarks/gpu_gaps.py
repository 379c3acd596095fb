"""Where a GPU waits: the idle time between kernels in a torch profiler chrome trace, and who was late.

    python3 benchmarks/gpu_gaps.py TRACE.json [--min-gap-us 2] [--top 15]

Each idle stretch on the device ends with a kernel (or copy). Its launch call on the host says why:
launched after the device went idle, the host was late, and the CPU ops around that launch name what
it was doing; launched before, the kernel waited on something else (a stream, an event, a copy).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import sys

from benchmarks.common import doc_parser

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
QUEUED = "launched before the device went idle (a wait on a stream, event or copy)"


@dataclasses.dataclass
class Gap:
    start_us: float
    length_us: float
    next_kernel: str
    cause: str  # the host ops around the late launch, outermost first, or QUEUED


class HostOps:
    """The CPU ops of a trace by thread: which ones were running at a given moment."""

    def __init__(self, events: list[dict]):
        by_thread: dict = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in e:
                by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        self.ops = {tid: sorted(ops) for tid, ops in by_thread.items()}
        self.starts = {tid: [op[0] for op in ops] for tid, ops in self.ops.items()}

    def around(self, tid, ts: float) -> list[str]:
        """Names of the ops on thread `tid` running at `ts`, outermost first."""
        ops = self.ops.get(tid, [])
        last = bisect.bisect_right(self.starts.get(tid, []), ts)
        running = [op for op in ops[:last] if op[1] >= ts]
        return [name for _, _, name in sorted(running, key=lambda op: (op[0], -op[1]))]


def find_gaps(events: list[dict], min_gap_us: float = 2.0) -> tuple[list[Gap], dict]:
    """(gaps, totals): the device's idle stretches of at least `min_gap_us` between its first and
    last kernel, each with its cause; totals has the span, busy and idle microseconds."""
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e), key=lambda e: e["ts"]
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    host = HostOps(events)
    gaps, busy_until, busy = [], None, 0.0
    for e in device:
        end = e["ts"] + e["dur"]
        if busy_until is not None and e["ts"] - busy_until >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            cause = QUEUED
            if launch is not None and launch["ts"] > busy_until:
                cause = " > ".join(host.around(launch["tid"], launch["ts"])) or launch["name"]
            gaps.append(Gap(busy_until, e["ts"] - busy_until, e["name"], cause))
        start = e["ts"] if busy_until is None else max(e["ts"], busy_until)
        busy += max(0.0, end - start)
        busy_until = end if busy_until is None else max(busy_until, end)
    span = (busy_until - device[0]["ts"]) if device else 0.0
    return gaps, {"span_us": span, "busy_us": busy, "idle_us": span - busy}


def by_cause(gaps: list[Gap], depth: int = 3) -> list[tuple[str, float, int]]:
    """(cause cut to its `depth` outermost ops, idle us, gaps), largest idle first."""
    total: dict = collections.defaultdict(lambda: [0.0, 0])
    for gap in gaps:
        key = " > ".join(gap.cause.split(" > ")[:depth])
        total[key][0] += gap.length_us
        total[key][1] += 1
    return sorted(((k, v[0], v[1]) for k, v in total.items()), key=lambda row: -row[1])


def report(events: list[dict], steps: int = 1, min_gap_us: float = 2.0, top: int = 15) -> str:
    """A markdown summary: idle per step, idle by cause, the longest gaps."""
    gaps, totals = find_gaps(events, min_gap_us)
    per = 1e3 * steps
    lines = [
        f"Device time over {steps} step(s), per step: span {totals['span_us'] / per:.2f} ms, "
        f"busy {totals['busy_us'] / per:.2f} ms, idle {totals['idle_us'] / per:.2f} ms "
        f"({len(gaps)} gaps of >= {min_gap_us:g} us)",
        "",
        "| idle ms/step | gaps | the host was in |",
        "|---|---|---|",
    ]
    lines += [f"| {us / per:.3f} | {n} | {cause[:160]} |" for cause, us, n in by_cause(gaps)[:top]]
    lines += ["", "| longest gaps, us | next kernel | cause |", "|---|---|---|"]
    for gap in sorted(gaps, key=lambda g: -g.length_us)[:top]:
        lines.append(f"| {gap.length_us:.0f} | {gap.next_kernel[:60]} | {gap.cause[-200:]} |")
    return "\n".join(lines)


def load(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1, help="steps in the trace (numbers are per step)")
    parser.add_argument("--min-gap-us", type=float, default=2.0)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    print(report(load(args.trace), args.steps, args.min_gap_us, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
