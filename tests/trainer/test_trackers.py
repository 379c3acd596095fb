"""run.report_to: trackers fed from the metrics records, failing trackers that never fail the run."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainer import metrics_format

from trainer.train import trackers
from trainer.config import ConfigError, load_config
from trainer.train.metrics import MetricsWriter

from tests.trainer.conftest import SHORT_TINY_RUN

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
# the bundled tiny run, shortened (6 steps, an evaluation at steps 3 and 6)
TINY = ["--config", "tiny-cpu", "--max-steps", "6", *SHORT_TINY_RUN]


def run_tiny(tmp_path: Path, report_to: str, block_imports: tuple = ()) -> subprocess.CompletedProcess:
    """The trainer in its own process; `block_imports` are modules made unimportable there."""
    out = tmp_path / "run"
    argv = [*TINY, "--output-dir", str(out), "--set", f"run.report_to={report_to}"]
    code = (
        "import sys\n"
        + "".join(f"sys.modules[{name!r}] = None\n" for name in block_imports)
        + f"from trainer.cli.main import main\nsys.exit(main({argv!r}))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(tmp_path / "wbc"),
        "WANDB_CACHE_DIR": str(tmp_path / "wbc"),
        "WANDB_DATA_DIR": str(tmp_path / "wbc"),
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200
    )


def records(tmp_path: Path) -> list[dict]:
    return metrics_format.parse_lines((tmp_path / "run" / "metrics.jsonl").read_text())


def f32(value: float) -> float:
    """An event file stores a scalar as float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def test_tensorboard_scalars_equal_the_metrics_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = run_tiny(tmp_path, "[tensorboard]")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "report_to: tensorboard" not in done.stdout
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    recs = records(tmp_path)
    steps = [r for r in recs if r["event"] == "step"]
    evals = [r for r in recs if r["event"] == "eval"]
    assert len(steps) == 6 and [e["step"] for e in evals] == [3, 6]
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "epoch"):
        assert series(f"train/{field}") == [(r["step"], f32(r[field])) for r in steps], field
    block = len(steps[0]["acc"])
    for k in range(1, block + 1):
        assert series(f"train/acc/pos{k}") == [(r["step"], f32(r["acc"][k - 1])) for r in steps]
        assert series(f"eval/acceptance/pos{k}") == [(r["step"], f32(r["acceptance"][k - 1])) for r in evals]
    assert series("train/tau_expected") == [
        (r["step"], f32(metrics_format.expected_tau(r["acc"]))) for r in steps
    ]
    assert series("eval/tau") == [(r["step"], f32(r["tau"])) for r in evals]
    assert [e.step for e in events.Tensors("events/text_summary")] == [
        6,
        6,
    ]  # the checkpoint and the done record


def test_wandb_offline_writes_its_run_and_a_missing_tracker_is_one_line(tmp_path):
    """Also: the trainer runs without matplotlib (only the report draws)."""
    pytest.importorskip("wandb")
    done = run_tiny(tmp_path, "[wandb, mlflow]", block_imports=("mlflow", "matplotlib"))
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("report_to: ")]  # wandb: none
    assert said == [
        "report_to: mlflow is not installed (pip install mlflow-skinny, or the dflash-ops[mlflow] "
        "extra); training continues without it"
    ]
    assert records(tmp_path)[-1]["event"] == "done" and records(tmp_path)[-1]["reason"] == "max_steps"
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (data,) = runs[0].glob("run-*.wandb")
    assert data.stat().st_size > 1000
    assert not (tmp_path / "run" / "mlruns").exists()


def test_mlflow_local_store_holds_the_step_losses(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    done = run_tiny(tmp_path, "[mlflow]")
    assert done.returncode == 0, done.stderr[-2000:]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file:" + str(tmp_path / "run" / "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert history == [(r["step"], r["loss"]) for r in records(tmp_path) if r["event"] == "step"]
    assert run.data.params["train.num_anchors"] == "6"


# ---- the fan-out, without a training run ----------------------------------------------------------


class Recording(trackers.Tracker):
    """A tracker that keeps what it gets, and raises from its `fail_at`-th scalars call on."""

    name = "recording"
    fail_at = None
    seen: list = []

    def scalars(self, step, values):
        if self.fail_at is not None and len(self.seen) + 1 >= self.fail_at:
            raise ConnectionError("server went away\nsecond line")
        self.seen.append((threading.get_ident(), step, values))


def test_a_tracker_raising_mid_run_is_one_line_and_the_others_go_on(tmp_path, monkeypatch):
    class Failing(Recording):
        name = "failing"
        fail_at = 2
        seen: list = []

    class Healthy(Recording):
        seen: list = []

    monkeypatch.setitem(trackers.KINDS, "failing", Failing)
    monkeypatch.setitem(trackers.KINDS, "recording", Healthy)
    lines: list[str] = []
    writer = MetricsWriter(
        str(tmp_path / "m.jsonl"),
        out=open(os.devnull, "w"),
        tty=False,
        report_to=["failing", "recording"],
        report_dir=str(tmp_path),
    )
    writer.say = lines.append
    writer.trackers.say = lines.append
    writer.start({"train": {"lr": 1e-3}}, ["cpu"], "lock", 3)
    for step in (1, 2, 3):
        writer.step(
            step=step,
            total_steps=3,
            loss=1.0 / step,
            acc=[0.5, 0.25],
            tokens_per_s=10.0,
            eta_s=0.0,
            lr=1e-3,
            grad_norm=1.0,
            epoch=0.1,
        )
    writer.done(3, "max_steps")
    writer.close()
    assert [line for line in lines if "report_to" in line] == [
        "report_to: failing failed (ConnectionError: server went away); training continues without it"
    ]
    assert len(Failing.seen) == 1
    assert [(s, v["train/loss"]) for _, s, v in Healthy.seen] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert Healthy.seen[0][2]["train/tau_expected"] == 1 + 0.5 + 0.5 * 0.25
    file_losses = [
        r["loss"]
        for r in metrics_format.parse_lines((tmp_path / "m.jsonl").read_text())
        if r["event"] == "step"
    ]
    assert file_losses == [v["train/loss"] for _, _, v in Healthy.seen]


def test_records_of_other_threads_reach_the_trackers_from_the_writers_thread(tmp_path, monkeypatch):
    class Healthy(Recording):
        seen: list = []

    monkeypatch.setitem(trackers.KINDS, "recording", Healthy)
    writer = MetricsWriter(
        str(tmp_path / "m.jsonl"),
        out=open(os.devnull, "w"),
        tty=False,
        report_to=["recording"],
        report_dir=str(tmp_path),
    )
    writer.start({}, ["cpu"], "lock", 1)
    drafter = threading.Thread(target=writer.compile, args=("drafter-0", 2.5, 0, "first step"))
    drafter.start()
    drafter.join()
    assert Healthy.seen == []  # waits for the main thread
    writer.step(
        step=1,
        total_steps=1,
        loss=1.0,
        acc=[0.5],
        tokens_per_s=1.0,
        eta_s=0.0,
        lr=1e-3,
        grad_norm=1.0,
        epoch=1.0,
    )
    writer.close()
    main = threading.get_ident()
    assert [(thread == main, step, sorted(v)[:1]) for thread, step, v in Healthy.seen] == [
        (True, 0, ["compile/duration_s"]),
        (True, 1, ["train/acc/pos1"]),
    ]


def test_scalars_of_reports_fields_added_to_the_contract_later():
    record = json.loads(
        metrics_format.encode(
            "eval",
            step=4,
            tau=2.5,
            tau_per_prompt_mean=2.25,
            tau_per_prompt={"min": 1.0, "median": 2.0, "max": 4.0},
            acceptance=[0.75],
            lossless=None,
            prompts=2,
            new_tokens=9,
            seconds=0.5,
        )
    )
    step, values = trackers.scalars_of(record)
    assert step == 4 and values["eval/tau_per_prompt_mean"] == 2.25 and values["eval/acceptance/pos1"] == 0.75
    assert values["eval/tau_per_prompt/median"] == 2.0 and values["eval/tau_per_prompt/max"] == 4.0
    assert "eval/lossless" not in values and "eval/time" not in values


def test_report_to_typo_names_the_tracker_and_the_fix():
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", {"run.report_to": ["tensorbord"]})
    message = str(info.value)
    assert "`run.report_to` has 'tensorbord'" in message and "Did you mean 'tensorboard'?" in message
    assert load_config("tiny-cpu", {"run.report_to": "wandb,wandb,mlflow"}).run.report_to == [
        "wandb",
        "mlflow",
    ]
    assert load_config("tiny-cpu", {}).run.report_to == []


def test_under_torchrun_only_rank_0_reports():
    from trainer.train.distributed import Rank

    cfg = load_config("tiny-cpu", {"run.report_to": ["tensorboard"], "run.metrics_file": "m.jsonl"})
    other_host_lead = Rank(rank=2, world_size=4, local_rank=0)
    assert other_host_lead.speaks(cfg) and other_host_lead.trackers(cfg) == []
    assert Rank(rank=0, world_size=4, local_rank=0).trackers(cfg) == ["tensorboard"]
