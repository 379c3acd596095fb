"""A metrics file thinned to a bounded picture (trainer/metrics_history.py): the start record, the newest
other records, evenly spaced steps and always the last one, in file order; and a file too large to
read whole is read from its first line and its tail only."""

from __future__ import annotations

import json

import pytest

from trainer import metrics_format, metrics_history
from trainer.metrics_history import MAX_OTHER, Thinned, read_thinned


def step_line(step: int) -> str:
    return metrics_format.encode("step", time=float(step), step=step, total_steps=10**6, loss=1.0).rstrip(
        "\n"
    )


def eval_line(step: int) -> str:
    return metrics_format.encode("eval", time=float(step), step=step, tau=2.0).rstrip("\n")


def start_line() -> str:
    return metrics_format.encode("start", time=0.0, config={}, devices=[], total_steps=10**6, pid=1).rstrip(
        "\n"
    )


def thinned(max_steps: int, lines: list[str]) -> list[str]:
    """What a Thinned fed `lines` (as the bytes read_thinned feeds it) keeps, as text."""
    kept = Thinned(max_steps)
    for line in lines:
        kept.add(line.encode())
    return [line.decode() for line in kept.lines()]


def kept_steps(lines: list[str]) -> list[int]:
    return [r["step"] for r in metrics_format.parse_lines("\n".join(lines)) if r["event"] == "step"]


@pytest.mark.parametrize("count,max_steps", [(1, 3), (7, 3), (8, 4), (9, 4), (1000, 10), (4097, 16)])
def test_steps_are_evenly_spaced_bounded_and_end_with_the_last(count, max_steps):
    lines = thinned(max_steps, [start_line()] + [step_line(step) for step in range(1, count + 1)])
    assert lines[0] == start_line()
    steps = kept_steps(lines)
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == count
    assert len(steps) <= 2 * max_steps + 1
    if count >= max_steps:
        assert len(steps) >= min(count, max_steps), "thinning keeps at least max_steps points"
    body = steps[:-1]  # the last step is kept whether or not it falls on the stride
    gaps = {b - a for a, b in zip(body, body[1:])}
    assert len(gaps) <= 1, f"steps not evenly spaced: {sorted(gaps)}"
    if gaps:
        (gap,) = gaps
        assert gap & (gap - 1) == 0, "the stride doubles"
        assert 0 < steps[-1] - steps[-2] <= gap


def test_other_records_keep_the_newest_and_everything_stays_in_file_order():
    written = [line for step in range(1, MAX_OTHER + 101) for line in (step_line(step), eval_line(step))]
    lines = thinned(4, [start_line()] + written)
    evals = [r["step"] for r in metrics_format.parse_lines("\n".join(lines)) if r["event"] == "eval"]
    assert evals == list(range(101, MAX_OTHER + 101)), "the newest MAX_OTHER non-step records"
    positions = [written.index(line) for line in lines[1:]]
    assert positions == sorted(positions)


def test_the_first_line_is_kept_whatever_it_is_and_only_once():
    # a file whose first record is a step (a truncated start)
    assert thinned(2, [step_line(1), step_line(2)]) == [step_line(1), step_line(2)]
    assert Thinned(2).lines() == []
    assert Thinned(0).max_steps == 1, "a bound below one is one"


def write(path, lines: list[str], tail: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + tail)


def test_read_thinned_reports_the_file_and_skips_blank_and_overlong_lines(tmp_path):
    path = tmp_path / "run.metrics.jsonl"
    long = json.dumps({"event": "eval", "pad": "x" * metrics_history.MAX_LINE_BYTES})
    write(path, [start_line(), "", step_line(1), long, "   ", step_line(2)])
    read = read_thinned(str(path))
    assert read["lines"] == [start_line(), step_line(1), step_line(2)]
    assert read["path"] == str(path) and read["size"] == path.stat().st_size and read["scanned_from"] == 0
    assert read["mtime"] == path.stat().st_mtime


def test_a_line_still_being_written_comes_back_and_parses_as_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    write(path, [start_line(), step_line(1)], tail=step_line(2)[:20])
    read = read_thinned(str(path))
    assert read["lines"][-1] == step_line(2)[:20]
    assert kept_steps(read["lines"]) == [1]


def test_an_empty_file_and_a_first_line_without_its_end(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert read_thinned(str(empty))["lines"] == []
    partial = tmp_path / "partial.jsonl"
    partial.write_text(start_line()[:30])
    assert read_thinned(str(partial))["lines"] == [], "a start record still being written is not kept"


def test_a_large_file_is_read_from_its_first_line_and_its_tail(tmp_path):
    path = tmp_path / "big.jsonl"
    write(path, [start_line()] + [step_line(step) for step in range(1, 2001)])
    limit = 10_000
    read = read_thinned(str(path), max_steps=10_000, max_scan_bytes=limit)
    size = path.stat().st_size
    assert read["scanned_from"] == size - limit
    assert read["lines"][0] == start_line()
    steps = kept_steps(read["lines"])
    assert steps == list(range(steps[0], 2001)), "every whole line of the tail, the cut one dropped"
    assert all(line in (start_line(), *map(step_line, steps)) for line in read["lines"])
    tail_bytes = sum(len(step_line(s)) + 1 for s in steps)
    assert limit - len(step_line(2000)) - 1 < tail_bytes <= limit
    whole = read_thinned(str(path), max_steps=10_000, max_scan_bytes=size)
    assert whole["scanned_from"] == 0 and kept_steps(whole["lines"]) == list(range(1, 2001))
