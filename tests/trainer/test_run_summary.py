"""A run's history from its metrics records (trainer/run_summary.py): launches as segments, markers where
a launch resumed, stopped, failed or vanished, and every malformed value left out rather than trusted."""

from __future__ import annotations

import math

import pytest

from trainer import metrics_format
from trainer.run_summary import Marker, history, history_from_lines, segments


def start(t: float) -> dict:
    return {"event": "start", "time": t, "total_steps": 10}


def step(n: int, t: float, **extra) -> dict:
    return {"event": "step", "step": n, "time": t, "loss": 5.0 - n / 10, "total_steps": 10, **extra}


def done(n: int, t: float, reason: str = "max_steps") -> dict:
    return {"event": "done", "step": n, "time": t, "reason": reason}


def test_each_start_begins_a_segment_and_records_before_the_first_start_are_their_own():
    records = [step(1, 1.0), start(2.0), step(2, 3.0), start(4.0), start(5.0), step(3, 6.0)]
    assert segments(records) == [[records[0]], records[1:3], [records[3]], records[4:]]
    assert segments([]) == []


def test_a_resumed_run_is_one_series_with_a_relaunch_marker_and_wall_time_per_launch():
    first = [start(100.0), step(1, 110.0), step(2, 120.0), step(3, 130.0)]
    second = [start(1000.0), step(4, 1010.0), step(5, 1030.0), done(5, 1040.0)]
    run = history("0007", [first + second])
    assert run.steps == (1, 2, 3, 4, 5) and run.last_step == 5
    assert run.loss == pytest.approx((4.9, 4.8, 4.7, 4.6, 4.5))
    assert run.launches == 2 and run.finished and run.total_steps == 10
    assert run.wall_s == pytest.approx(30.0 + 40.0), "the gap between launches is not run time"
    assert run.markers == (
        Marker(3, "ended", "launch ended at step 3 without a last record"),
        Marker(3, "relaunch", "relaunch: resumed after step 3"),
    )
    apart = history("0007", [first, second])
    assert repr(apart) == repr(run), "launches given apart or in one list read the same (nan != nan: repr)"


def test_stop_and_error_markers_and_a_run_that_did_not_finish():
    records = [start(0.0), step(1, 1.0), step(2, 2.0), {"event": "error", "kind": "cuda_oom", "time": 3.0}]
    records += [start(10.0), step(3, 11.0), done(3, 12.0, reason="interrupted")]
    run = history("r", [records])
    assert not run.finished
    assert [(m.step, m.kind) for m in run.markers] == [(2, "error"), (2, "relaunch"), (3, "stop")]
    assert run.markers[0].text == "error at step 2: cuda_oom"
    assert run.markers[2].text == "stopped at step 3 (interrupted)"


def test_expected_tau_per_step_is_one_plus_the_running_products_of_accuracy():
    acc = [0.9, 0.5, 0.2]
    run = history("r", [[start(0.0), step(1, 1.0, acc=acc), step(2, 2.0)]])
    assert run.tau_expected[0] == pytest.approx(1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2)
    assert math.isnan(run.tau_expected[1]), "a step without accuracy has no expected tau"


@pytest.mark.parametrize(
    "bad",
    [
        {"loss": "1.0"},
        {"loss": True},
        {"loss": None},
        {"step": 2.0},
        {"step": "2"},
        {"step": False},
    ],
)
def test_a_step_record_with_a_malformed_step_or_loss_is_left_out(bad):
    run = history("r", [[start(0.0), step(1, 1.0), {**step(2, 2.0), **bad}, step(3, 3.0)]])
    assert run.steps == (1, 3)


def test_malformed_side_values_become_gaps_not_numbers():
    records = [
        start(0.0),
        step(1, 1.0, acc=[0.5, "x"], tokens_per_s="fast"),
        step(2, 2.0, acc=[True], tokens_per_s=800),
        {"event": "eval", "step": 2, "tau": "3", "time": 2.5},
        {"event": "eval", "step": 2.5, "tau": 3.0},
        {"event": "eval", "step": 2, "tau": 2.5, "acceptance": "high", "tau_per_prompt_mean": 2.4},
        "not a record",
        {"event": "step", "time": "soon"},
    ]
    run = history("r", [records])
    assert run.steps == (1, 2)
    assert all(math.isnan(t) for t in run.tau_expected), "accuracies with a non-number are no accuracies"
    assert math.isnan(run.tokens_per_s[0]) and run.tokens_per_s[1] == 800.0
    assert [(e.step, e.tau, e.acceptance, e.tau_per_prompt_mean) for e in run.evals] == [(2, 2.5, (), 2.4)]


def test_best_eval_skips_non_finite_taus_and_gpu_memory_is_all_or_nothing():
    records = [start(0.0), step(1, 1.0, gpu_memory_gib=3.5), step(2, 2.0, gpu_memory_gib=3.75)]
    records += [{"event": "eval", "step": s, "tau": t} for s, t in ((1, 2.0), (2, float("nan")), (2, 1.5))]
    run = history("r", [records])
    assert run.best_eval.step == 1 and run.best_eval.tau == 2.0
    assert run.gpu_memory_gib == (3.5, 3.75)
    partial = history("r", [records + [start(5.0), step(3, 6.0)]])
    assert partial.gpu_memory_gib == (), "memory from only some launches is not one series"
    assert history("r", [[start(0.0)]]).best_eval is None


def test_summary_line_and_row():
    records = [start(0.0), step(1, 1.0), {"event": "eval", "step": 1, "tau": 2.34567}, step(2, 3725.0)]
    run = history("0003", [records])
    assert run.summary_row() == {
        "run": "0003",
        "best_tau": 2.346,
        "best_tau_step": 1,
        "steps": 2,
        "total_steps": 10,
        "finished": False,
        "wall_s": 3725.0,
        "launches": 1,
    }
    assert run.summary_line() == "0003: 2/10 steps, best τ 2.346 (step 1), 1h02m05s, 1 launch"
    unknown_total = [{**step(n, float(n)), "total_steps": None} for n in (1, 2)]
    two = history("0004", [[start(0.0), *unknown_total, start(3.0), done(2, 4.0)]])
    assert two.summary_line() == "0004: 2 steps, no eval yet, 0m03s, 2 launches, finished"


def test_history_from_lines_drops_foreign_and_partial_lines():
    good = [metrics_format.encode(**r) for r in (start(0.0), step(1, 1.0), step(2, 2.0))]
    lines = ["Welcome to the box", good[0], good[1][:25], good[1], "", good[2], '{"event": "nope"}']
    run = history_from_lines("r", [lines])
    assert run.steps == (1, 2) and run.launches == 1


def test_times_a_float_range_apart_give_an_unknown_wall_time_not_an_overflow():
    """`dflash-train report` of a file whose times span -1e308..1e308 died in format_duration (int(inf))."""
    run = history("0001", [[start(-1e308), step(1, 1e308)]])
    assert math.isinf(run.wall_s)
    assert run.summary_line() == "0001: 1/10 steps, no eval yet, ?, 1 launch"
