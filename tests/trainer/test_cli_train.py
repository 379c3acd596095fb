"""dflash-train end to end: deployed as a bare package dir, SIGTERM, resume, export, exit codes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer import metrics_format
from trainer.train.checkpoint import latest_checkpoint, load_checkpoint
from trainer.cli.main import main
from tests.trainer.conftest import loss_fn_failing

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--set", "data.seq_len=32", "--set", "data.synthetic.num_samples=16", "--set", "train.epochs=30", "--set", "train.batch_size=2",
         "--set", "train.num_anchors=6", "--set", "run.log_every=1"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The trainer the way dflash-ops deploys it: the `trainer/` directory alone, no dflash_ops."""
    root = tmp_path_factory.mktemp("release")
    shutil.copytree(REPO / "trainer", root / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def run_trainer(release, cwd, *args, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(release)
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def stop_watchdogs_of(pid: int) -> list[int]:
    """The trainer's stop watchdog processes (trainer.train.stop_watchdog) that are alive."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                stat, cmd = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"stop_watchdog.py" in cmd:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def read_records(path):
    return metrics_format.parse_lines(Path(path).read_text(encoding="utf-8"))


def test_deployed_trainer_trains_resumes_and_exports(release, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # 1. a first run of 3 steps, metrics where dflash-ops asks for them
    first = run_trainer(release, work, "--config", "tiny-cpu", "--output-dir", "run", "--max-steps", "3",
                        "--metrics-file", "logs/train-0001.metrics.jsonl", *SMALL)
    assert first.returncode == 0, first.stderr
    assert "compile lock: lock" in first.stdout and "step 3/3" in first.stdout
    assert f"({release}/trainer/configs/tiny-cpu.yaml)" in first.stdout  # the deployed copy ran
    recs = read_records(work / "logs" / "train-0001.metrics.jsonl")
    assert recs[-1]["event"] == "done" and recs[-1]["step"] == 3
    assert not (work / "run" / "metrics.jsonl").exists()

    # 2. --resume (latest) with a longer run continues at step 4
    second = run_trainer(release, work, "--config", "tiny-cpu", "--output-dir", "run", "--max-steps", "5",
                         "--resume", "--metrics-file", "logs/train-0002.metrics.jsonl", *SMALL)
    assert second.returncode == 0, second.stderr
    steps = [r["step"] for r in read_records(work / "logs" / "train-0002.metrics.jsonl") if r["event"] == "step"]
    assert steps == [4, 5] and "resuming after step 3" in second.stdout

    # 3. export the latest checkpoint in the inference format
    exported = run_trainer(release, work, "export", "--checkpoint", "run", "--out", "export")
    assert exported.returncode == 0, exported.stderr
    config = json.loads((work / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert config["num_hidden_layers"] == 1
    weights = load_file(str(work / "export" / "model.safetensors"))
    state = load_checkpoint(latest_checkpoint(str(work / "run")))
    assert state.step == 5 and set(weights) == set(state.weights)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}  # export --dtype defaults to bf16
    assert {w.dtype for w in state.weights.values()} == {torch.float32}  # the checkpoint keeps fp32
    assert all(torch.equal(weights[k], state.weights[k].to(torch.bfloat16)) for k in weights)
    assert not any(k.startswith(("embed", "lm_head")) for k in weights)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_finishes_the_step_checkpoints_and_exits_cleanly(release, tmp_path, sig):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(release)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", "tiny-cpu", "--output-dir", "run",
                             "--max-steps", "100000", "--metrics-file", str(metrics), *SMALL],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait for training to be under way
            if metrics.exists() and any(r["event"] == "step" for r in read_records(metrics)):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        watchdogs = stop_watchdogs_of(proc.pid)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert len(watchdogs) == 1 and not any(stop_watchdogs_of(proc.pid)) and not alive(watchdogs[0]), watchdogs
    recs = read_records(metrics)
    done = recs[-1]
    assert done["event"] == "done" and done["reason"] == "interrupted"
    last_step = max(r["step"] for r in recs if r["event"] == "step")
    assert done["step"] == last_step < 100000
    checkpoint = [r for r in recs if r["event"] == "checkpoint"][-1]
    assert checkpoint["step"] == last_step and Path(checkpoint["path"]).is_dir()
    assert load_checkpoint(checkpoint["path"]).step == last_step
    assert f"{sig.name}: stopped after step {last_step}" in out


def test_bad_config_exits_2_with_one_message_and_touches_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {source: synthetic}\ntrain: {lr: fast}\n")
    code = main(["--config", str(bad), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "`train.lr`" in err and "number" in err
    assert not (tmp_path / "run").exists()


def test_bad_override_exits_2(tmp_path, capsys):
    assert main(["--config", "tiny-cpu", "--set", "train.gama=3"]) == 2
    err = capsys.readouterr().err
    assert "`train.gama`" in err and "Did you mean `train.gamma`?" in err
    assert main(["--config", "tiny-cpu", "--set", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_bad_data_exits_2_naming_file_and_line(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n{"input_ids": [1, 2], "loss_mask": [1]}\n')
    code = main(["--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--set", "data.source=jsonl",
                 "--set", f"data.path={data}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}:2:" in err and "loss_mask has 1 entries" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_drafter_thread_exception_exits_1_with_an_error_record(tmp_path, capsys, monkeypatch):
    import trainer.train.loop as train_module

    broken = loss_fn_failing(train_module.make_loss_fn, replica=1, step=2, message="replica one fell over")
    monkeypatch.setattr(train_module, "make_loss_fn", broken)
    started = time.monotonic()
    code = main(["--config", "tiny-cpu", "--output-dir", str(tmp_path), "--max-steps", "50", *SMALL])
    assert code == 1 and time.monotonic() - started < 120
    assert "replica one fell over" in capsys.readouterr().err
    error = read_records(tmp_path / "metrics.jsonl")[-1]
    assert error["event"] == "error" and error["kind"] == "exception" and "drafter1" in error["message"]


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path, capsys):
    assert main(["--config", "tiny-cpu", "--output-dir", str(tmp_path), "--resume", *SMALL]) == 2
    assert "start without --resume" in capsys.readouterr().err


def test_help_is_for_newcomers(release, tmp_path):
    shown = run_trainer(release, tmp_path, "--help")
    assert shown.returncode == 0
    for words in ("--config", "tiny-cpu", "--resume", "--drafter-devices", "export", "--set"):
        assert words in shown.stdout
    export_help = run_trainer(release, tmp_path, "export", "--help")
    assert export_help.returncode == 0 and "DFlashDraftModel" in export_help.stdout
    wrong = run_trainer(release, tmp_path, "--config", "tiny-cpu", "--attention", "flash")
    assert wrong.returncode == 2 and "invalid choice: 'flash'" in wrong.stderr


def test_hostile_paths_are_just_paths(tmp_path, capsys):
    odd = tmp_path / "run 'a' \"b\" $(touch pwned) `id` ünï\ncode"
    code = main(["--config", "tiny-cpu", "--output-dir", str(odd), "--max-steps", "2", *SMALL])
    assert code == 0, capsys.readouterr().err
    recs = read_records(odd / "metrics.jsonl")
    assert recs[-1]["event"] == "done"
    assert Path([r for r in recs if r["event"] == "checkpoint"][-1]["path"]).parent.parent == odd
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()


def test_a_set_value_is_read_by_the_config_files_rules(tmp_path, capsys):
    """`off` is text on the command line too (YAML 1.2), so it is refused as the file would refuse it."""
    assert main(["--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"), "--set", "run.compile_lock=off"]) == 2
    err = capsys.readouterr().err
    assert "`run.compile_lock`" in err and "'off'" in err, err
    assert not (tmp_path / "run").exists()
