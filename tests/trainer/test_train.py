"""The training loop: the loss falls, resume is exact, the metrics file keeps the contract."""
from __future__ import annotations

import copy
import io
import json
import math
import os

import pytest
import torch

from trainer import metrics_format
from trainer.config import load_config
from trainer.train.metrics import error_kind
from trainer.train.loop import WarmupCosine, make_loss_fn, train
from trainer.train.workers import WorkerFailure
from tests.trainer.conftest import assert_same_replica, loss_fn_failing

pytestmark = pytest.mark.timeout(180)

SMALL = {
    "data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 30, "train.batch_size": 2, "train.num_anchors": 6,
    "run.torch_threads": 1, "run.log_every": 1000,
}


def tiny_cfg(out_dir, **extra):
    overrides = dict(SMALL, output_dir=str(out_dir))
    overrides.update(extra)
    return load_config("tiny-cpu", overrides)


def records(cfg):
    with open(cfg.metrics_path, encoding="utf-8") as f:
        return metrics_format.parse_lines(f.read())


def test_loss_falls_clearly_on_the_learnable_synthetic_data(tmp_path):
    # The bundled tiny-cpu settings, whole: one epoch, every sequence seen once.
    cfg = load_config("tiny-cpu", {"output_dir": str(tmp_path), "run.checkpoint_every": 1000, "eval.every": 0})
    train(cfg, out=io.StringIO())
    steps = [r for r in records(cfg) if r["event"] == "step"]
    assert len(steps) == 512
    first = sum(r["loss"] for r in steps[:10]) / 10
    last = sum(r["loss"] for r in steps[-10:]) / 10
    # Chance level is ln(vocab 512) = 6.24: the start sits near it, the end at least 1 nat lower.
    assert first > 5.5
    assert last < first - 1.0, (first, last)
    acc_first = sum(r["acc"][0] for r in steps[:10]) / 10
    acc_last = sum(r["acc"][0] for r in steps[-10:]) / 10
    assert acc_last > acc_first + 0.2, (acc_first, acc_last)


def test_resume_gives_exactly_the_uninterrupted_result(tmp_path):
    straight = tiny_cfg(tmp_path / "a", max_steps=6, **{"run.checkpoint_every": 3, "run.keep_last": 5})
    whole = train(straight, out=io.StringIO())
    mid = tmp_path / "a" / "checkpoints" / "step-0000003"
    assert mid.is_dir()

    resumed_cfg = tiny_cfg(tmp_path / "b", max_steps=6, resume=str(mid))
    resumed = train(resumed_cfg, out=io.StringIO())
    assert resumed.steps_done == 6
    assert_same_replica(whole.replicas[0], resumed.replicas[0])
    # the resumed run logged steps 4..6 with the same losses as the straight run
    loss_a = {r["step"]: r["loss"] for r in records(straight) if r["event"] == "step"}
    loss_b = {r["step"]: r["loss"] for r in records(resumed_cfg) if r["event"] == "step"}
    assert sorted(loss_b) == [4, 5, 6]
    assert all(loss_a[s] == loss_b[s] for s in loss_b)


def test_a_different_seed_changes_the_result(tmp_path):
    """Guards the resume test: equal results there are not a given (data order and anchors matter)."""
    a = train(tiny_cfg(tmp_path / "a", max_steps=3), out=io.StringIO())
    b = train(tiny_cfg(tmp_path / "b", max_steps=3, seed=1), out=io.StringIO())
    assert not torch.equal(a.replicas[0].model.fc.weight, b.replicas[0].model.fc.weight)


def test_resume_latest_with_a_different_drafter_is_refused(tmp_path):
    from trainer.config import ConfigError

    train(tiny_cfg(tmp_path, max_steps=2), out=io.StringIO())
    other = tiny_cfg(tmp_path, max_steps=4, resume="latest", **{"drafter.num_layers": 2})
    with pytest.raises(ConfigError, match=r"differs in num_layers.*Fix"):
        train(other, out=io.StringIO())


def test_metrics_file_follows_the_contract(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=5, **{"run.checkpoint_every": 2, "train.warmup_frac": 0.4})
    out = io.StringIO()
    train(cfg, out=out)
    recs = records(cfg)
    assert [r["event"] for r in recs][0] == "start" and recs[-1]["event"] == "done"
    assert all(r["v"] == metrics_format.FORMAT_VERSION and isinstance(r["time"], float) for r in recs)

    start = recs[0]
    assert start["total_steps"] == 5 and start["compile_lock"] == "lock" and start["pid"] == os.getpid()
    assert start["devices"] == ["cpu", "cpu", "cpu"]  # one target + two drafters
    assert start["config"]["train"]["max_steps"] == 5

    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        for field in metrics_format.STEP_FIELDS + ("acc", "epoch"):
            assert field in r, field
        assert r["total_steps"] == 5 and math.isfinite(r["loss"]) and r["loss"] > 0
        assert len(r["acc"]) == cfg.drafter.block_size - 1 and all(0 <= a <= 1 for a in r["acc"])
        assert r["tokens_per_s"] > 0 and r["eta_s"] >= 0 and r["grad_norm"] > 0
    assert steps[-1]["eta_s"] == 0
    # 16 sequences / (2 per replica x 2 replicas) = 4 steps per epoch
    assert [r["epoch"] for r in steps] == [0.25, 0.5, 0.75, 1.0, 1.25]
    # warmup 40% of 5 steps = 2 steps: lr/2, lr; then a cosine that would reach 0 after step 5
    lr = cfg.train.lr
    cosine = [0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]
    assert [r["lr"] for r in steps] == pytest.approx([lr * 0.5, lr] + [lr * c for c in cosine])

    ckpts = [r for r in recs if r["event"] == "checkpoint"]
    assert [r["step"] for r in ckpts] == [2, 4, 5]  # every 2 steps and at the end
    assert all(os.path.isdir(r["path"]) for r in ckpts[-3:] if r["step"] >= 4)
    assert recs[-1] == {**recs[-1], "event": "done", "step": 5, "reason": "max_steps"}
    # a completed run says so in its directory, so a launcher starts a new run instead of resuming
    assert (tmp_path / metrics_format.RUN_FINISHED).read_text() == "5\n"

    text = out.getvalue()  # the readable side: resolved config, devices, lock mode, one line per step
    assert "resolved config" in text and "drafters cpu, cpu" in text and "compile lock: lock" in text
    assert "step 5/5" in text and "loss" in text and "\r" not in text  # no progress bar off a TTY


def test_progress_bar_only_on_a_tty(tmp_path):
    out = io.StringIO()
    train(tiny_cfg(tmp_path, max_steps=2), out=out, tty=True)
    assert "\r" in out.getvalue() and "[" + "#" * 24 + "]" in out.getvalue()


def test_an_exception_in_a_drafter_thread_ends_the_run_with_an_error_record(tmp_path, monkeypatch):
    import trainer.train.loop as train_module

    flaky = loss_fn_failing(make_loss_fn, replica=0, step=1, message="drafter zero broke")
    monkeypatch.setattr(train_module, "make_loss_fn", flaky)
    cfg = tiny_cfg(tmp_path, max_steps=5)
    out = io.StringIO()
    with pytest.raises(WorkerFailure, match="drafter zero broke"):
        train(cfg, out=out)
    recs = records(cfg)
    assert recs[-1]["event"] == "error" and recs[-1]["kind"] == "exception"
    assert "drafter0" in recs[-1]["message"] and "drafter zero broke" in recs[-1]["message"]
    assert not any(r["event"] == "done" for r in recs)
    assert "Traceback" in out.getvalue() and "run" in out.getvalue()  # the worker's traceback is logged


def test_error_kinds_follow_the_cause_chain():
    fx = RuntimeError(metrics_format.FX_TRACING_ERROR + ".")
    wrapped = WorkerFailure("drafter1", fx, "")
    try:
        raise wrapped from fx
    except WorkerFailure as exc:
        assert error_kind(exc) == "fx_tracing"
    assert error_kind(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "cuda_oom"
    assert error_kind(KeyError("custom")) == "block_mask"  # the create_block_mask race
    assert error_kind(KeyError("other")) == "exception"
    assert error_kind(ValueError("x")) == "exception"


def test_warmup_cosine_schedule():
    s = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0
    assert s(9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert s(14) == pytest.approx(0.1) and s(20) == pytest.approx(0.1)
    assert json.dumps(vars(s))  # its numbers travel in the scheduler's state_dict


def test_compiles_inside_drafter_steps_are_logged_with_thread_and_duration(tmp_path, monkeypatch):
    import trainer.train.loop as train_module

    real = make_loss_fn
    scale = torch.compile(lambda loss: loss * 1.0, backend="eager", dynamic=False)  # a real dynamo compile

    def with_compiled_op(cfg):
        compute = real(cfg)

        def run(replica, batch):
            out = compute(replica, batch)
            out.loss = scale(out.loss)
            return out

        return run

    monkeypatch.setattr(train_module, "make_loss_fn", with_compiled_op)
    cfg = tiny_cfg(tmp_path, max_steps=3)
    out = io.StringIO()
    train(cfg, out=out)
    compiles = [r for r in records(cfg) if r["event"] == "compile"]
    assert compiles, "the compile of `scale` was not reported"
    first = compiles[0]
    assert first["thread"] in ("drafter0", "drafter1") and first["step"] == 0
    assert first["duration_s"] > 0 and first["reason"] == "first_step"
    assert "compile  drafter" in out.getvalue()


def test_a_resumed_schedule_has_the_uninterrupted_lr_at_every_step():
    from trainer.train.loop import resumed_scheduler

    def optimizer_and_schedule():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(2, 8, 0.1))

    straight, straight_schedule = optimizer_and_schedule()
    lrs = []
    for step in range(8):
        if step == 3:
            saved = copy.deepcopy((straight.state_dict(), straight_schedule.state_dict()))
        lrs.append(straight_schedule.get_last_lr())
        straight.step()
        straight_schedule.step()

    optimizer, fresh = optimizer_and_schedule()
    optimizer.load_state_dict(saved[0])
    resumed = resumed_scheduler(fresh, saved[1]["last_epoch"])
    assert resumed.get_last_lr() == lrs[3] == [group["lr"] for group in optimizer.param_groups]
    for step in range(4, 8):
        optimizer.step()
        resumed.step()
        assert resumed.get_last_lr() == lrs[step], step


def test_a_step_starts_ahead_only_where_nothing_but_logging_follows_and_a_stop_ends_after_it(
    tmp_path, monkeypatch
):
    """A step starts before the one before it is read once a step's time is known and short, except
    where a checkpoint (after step 2) must see idle drafters; a SIGTERM during step 3 (4 already
    running) stops after step 4, whose checkpoint is the run's last. With a stop grace shorter than
    four steps, no step runs ahead: a stop would wait for two."""
    import signal

    from trainer.train import workers as workers_mod

    real_run_step = workers_mod.TrainingWorkers.run_step
    calls, signal_at = [], [2]

    def run_step(self, step_index, give_up=None, ahead=False):
        calls.append((step_index, ahead))
        if step_index in signal_at:
            signal.raise_signal(signal.SIGTERM)
        return real_run_step(self, step_index, give_up, ahead)

    monkeypatch.setattr(workers_mod.TrainingWorkers, "run_step", run_step)
    cfg = tiny_cfg(tmp_path, max_steps=6, **{"run.checkpoint_every": 2})
    result = train(cfg, out=io.StringIO())
    assert calls == [(0, False), (1, False), (2, True), (3, False)]
    assert (result.reason, result.steps_done) == ("interrupted", 4)
    assert [r["step"] for r in records(cfg) if r["event"] == "checkpoint"] == [2, 4]
    assert [r["step"] for r in records(cfg) if r["event"] == "step"] == [1, 2, 3, 4]

    calls.clear()
    signal_at.clear()
    hurried = tiny_cfg(tmp_path / "hurried", max_steps=6, **{"run.checkpoint_every": 2, "run.stop_grace_s": 1e-4})
    assert train(hurried, out=io.StringIO()).steps_done == 6
    assert calls == [(index, False) for index in range(6)]


def test_a_stop_during_the_last_step_still_completes_the_run(tmp_path, monkeypatch):
    # SIGTERM that arrives while the final step runs: the step finishes and is checkpointed, so the
    # run is complete; calling it "interrupted" would make a resume start a trainer with nothing to do.
    import signal

    from trainer.train import workers as workers_mod

    real_run_step = workers_mod.TrainingWorkers.run_step

    def run_step(self, step_index, *args, **kwargs):
        if step_index == 3:  # the 4th and last step
            signal.raise_signal(signal.SIGTERM)
        return real_run_step(self, step_index, *args, **kwargs)

    monkeypatch.setattr(workers_mod.TrainingWorkers, "run_step", run_step)
    cfg = tiny_cfg(tmp_path, max_steps=4)
    result = train(cfg, out=io.StringIO())
    done = records(cfg)[-1]
    assert (result.reason, done["event"], done["reason"], done["step"]) == ("max_steps", "done", "max_steps", 4)
    assert (tmp_path / metrics_format.RUN_FINISHED).read_text().strip() == "4"


def test_resume_from_a_checkpoint_whose_drafter_config_is_not_an_object_is_refused(tmp_path):
    """It was AttributeError ('list' object has no attribute 'get'): 'training failed', exit 1."""
    from trainer.train.checkpoint import CheckpointError

    train(tiny_cfg(tmp_path, max_steps=2), out=io.StringIO())
    (tmp_path / "checkpoints" / "step-0000002" / "drafter_config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match=r"step-0000002: drafter_config.json is not a JSON object. Fix: "):
        train(tiny_cfg(tmp_path, max_steps=4, resume="latest"), out=io.StringIO())


def test_resume_from_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused_naming_the_tensor(tmp_path):
    """It was 'training failed: Error(s) in loading state_dict' with the tensor on a second line, exit 1."""
    from safetensors.torch import load_file, save_file

    from trainer.train.checkpoint import CheckpointError

    train(tiny_cfg(tmp_path, max_steps=2), out=io.StringIO())
    path = str(tmp_path / "checkpoints" / "step-0000002" / "drafter.safetensors")
    weights = load_file(path)
    del weights["fc.weight"]
    save_file(weights, path)
    with pytest.raises(CheckpointError, match=r'do not fit its drafter config \(Missing key\(s\) in state_dict: "fc.weight"\)'):
        train(tiny_cfg(tmp_path, max_steps=4, resume="latest"), out=io.StringIO())
