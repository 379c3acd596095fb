"""Checkpoints: full round trip, keep-last-K, and a kill -9 mid-save leaves the last good one."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from trainer.train import checkpoint as ck

REPO = Path(__file__).resolve().parents[2]


def save_step(out, step, keep_last=3, size=8):
    return ck.save_checkpoint(
        str(out), step, weights={"fc.weight": torch.full((size, size), float(step))},
        optimizer={"state": {}, "param_groups": [{"lr": 0.1 * step, "params": [0]}]},
        scheduler={"last_epoch": step}, data_position={"step": step, "epoch": 0, "position": step},
        rng=ck.rng_state(["cpu"]), config={"saved_step": step}, drafter_config={"hidden_size": size},
        keep_last=keep_last)


def test_round_trip_restores_weights_optimizer_schedule_and_rng(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    random.seed(5)
    torch.manual_seed(5)
    path = ck.save_checkpoint(str(tmp_path), 12, weights=model.state_dict(), optimizer=opt.state_dict(),
                              scheduler=sched.state_dict(), data_position={"step": 12, "epoch": 1, "position": 2},
                              rng=ck.rng_state(["cpu"]), config={"a": 1}, drafter_config={"b": 2}, keep_last=2)
    expected_draws = (random.random(), torch.rand(3))
    assert path == str(tmp_path / "checkpoints" / "step-0000012")

    state = ck.load_checkpoint(path)
    assert state.step == 12 and state.config == {"a": 1} and state.drafter_config == {"b": 2}
    assert state.data_position == {"step": 12, "epoch": 1, "position": 2}
    for name, tensor in model.state_dict().items():
        assert torch.equal(state.weights[name], tensor)
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-2)
    fresh.load_state_dict(state.optimizer)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh.state_dict()["state"][0][key], opt.state_dict()["state"][0][key])
    assert state.scheduler["last_epoch"] == 1
    random.seed(99)
    torch.manual_seed(99)
    ck.set_rng_state(state.rng)
    assert (random.random(), torch.equal(torch.rand(3), expected_draws[1])) == (expected_draws[0], True)


def test_keeps_only_the_newest_k(tmp_path):
    for step in (10, 20, 30, 40, 50):
        save_step(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-0000040", "step-0000050"]
    assert ck.latest_checkpoint(str(tmp_path)).endswith("step-0000050")


def test_latest_ignores_temp_and_incomplete_directories(tmp_path):
    save_step(tmp_path, 5)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-0000009-123").mkdir()
    (root / "step-0000008").mkdir()  # e.g. copied by hand, missing files
    (root / "step-0000008" / ck.WEIGHTS).write_bytes(b"")
    assert ck.latest_checkpoint(str(tmp_path)).endswith("step-0000005")
    save_step(tmp_path, 6)  # a save sweeps the leftovers of killed saves
    assert not (root / ".tmp-step-0000009-123").exists()


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_step(tmp_path, 3)
    ck.save_checkpoint(str(tmp_path), 3, weights={"fc.weight": torch.zeros(2)}, optimizer={}, scheduler={},
                       data_position={}, rng=ck.rng_state(["cpu"]), config={"again": True},
                       drafter_config={}, keep_last=3)
    state = ck.load_checkpoint(ck.latest_checkpoint(str(tmp_path)))
    assert state.config == {"again": True} and torch.equal(state.weights["fc.weight"], torch.zeros(2))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000003"]


def test_resume_errors_say_what_to_pass(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no checkpoint in .*start without --resume"):
        ck.resolve_resume("latest", str(tmp_path))
    with pytest.raises(ck.CheckpointError, match="missing drafter.safetensors"):
        ck.resolve_resume(str(tmp_path), str(tmp_path))
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    assert ck.resolve_resume("latest", str(tmp_path)).endswith("step-0000002")
    assert ck.resolve_resume(str(tmp_path), "elsewhere").endswith("step-0000002")  # a run dir: its latest
    first = str(tmp_path / "checkpoints" / "step-0000001")
    assert ck.resolve_resume(first, "elsewhere") == first


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch
    from trainer.train import checkpoint as ck
    out, mode = sys.argv[1], sys.argv[2]

    def save(step, size):
        ck.save_checkpoint(out, step, weights={{"fc.weight": torch.full((size, size), float(step))}},
                           optimizer={{"step": step}}, scheduler={{"last_epoch": step}},
                           data_position={{"step": step}}, rng=ck.rng_state(["cpu"]),
                           config={{"saved_step": step}}, drafter_config={{}}, keep_last=2)

    save(1, 64)
    print("saved 1", flush=True)
    if mode == "pause":  # stop right after the first file of step 2 is on disk
        real = ck._fsync_file
        def pause_after(path):
            real(path)
            print("wrote", path, flush=True)
            time.sleep(60)
        ck._fsync_file = pause_after
        save(2, 64)
    else:  # save big checkpoints back to back until killed
        step = 2
        while True:
            save(step, 1024)
            step += 1
""")


def start_child(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)), encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), mode],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saved 1"
    return proc


def assert_consistent_latest(run_dir):
    latest = ck.latest_checkpoint(str(run_dir))
    state = ck.load_checkpoint(latest)  # loadable: every file complete
    step = state.step
    assert latest.endswith(f"step-{step:07d}")
    assert state.config == {"saved_step": step} and state.scheduler == {"last_epoch": step}
    assert torch.all(state.weights["fc.weight"] == float(step))
    return step


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    proc = start_child(tmp_path, "pause")
    try:
        line = proc.stdout.readline()
        assert line.startswith("wrote") and ".tmp-step-0000002" in line  # mid-save, for sure
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    root = tmp_path / "run" / "checkpoints"
    assert any(p.name.startswith(".tmp-step-0000002") for p in root.iterdir())  # the half-written one
    assert not (root / "step-0000002").exists()
    assert assert_consistent_latest(tmp_path / "run") == 1


@pytest.mark.parametrize("trial", range(2))
def test_kill_9_at_a_random_moment_leaves_a_loadable_checkpoint(tmp_path, trial):
    proc = start_child(tmp_path, "loop")
    try:
        time.sleep(random.Random(trial).uniform(0.2, 0.8))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert assert_consistent_latest(tmp_path / "run") >= 1


# --------------------------------------------------------------------------- export sources and bad files


def test_export_takes_a_step_directory_or_a_runs_newest_and_refuses_the_rest(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"--checkpoint \S+absent: no such file or directory\. Fix: pass"):
        ck.resolve_export_source(str(tmp_path / "absent"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ck.CheckpointError, match=r"no complete checkpoint in \S+checkpoints yet\. Fix:"):
        ck.resolve_export_source(str(tmp_path / "run"))
    with pytest.raises(ck.CheckpointError, match=r"not a checkpoint \(missing drafter.safetensors, "):
        ck.resolve_export_source(str(tmp_path))
    save_step(tmp_path / "run", 3)
    newest = save_step(tmp_path / "run", 7)
    assert ck.resolve_export_source(str(tmp_path / "run")) == newest
    older = str(tmp_path / "run" / "checkpoints" / "step-0000003")
    assert ck.resolve_export_source(older) == older


@pytest.mark.parametrize("damage", ["truncate weights", "garbage state", "bad json", "remove config"])
def test_a_damaged_checkpoint_is_named_in_one_error(tmp_path, damage):
    path = Path(save_step(tmp_path, 4))
    file = {"truncate weights": ck.WEIGHTS, "garbage state": ck.STATE, "bad json": ck.CONFIG}.get(damage, ck.CONFIG)
    if damage == "truncate weights":
        (path / file).write_bytes((path / file).read_bytes()[:40])
    elif damage == "remove config":
        (path / file).unlink()
    else:
        (path / file).write_bytes(b"\x00not what it should be{")
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value).strip()
    if damage == "remove config":
        assert f"missing {ck.CONFIG}" in str(err.value) and "--resume latest" in str(err.value)


def test_the_python_rng_state_survives_a_trip_through_lists():
    """A reload may hand the Python RNG state back as lists (JSON-like); it still restores the stream."""
    random.seed(11)
    state = ck.rng_state(["cpu", "cpu"])
    expected = [random.random() for _ in range(3)]
    version, internal, gauss = state["python"]
    listed = dict(state, python=[version, list(internal), gauss])
    random.seed(12)
    ck.set_rng_state(listed)
    assert [random.random() for _ in range(3)] == expected
    assert state["cuda"] == {} or torch.cuda.is_available()


def test_a_foreign_trainer_state_is_a_checkpoint_error_naming_the_checkpoint(tmp_path):
    path = save_step(tmp_path, 3)
    torch.save({"epoch": 1}, os.path.join(path, ck.STATE))  # a torch file, not ours: no step, no optimizer
    with pytest.raises(ck.CheckpointError, match=f"cannot read checkpoint {path}: KeyError: 'step'. Fix: "):
        ck.load_checkpoint(path)
