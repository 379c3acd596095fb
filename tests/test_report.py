"""`dflash-ops report` and `dflash-train report`: a real tiny run's metrics (two launches: a stop and
a resume), read in one round trip over the real sshd and the pct simulator, drawn into a PNG whose
panels hold real plots; hostile run ids and paths stay inert; no metrics is one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ops.job import jobpaths, jobstate

from dflash_ops.observe import report
from dflash_ops.errors import InputError
from dflash_ops.job.model import Job, Target
from dflash_ops.remote import report_read
from trainer import metrics_format, metrics_history, run_summary

from benchmarks.common import tiny_train_argv
from tests.ops_helpers import ops_argv
from tests.trainer.conftest import SHORT_TINY_RUN


pytest.importorskip("matplotlib")
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parent.parent
HOSTILE = "w $(touch PWNED) `touch PWNED2` 'q' ; $HOME"
SHORT = SHORT_TINY_RUN
STEPS = 12


def make_job(workdir: Path) -> Job:
    return Job(workdir=str(workdir), python=sys.executable, config="tiny-cpu")


def trainer_argv(output_dir: Path, metrics: Path, *more: str) -> list[str]:
    return tiny_train_argv(output_dir, "--metrics-file", str(metrics), *SHORT, *more)


ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def train(output_dir: Path, metrics: Path, *more: str) -> None:
    done = subprocess.run(
        trainer_argv(output_dir, metrics, *more), env=ENV, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-2000:]


def train_until_stopped(output_dir: Path, metrics: Path, after_steps: int, *more: str) -> None:
    """Start training, SIGTERM it once `after_steps` step records are written (it checkpoints and
    records `done` interrupted), as `dflash-ops stop` does."""
    proc = subprocess.Popen(
        trainer_argv(output_dir, metrics, *more),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            text = metrics.read_text() if metrics.exists() else ""
            if sum(r["event"] == "step" for r in metrics_format.parse_lines(text)) >= after_steps:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A job's workdir (its path full of shell syntax) holding run 0001 the way the launcher lays it
    out: launch 1 was stopped after a few steps, launch 2 resumed it to step 12; the job state
    (stopped since) names launch 2's log, whose last line is still being written."""
    root = tmp_path_factory.mktemp("report") / HOSTILE
    job = make_job(root)
    run_dir = Path(jobpaths.runs_dir(job)) / "0001"
    logs = Path(job.log_dir)
    logs.mkdir(parents=True)
    train_until_stopped(run_dir, logs / "train-0001.metrics.jsonl", 4, "--max-steps", str(STEPS))
    train(run_dir, logs / "train-0002.metrics.jsonl", "--max-steps", str(STEPS), "--resume")
    with (logs / "train-0002.metrics.jsonl").open("a") as f:
        f.write('{"v":1,"event":"step","step":13,"lo')
    state = jobstate.JobState(jobstate.RUNNING, run=1, run_dir=str(run_dir), log=str(logs / "train-0002.log"))
    Path(jobpaths.state_file(job)).write_bytes(jobstate.encode(jobstate.stop_record(state, jobstate.STOPPED, 1.0)))
    return root


def stopped_at(workdir: Path) -> int:
    text = (Path(make_job(workdir).log_dir) / "train-0001.metrics.jsonl").read_text()
    return metrics_format.last_of(metrics_format.parse_lines(text), "done")["step"]


def assert_real_plot(path: Path, built: report.Report) -> None:
    """The PNG has the figure's size, and inside every panel (its frame left out) enough coloured
    pixels for a drawn series: an empty panel has none but a legend swatch."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    assert image.size == built.size and image.size[0] >= 1000 and image.size[1] >= 600
    assert set(built.panels) >= {"loss", "tau", "acceptance", "tokens_per_s"}
    pixels = image.load()
    for name, (left, top, right, bottom) in built.panels.items():
        coloured = sum(
            1
            for x in range(left + 4, right - 4)
            for y in range(top + 4, bottom - 4)
            if max(pixels[x, y]) - min(pixels[x, y]) > 60
        )
        assert coloured > 400, f"panel {name}: {coloured} coloured pixels"


def check_history(built: report.Report, workdir: Path) -> None:
    (history,) = built.histories
    stop = stopped_at(workdir)
    assert (
        history.name == "run 0001" and history.launches == 2 and history.steps == tuple(range(1, STEPS + 1))
    )
    assert [(m.kind, m.step) for m in history.markers] == [("stop", stop), ("relaunch", stop)]
    assert [e.step for e in history.evals] == [3, 6, 9, 12] and history.finished
    assert built.job_state == "stopped"


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_report_over_the_transport_draws_the_run_in_one_round_trip(
    kind, workdir, request, tmp_path, monkeypatch
):
    # the conftest's real sshd / pct simulator target, with this module's job
    fixture = request.getfixturevalue("ssh_target" if kind == "ssh" else "pct_target")
    target = dataclasses.replace(fixture, job=make_job(workdir))
    from dflash_ops.transport import factory

    made = []
    real = factory.make_transport

    def counting(t):
        transport = real(t)
        calls = []
        original = transport.run
        transport.run = lambda *a, **k: calls.append(a) or original(*a, **k)
        made.append(calls)
        return transport

    monkeypatch.setattr("dflash_ops.transport.factory.make_transport", counting)
    out = tmp_path / "run.png"
    built = report.report(target, report.run_selection(None, False), str(out))
    assert [len(calls) for calls in made] == [1]  # one transport, one run
    check_history(built, workdir)
    assert_real_plot(out, built)
    assert not list(workdir.parent.rglob("PWNED*"))


def test_html_embeds_the_png_and_the_summary_table(workdir, local_target, tmp_path):
    target = dataclasses.replace(local_target, job=make_job(workdir))
    out = tmp_path / "run.html"
    built = report.report(target, report.run_selection("1", False), str(out))
    page = out.read_text()
    assert "data:image/png;base64," in page and "<th>best τ</th>" in page
    best = built.histories[0].best_eval
    assert f"{best.tau:.3f} (step {best.step})" in page and f"<td>{STEPS}/{STEPS}</td>" in page


def test_all_runs_overlays_every_run(workdir, local_target, tmp_path):
    job = make_job(workdir)
    logs = Path(job.log_dir)
    second = Path(jobpaths.runs_dir(job)) / "0002"
    try:
        train(second, logs / "train-0003.metrics.jsonl", "--max-steps", "3")
        target = dataclasses.replace(local_target, job=job)
        built = report.report(target, report.run_selection(None, True), str(tmp_path / "all.png"))
        assert [h.name for h in built.histories] == ["run 0001", "run 0002"]
        assert [h.last_step for h in built.histories] == [STEPS, 3]
        assert_real_plot(tmp_path / "all.png", built)
    finally:
        (logs / "train-0003.metrics.jsonl").unlink(missing_ok=True)


def report_cli(tmp_path: Path, workdir: Path, *argv: str) -> subprocess.CompletedProcess:
    """`dflash-ops report -t here ARGV` in tmp_path, `here` being a local target on `workdir`."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_INVENTORY"}
    inventory = local_inventory(tmp_path, workdir)
    return subprocess.run(
        ops_argv(inventory, "report", "-t", "here", *argv),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def local_inventory(tmp_path: Path, workdir: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        json.dumps(
            {
                "targets": {
                    "here": {
                        "transport": "local",
                        "job": {"workdir": str(workdir), "python": sys.executable, "config": "tiny-cpu"},
                    }
                }
            }
        )
    )
    return inv


def test_cli_report_writes_the_png_and_says_what_it_drew(workdir, tmp_path):
    done = report_cli(tmp_path, workdir, "-o", "r.png")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(f"[here] run 0001: {STEPS}/{STEPS} steps, best τ ")
    assert done.stdout.splitlines()[-1] == "wrote r.png" and (tmp_path / "r.png").stat().st_size > 20_000


def test_no_metrics_yet_is_one_line_exit_2(tmp_path):
    empty = tmp_path / "empty job"
    logs = empty / "logs"
    logs.mkdir(parents=True)
    # a launch whose trainer wrote its start record, no step yet
    start = metrics_format.encode(
        "start",
        config={"run": {"output_dir": str(empty / "runs" / "0001")}},
        devices=["cpu"],
        compile_lock="lock",
        total_steps=5,
        pid=1,
    )
    (logs / "train-0001.metrics.jsonl").write_text(start)
    for argv in ([], ["--run", "0001"], ["--all-runs"], ["--run", "7"]):
        done = report_cli(tmp_path, empty, *argv)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "no metrics yet" in done.stderr, done.stderr
        assert not (tmp_path / "report.png").exists()


@pytest.mark.parametrize("run", ["0001; touch PWNED", "../0001", "$(touch PWNED)", "1e3", "-1", " 1"])
def test_hostile_run_ids_are_refused_before_anything_runs(run, workdir, tmp_path):
    done = report_cli(tmp_path, workdir, "--run", run)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"dflash-ops: --run {run!r}: a run number is digits only, e.g. --run 0003 (see runs/ in the workdir)"
    ]
    assert not list(tmp_path.rglob("PWNED*")) and not (tmp_path / "report.png").exists()


def test_a_hostile_answer_is_data_not_trusted():
    runs, state = report.parse_answer(
        json.dumps(
            {
                "report_version": 1,
                "job_state": "x",
                "runs": [
                    {"run": "../etc", "files": []},
                    {"run": "0002", "files": [{"lines": ["not json", 7, '{"event":"step"}']}, "junk"]},
                    "junk",
                ],
            }
        ),
        "box",
    )
    assert [(r.run, r.launches) for r in runs] == [
        ("0002", (("not json", '{"event":"step"}'),))
    ] and state is None
    with pytest.raises(InputError):  # a step record without numbers is no metrics
        report.build("box", runs, state)
    with pytest.raises(report.ReportError):
        report.parse_answer("Welcome to the box\n", "box")


# ---- the bounded read ---------------------------------------------------------------------------


def test_thinning_keeps_the_start_every_eval_and_evenly_spaced_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    with path.open("w") as f:
        f.write(
            metrics_format.encode(
                "start", config={}, devices=[], compile_lock="lock", total_steps=10_000, pid=1
            )
        )
        for step in range(1, 10_001):
            f.write(metrics_format.encode("step", step=step, total_steps=10_000, loss=1.0, acc=[0.5]))
            if step % 1000 == 0:
                f.write(metrics_format.encode("eval", step=step, tau=1.5, acceptance=[0.5]))
        f.write("x" * (metrics_history.MAX_LINE_BYTES + 10) + "\n")  # no real record is that long
    read = metrics_history.read_thinned(str(path), max_steps=100)
    records = metrics_format.parse_lines("\n".join(read["lines"]))
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert records[0]["event"] == "start" and 100 <= len(steps) <= 201 and steps[-1] == 10_000
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1], strict=True)}
    assert len(gaps) == 1  # evenly spaced
    assert [r["step"] for r in records if r["event"] == "eval"] == list(range(1000, 10_001, 1000))
    assert sum(len(line) for line in read["lines"]) < 100_000


def test_the_answer_stays_under_its_bound(monkeypatch):
    monkeypatch.setattr(report_read, "MAX_OUTPUT_BYTES", 5_000)
    runs = [{"run": "0001", "files": [{"lines": ["s" * 100] * 200}, {"lines": ["t" * 100] * 10}]}]
    report_read.shrink(runs)
    assert sum(len(line) for f in runs[0]["files"] for line in f["lines"]) <= 5_000
    assert runs[0]["files"][1]["lines"] == ["t" * 100] * 10 and runs[0]["files"][0]["thinned"]


# ---- dflash-train report: the same picture from a file on disk ----------------------------------------


def test_dflash_train_report_draws_a_local_metrics_file(workdir, tmp_path):
    from trainer.cli.main import main

    metrics = Path(make_job(workdir).log_dir) / "train-0001.metrics.jsonl"
    assert main(["report", str(metrics), "-o", str(tmp_path / "local.png")]) == 0
    history = run_summary.history_from_lines("x", [metrics.read_text().splitlines()])
    assert (
        history.steps == tuple(range(1, stopped_at(workdir) + 1))
        and (tmp_path / "local.png").stat().st_size > 20_000
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["report", str(empty), "-o", str(tmp_path / "e.png")]) == 2
    assert main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert not (tmp_path / "e.png").exists()


def test_dflash_train_report_without_matplotlib_is_one_line_exit_2(workdir, tmp_path, monkeypatch, capsys):
    from trainer.cli.main import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    metrics = Path(make_job(workdir).log_dir) / "train-0001.metrics.jsonl"
    assert main(["report", str(metrics), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "dflash-train report: drawing a report needs matplotlib: pip install matplotlib "
        "(or the dflash-ops[report] extra)\n"
    )
    assert not (tmp_path / "x.png").exists()


def test_the_report_script_runs_where_only_the_standard_library_is(workdir, tmp_path):
    from test_remote_bundle import run_isolated

    job = make_job(workdir)
    target = Target(name="x", transport="local", job=job)
    out = run_isolated("report_read.py", report.script_args(target, "current", 300), tmp_path)
    (run,) = out["runs"]
    assert run["run"] == "0001" and [Path(f["path"]).name for f in run["files"]] == [
        "train-0001.metrics.jsonl",
        "train-0002.metrics.jsonl",
    ]
    assert out["job_state"]["state"] == "stopped" and out["errors"] == []


def test_gpu_memory_is_drawn_when_the_step_records_carry_it(tmp_path):
    from trainer import report_plot

    lines = [
        metrics_format.encode(
            "start", time=0.0, config={}, devices=["cuda:0"], compile_lock="lock", total_steps=50, pid=1
        )
    ]
    lines += [
        metrics_format.encode(
            "step",
            time=float(s),
            step=s,
            total_steps=50,
            loss=5.0 / s,
            acc=[0.5, 0.3],
            tokens_per_s=1000.0 + s,
            gpu_memory_gib=10.0 + (s % 7),
        )
        for s in range(1, 51)
    ]
    lines += [
        metrics_format.encode(
            "eval", time=50.0, step=50, tau=1.6, acceptance=[0.5, 0.1], tau_per_prompt_mean=1.7
        )
    ]
    history = run_summary.history_from_lines("gpu run", [lines])
    assert history.gpu_memory_gib[:2] == (11.0, 12.0) and history.wall_s == 50.0
    assert history.evals[0].tau_per_prompt_mean == 1.7
    picture = report_plot.write([history], str(tmp_path / "gpu.png"), "gpu run")
    assert "gpu_memory" in picture.panels
    built = report.Report(
        "box", (history,), None, panels=picture.panels, size=(picture.width, picture.height)
    )
    assert_real_plot(tmp_path / "gpu.png", built)


def test_peak_gpu_memory_reads_and_restarts_the_allocator_peaks(monkeypatch):
    """No GPU here: torch.cuda's two allocator counters are stood in for."""
    import torch

    from trainer.train.loop import peak_gpu_memory_gib

    peaks = {"cuda:0": 3 * 2**30, "cuda:1": 5 * 2**30}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: peaks[dev])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: peaks.__setitem__(dev, 0))
    assert peak_gpu_memory_gib(["cpu"]) is None
    assert peak_gpu_memory_gib(["cuda:0", "cuda:1", "cuda:1"]) == 5.0
    assert peaks == {"cuda:0": 0, "cuda:1": 0}


def test_a_launch_killed_without_last_words_and_an_error_are_marked():
    def launch(first, last, *tail):
        lines = [
            metrics_format.encode(
                "start", time=float(first), config={}, devices=[], compile_lock="lock", total_steps=30, pid=1
            )
        ]
        lines += [
            metrics_format.encode(
                "step", time=float(s), step=s, total_steps=30, loss=1.0, acc=[0.5], tokens_per_s=10.0
            )
            for s in range(first, last + 1)
        ]
        return lines + [metrics_format.encode(t[0], time=float(last), **t[1]) for t in tail]

    history = run_summary.history_from_lines(
        "r",
        [
            launch(1, 10),  # SIGKILLed: no done record
            launch(11, 20, ("error", {"message": "boom", "kind": "cuda_oom"})),
            launch(21, 30, ("done", {"step": 30, "reason": "max_steps"})),
        ],
    )
    assert [(m.kind, m.step) for m in history.markers] == [
        ("ended", 10),
        ("relaunch", 10),
        ("error", 20),
        ("relaunch", 20),
    ]
    assert history.finished and history.launches == 3 and history.wall_s == 9.0 * 3


def test_the_plot_check_fails_on_an_empty_panel(tmp_path):
    """assert_real_plot can fail: without eval records the acceptance panel holds only grey text."""
    from trainer import report_plot

    lines = [
        metrics_format.encode(
            "step", time=float(s), step=s, total_steps=20, loss=1.0 / s, acc=[0.5], tokens_per_s=5.0 + s
        )
        for s in range(1, 21)
    ]
    history = run_summary.history_from_lines("no evals", [lines])
    picture = report_plot.write([history], str(tmp_path / "p.png"), "")
    built = report.Report(
        "box", (history,), None, panels=picture.panels, size=(picture.width, picture.height)
    )
    with pytest.raises(AssertionError, match="panel acceptance"):
        assert_real_plot(tmp_path / "p.png", built)
