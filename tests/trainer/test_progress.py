"""Progress as people read it (trainer/progress.py): durations, the bar, and a progress line whose rate
counts only this process's work."""

from __future__ import annotations

import io
import re

import pytest

from trainer.progress import ProgressLine, format_duration, progress_bar


def seconds_of(text: str) -> int:
    match = re.fullmatch(r"(?:(\d+)h)?(\d+)m(\d\d)s", text)
    assert match, text
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    assert minutes < 60 or not match.group(1), "minutes roll over into hours"
    return 3600 * hours + 60 * minutes + seconds


@pytest.mark.parametrize("value", [0, 0.4, 0.6, 59.5, 60, 61, 3599, 3599.6, 3600, 3661, 86400 * 3 + 7, 1e6])
def test_a_duration_reads_back_as_the_rounded_seconds(value):
    assert seconds_of(format_duration(value)) == round(value)


def test_durations_under_an_hour_have_no_hours_and_negative_ones_are_zero():
    assert format_duration(59 * 60 + 59) == "59m59s" and format_duration(3600) == "1h00m00s"
    assert format_duration(-5) == "0m00s"


@pytest.mark.parametrize("total", [1, 3, 7, 24, 1000])
def test_the_bar_fills_monotonically_to_its_width(total):
    bars = [progress_bar(step, total) for step in range(total + 1)]
    assert all(len(bar) == 26 and bar[0] == "[" and bar[-1] == "]" for bar in bars)
    filled = [bar.count("#") for bar in bars]
    assert filled[0] == 0 and filled[-1] == 24 and filled == sorted(filled)
    assert progress_bar(0, 0, width=5) == "[.....]", "no total: an empty bar, no division by zero"


def test_no_work_done_yet_has_no_eta(clock):
    line = ProgressLine("shards", 10, done=4, out=io.StringIO(), tty=False, clock=clock)
    clock.now += 50
    assert line.rate() == 0 and line.line() == "shards 4/10  0.00/s  ETA ?"


def test_off_a_tty_a_line_waits_for_its_interval_except_the_last(clock):
    out = io.StringIO()
    line = ProgressLine("rows", 6, out=out, tty=False, every_s=10, clock=clock)
    for done in range(1, 7):
        clock.now += 3
        line.update(done, extra="ok")
    line.finish()  # off a TTY: nothing to end
    assert out.getvalue().splitlines() == [
        "rows 4/6  0.33/s  ETA 0m06s  ok",  # 12 s after the start
        "rows 6/6  0.33/s  ETA 0m00s  ok",  # the last, 6 s later
    ]


def test_a_said_line_takes_the_bars_place_on_a_tty_and_is_plain_elsewhere():
    tty, plain = io.StringIO(), io.StringIO()
    ProgressLine("rows", 3, out=tty, tty=True).say("resumed at 2")
    ProgressLine("rows", 3, out=plain, tty=False).say("resumed at 2")
    assert tty.getvalue() == "\r\x1b[2Kresumed at 2\n" and plain.getvalue() == "resumed at 2\n"


def test_tty_is_asked_of_the_stream_when_not_given():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert ProgressLine("x", 1, out=Terminal()).tty and not ProgressLine("x", 1, out=io.StringIO()).tty
