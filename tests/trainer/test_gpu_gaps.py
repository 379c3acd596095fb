"""benchmarks/gpu_gaps.py on a trace whose idle stretches and their causes are known."""

from __future__ import annotations

import json

from benchmarks import gpu_gaps


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "pid": 1, "args": {"correlation": corr}}  # fmt: skip


def _kernel(name, corr, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7, "pid": 0,
            "args": {"correlation": corr}}  # fmt: skip


def _trace():
    """Kernels a [0,10), b [10,20) back to back; c [50,60) launched at 45 inside Optimizer.step >
    aten::_fused_adamw_ (the host was late: 30 us idle); d [100,110) launched at 5, long before the
    device idled (a queued wait: 40 us); e [111,120) after a 1 us gap, under the threshold."""
    return [
        _op("ProfilerStep", 0, 200),
        _op("Optimizer.step", 40, 20),
        _op("aten::_fused_adamw_", 44, 10),
        _launch(1, 0),
        _launch(2, 1),
        _launch(3, 45),
        _launch(4, 5, tid=2),
        _launch(5, 6),
        _kernel("a", 1, 0, 10),
        _kernel("b", 2, 10, 10),
        _kernel("c", 3, 50, 10),
        _kernel("d", 4, 100, 10),
        _kernel("e", 5, 111, 9),
    ]


def test_each_idle_stretch_is_found_with_who_was_late_and_small_ones_are_left_out():
    gaps, totals = gpu_gaps.find_gaps(_trace(), min_gap_us=2)
    assert [(g.start_us, g.length_us, g.next_kernel) for g in gaps] == [(20, 30, "c"), (60, 40, "d")]
    assert gaps[0].cause == "ProfilerStep > Optimizer.step > aten::_fused_adamw_"
    assert gaps[1].cause == gpu_gaps.QUEUED
    assert totals == {"span_us": 120, "busy_us": 49, "idle_us": 71}


def test_overlapping_kernels_count_their_busy_time_once():
    events = [_kernel("a", 1, 0, 10), _kernel("b", 2, 5, 10), _launch(1, 0), _launch(2, 0)]
    _, totals = gpu_gaps.find_gaps(events)
    assert totals == {"span_us": 15, "busy_us": 15, "idle_us": 0}


def test_the_report_sums_idle_by_cause_per_step_and_reads_a_trace_file(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    text = gpu_gaps.report(gpu_gaps.load(str(path)), steps=2, top=5)
    assert "per step: span 0.06 ms, busy 0.02 ms, idle 0.04 ms (2 gaps" in text
    assert "| 0.015 | 1 | ProfilerStep > Optimizer.step > aten::_fused_adamw_ |" in text
    assert "| 0.020 | 1 | launched before the device went idle" in text
