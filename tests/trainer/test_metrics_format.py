"""The metrics contract (trainer/metrics_format.py): what a line encodes to, which lines parse, which
records are the newest trainer's, and the expected acceptance length against a brute-force count."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trainer import metrics_format as mf


def test_an_unknown_event_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError) as caught:
        mf.encode("stpe", step=1)
    assert "'stpe'" in str(caught.value) and all(event in str(caught.value) for event in mf.EVENTS)


def test_a_line_is_one_compact_json_object_with_version_event_and_time():
    line = mf.encode("step", time=12.5, step=3, loss=float("nan"), grad_norm=torch.tensor(2.5))
    assert line.endswith("\n") and line.count("\n") == 1 and ", " not in line
    record = mf.parse_line(line)
    assert {k: record[k] for k in ("v", "event", "time", "step", "grad_norm")} == {
        "v": mf.FORMAT_VERSION,
        "event": "step",
        "time": 12.5,
        "step": 3,
        "grad_norm": 2.5,
    }
    assert math.isnan(record["loss"]), "NaN survives the round trip"
    assert b'"event":"step"' in line.encode()  # what metrics_history looks for


def test_time_defaults_to_now(monkeypatch):
    monkeypatch.setattr(mf.time, "time", lambda: 1234.0)
    assert mf.parse_line(mf.encode("done", step=1, reason="max_steps"))["time"] == 1234.0


@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        '{"v":1,"event":"step","ti',
        "[1, 2]",
        '"step"',
        '{"event": "stepped"}',
        '{"v": 1}',
        "Welcome",
    ],
)
def test_blank_partial_and_foreign_lines_parse_as_nothing(line):
    assert mf.parse_line(line) is None


def test_parse_lines_keeps_the_records_in_order_and_last_of_finds_the_newest():
    text = (
        "".join(mf.encode("step", time=t, step=t) for t in (1, 2))
        + "noise\n"
        + mf.encode("eval", step=2, tau=2.0)
    )
    records = mf.parse_lines(text + mf.encode("step", time=3, step=3)[:-9])
    assert [(r["event"], r["step"]) for r in records] == [("step", 1), ("step", 2), ("eval", 2)]
    assert mf.last_of(records, "step")["step"] == 2 and mf.last_of(records, "done") is None


def records_with_starts(*times):
    """A file with a start at each time, each followed by one step."""
    text = "".join(
        mf.encode("start", time=t, pid=i) + mf.encode("step", time=t + 1, step=1) for i, t in enumerate(times)
    )
    return mf.parse_lines(text)


def test_current_run_is_the_newest_start_and_what_follows():
    records = records_with_starts(100.0, 200.0)
    assert mf.current_run(records) == records[2:]
    assert mf.current_run(records, launched_at=199.0) == records[2:]
    slack = 200.0 + mf.START_SLACK_S
    assert mf.current_run(records, launched_at=slack) == records[2:], (
        "a start within the slack is this launch's"
    )
    assert mf.current_run(records, launched_at=slack + 0.01) == [], "an older start is an earlier trainer's"


def test_current_run_without_a_start_or_with_a_start_without_a_time():
    steps = mf.parse_lines(mf.encode("step", time=5, step=1))
    assert mf.current_run(steps) == steps, "no launch time: a file without a start is all one run"
    assert mf.current_run(steps, launched_at=1.0) == [], "this launch has not started its trainer yet"
    broken = records_with_starts(100.0)
    broken[0]["time"] = "yesterday"
    assert mf.current_run(broken) == broken and mf.current_run(broken, launched_at=0.0) == []


@pytest.mark.parametrize(
    "log,metrics", [("logs/train-0007.log", "logs/train-0007.metrics.jsonl"), ("out", "out.metrics.jsonl")]
)
def test_the_metrics_file_sits_beside_the_log(log, metrics):
    assert mf.metrics_path_for_log(log) == metrics


def brute_force_tau(acc: list[float]) -> float:
    """E[tokens per target forward] over every right/wrong outcome of the drafts: the bonus token plus
    the drafts before the first wrong one, each outcome weighted by its probability."""
    total = 0.0
    for outcome in itertools.product([True, False], repeat=len(acc)):
        p = math.prod(a if right else 1 - a for a, right in zip(acc, outcome))
        leading = next((i for i, right in enumerate(outcome) if not right), len(acc))
        total += p * (1 + leading)
    return total


@pytest.mark.parametrize(
    "acc", [[], [1.0] * 7, [0.0, 1.0, 1.0], [0.9, 0.7, 0.5, 0.3], [0.5] * 10, [0.99, 0.2, 0.8]]
)
def test_expected_tau_is_the_mean_accepted_length_of_independent_drafts(acc):
    assert mf.expected_tau(acc) == pytest.approx(brute_force_tau(acc))
