"""What the run tells the world (trainer/train/metrics.py): rate and ETA, the readable step line, a bar
on a TTY that other lines never run into, and a run's last words for each way it can end."""

from __future__ import annotations

import io
import json
import threading

import pytest

from trainer import metrics_format
from trainer.train.metrics import MetricsWriter, Throughput, step_line
from trainer.train.workers import Failure, WorkerFailure

STEP = dict(loss=2.5, acc=[0.5, 0.25], tokens_per_s=1234.5, eta_s=65.0, lr=3e-4, grad_norm=0.75, epoch=0.5)


def test_throughput_is_per_interval_and_the_eta_uses_the_mean_step_since_the_start(clock):
    meter = Throughput(start_step=10, total_steps=20, clock=clock)  # a run resumed at step 10
    assert meter.step_s == float("inf"), "no step timed yet"
    clock.now += 4
    assert meter.update(11, tokens=800) == (200.0, 4.0 * 9)
    clock.now += 1
    rate, eta = meter.update(12, tokens=800)
    assert rate == 800.0 and eta == pytest.approx(2.5 * 8)
    assert meter.step_s == 1.0
    clock.now += 10
    assert meter.update(20, tokens=0)[1] == 0.0, "no steps left, no time left"
    assert meter.update(20, tokens=5)[0] == 5 / 1e-9, "no time passed: no division by zero"


def test_the_step_line_pads_the_step_to_the_totals_width():
    line = step_line(7, 1000, 2.5, [0.5, 0.25], 1234.5, 3725.0, 3e-4, 0.75)
    assert line == (
        "step    7/1000  loss 2.5000  acc@1 0.500  acc_avg 0.375  1,234 tok/s  lr 3.00e-04  gnorm 0.750  "
        "eta 1h02m05s"
    )
    assert "acc@1 nan  acc_avg nan" in step_line(1, 1, 1.0, [], 0.0, 0.0, 0.0, 0.0)


def writer(tmp_path, tty: bool, log_every: int = 1) -> tuple[MetricsWriter, io.StringIO]:
    out = io.StringIO()
    return MetricsWriter(str(tmp_path / "sub" / "m.jsonl"), out=out, tty=tty, log_every=log_every), out


def test_off_a_tty_only_every_nth_step_and_the_last_are_printed_but_every_step_is_recorded(tmp_path):
    metrics, out = writer(tmp_path, tty=False, log_every=3)
    for step in range(1, 8):
        metrics.step(step=step, total_steps=7, **STEP)
    metrics.close()
    printed = [line.split()[1] for line in out.getvalue().splitlines()]
    assert printed == ["3/7", "6/7", "7/7"]
    records = metrics_format.parse_lines((tmp_path / "sub" / "m.jsonl").read_text())
    assert [r["step"] for r in records] == list(range(1, 8))
    assert all("gpu_memory_gib" not in r for r in records)


def test_on_a_tty_the_bar_is_redrawn_in_place_and_a_said_line_ends_it_first(tmp_path):
    metrics, out = writer(tmp_path, tty=True, log_every=10)
    metrics.step(step=1, total_steps=20, **STEP)
    metrics.step(step=2, total_steps=20, **STEP)
    metrics.say("checkpoint step 2: x")
    metrics.say("and another line")
    metrics.step(step=10, total_steps=20, **STEP)  # a permanent line: the bar ends with it
    metrics.say("after")
    metrics.close()
    bar = "\r\x1b[2K[{}] " + step_line(0, 20, **{k: v for k, v in STEP.items() if k != "epoch"})

    def drawn(step, filled):
        return bar.format("#" * filled + "." * (24 - filled)).replace("step  0/20", f"step {step:>2}/20")

    assert out.getvalue() == (
        drawn(1, 1) + drawn(2, 2) + "\ncheckpoint step 2: x\nand another line\n" + drawn(10, 12) + "\nafter\n"
    )


def test_gpu_memory_is_recorded_only_when_measured(tmp_path):
    metrics, _ = writer(tmp_path, tty=False)
    metrics.step(step=1, total_steps=1, gpu_memory_gib=12.5, **STEP)
    metrics.close()
    (record,) = metrics_format.parse_lines((tmp_path / "sub" / "m.jsonl").read_text())
    assert record["gpu_memory_gib"] == 12.5 and record["acc"] == [0.5, 0.25]


def failure_of(exc: BaseException, thread: str | None = None) -> Failure:
    try:
        raise WorkerFailure(thread, exc, "Traceback (most recent call last):\n  boom\n") if thread else exc
    except BaseException as caught:  # noqa: B036 - a KeyboardInterrupt too
        return Failure.of(caught)


class BadInput(Exception):
    exit_code = 2


@pytest.mark.parametrize(
    "exc, thread, label, said, record",
    [
        (
            KeyboardInterrupt(),
            None,
            "",
            ["aborted: ", "done     step 4 (interrupted)"],
            ("done", {"step": 4, "reason": "interrupted"}),
        ),
        (
            RuntimeError("CUDA out of memory. Tried"),
            "drafter1",
            "rank 1: ",
            ["error in thread drafter1:", "Traceback (most recent call last):", "  boom"],
            (
                "error",
                {
                    "kind": "cuda_oom",
                    "message": "rank 1: RuntimeError in thread drafter1: CUDA out of memory. Tried",
                },
            ),
        ),
        (BadInput("data.path: no such file"), None, "", [], ("error", {"kind": "exception"})),
    ],
)
def test_a_runs_last_words_say_how_it_ended(tmp_path, exc, thread, label, said, record):
    metrics, out = writer(tmp_path, tty=False)
    metrics.failed(failure_of(exc, thread), last_step=4, label=label)
    metrics.close()
    lines = out.getvalue().splitlines()
    assert lines == said, "bad input says nothing here: the command says it in one line"
    (written,) = metrics_format.parse_lines((tmp_path / "sub" / "m.jsonl").read_text())
    event, fields = record
    assert written["event"] == event and {k: written[k] for k in fields} == fields


def test_records_from_many_threads_stay_whole_lines(tmp_path):
    metrics, _ = writer(tmp_path, tty=False)

    def compile_events(thread: int):
        for step in range(50):
            metrics.compile(f"drafter{thread}", 0.5, step, "x" * 300)

    threads = [threading.Thread(target=compile_events, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics.close()
    metrics.close()  # a second close is harmless
    lines = (tmp_path / "sub" / "m.jsonl").read_text().splitlines()
    assert len(lines) == 200 and all(json.loads(line)["event"] == "compile" for line in lines)
