"""Bad input never reaches a user as a traceback: a YAML file with a control byte, `export --out`
onto a file, `eval --device cuda` without CUDA, a data file the trainer refuses. Each is one line
naming the file or flag and the fix, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.trainer.test_eval_cli import run_dir  # noqa: F401 (a fixture: a real checkpoint)
except ImportError:  # tests/trainer is not a package: pytest put it on sys.path
    from test_eval_cli import run_dir  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def run(*argv: str, module: str = "trainer") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=240)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("byte, shown", [(b"\x00", "0x00"), (b"\x07", "0x07")])
def test_a_yaml_file_with_a_control_byte_is_one_line_naming_the_line(tmp_path, byte, shown):
    config = tmp_path / "my.yaml"
    config.write_bytes(b"run:\n  max_steps: 3" + byte + b"\n")
    line = one_line(run("--config", str(config), "--output-dir", str(tmp_path / "out")))
    assert line == (f"dflash-train: error: {config}:2: character {shown} (a control byte) is not allowed in YAML; "
                    "remove it (a copy from a terminal or a binary file?)")
    inventory = tmp_path / "inv.yaml"
    inventory.write_bytes(b"targets:\n  local: {job: {workdir: /tmp/x" + byte + b"}}\n")
    line = one_line(run("--inventory", str(inventory), "status", module="dflash_ops"))
    assert line.startswith(f"dflash-ops: {inventory}:2: character {shown} (a control byte)")


def test_export_out_onto_a_file_or_under_one_is_one_line(run_dir, tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_text("x")
    line = one_line(run("export", "--checkpoint", str(run_dir), "--out", str(file)))
    assert line == f"dflash-train: error: --out {file}: is a file, not a directory; give a directory (created if missing)"
    line = one_line(run("export", "--checkpoint", str(run_dir), "--out", str(file / "export")))
    assert f"--out {file / 'export'}: lies under the file {file}, not a directory" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_eval_on_cuda_without_cuda_is_one_line_naming_the_flag(run_dir):
    line = one_line(run("eval", "--checkpoint", str(run_dir), "--device", "cuda"))
    assert line == ("dflash-train eval: error: --device names cuda but no CUDA device is visible "
                    "(a CPU build of torch?). Fix: name existing devices, or cpu")


def test_a_data_error_is_one_line_without_the_traceback(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n')
    proc = run("--config", "tiny-cpu", "--set", "data.source=jsonl", "--set", f"data.path={data}",
               "--max-steps", "2", "--output-dir", str(tmp_path / "out"))
    errors = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if "error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert errors == [f"dflash-train: error: {data}:1: loss_mask is missing. Fix: add a list of 0/1, one per "
                      "input_id (1 = train on this token)."]


def _damage(path: Path, name: str, text: str) -> None:
    (path / name).write_text(text)


CHECKPOINT_DAMAGE = [  # (file in the step dir, its text, what the one line says)
    ("config.json", "[1, 2]", "config.json is not a JSON object of config sections"),
    ("config.json", '{"target": 5}', "config.json is not a JSON object of config sections"),
    ("drafter_config.json", "[1, 2]", "drafter_config.json is not a JSON object"),
    ("drafter_config.json", '{"block_size": 8}', "missing"),
]


@pytest.mark.parametrize("name, text, said", CHECKPOINT_DAMAGE)
def test_a_damaged_checkpoint_is_one_line_for_eval_and_export(run_dir, tmp_path, name, text, said):
    import shutil

    step = tmp_path / "run" / "checkpoints" / "step-0000001"
    shutil.copytree(run_dir / "checkpoints" / "step-0000001", step)
    _damage(step, name, text)
    line = one_line(run("eval", "--checkpoint", str(tmp_path / "run"), "--device", "cpu"))
    assert line.startswith(f"dflash-train eval: error: cannot read checkpoint {step}: ") and said in line, line
    assert "Fix: pass another checkpoint" in line
    line = one_line(run("export", "--checkpoint", str(step), "--out", str(tmp_path / "export")))
    assert f"cannot read checkpoint {step}: " in line and said in line, line
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("name, text, said", [
    ("config.json", None, "KeyError: 'dflash_config'"),
    ("model.safetensors", "not safetensors", "SafetensorError"),
])
def test_a_damaged_export_is_one_line_for_eval(run_dir, tmp_path, name, text, said):
    import json
    import shutil

    export = tmp_path / "export"
    shutil.copytree(run_dir / "export", export)
    if text is None:  # the config without its dflash_config
        config = json.loads((export / name).read_text())
        del config["dflash_config"]
        text = json.dumps(config)
    _damage(export, name, text)
    line = one_line(run("eval", "--checkpoint", str(export), "--target", "tiny-random", "--device", "cpu"))
    assert line.startswith(f"dflash-train eval: error: --checkpoint {export}: a damaged export ({said}"), line
    assert "Fix: export it again" in line


def test_eval_of_a_dir_without_a_checkpoint_names_its_own_flag(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    line = one_line(run("eval", "--checkpoint", str(tmp_path / "run"), "--device", "cpu"))
    assert line.startswith(f"dflash-train eval: error: --checkpoint {tmp_path / 'run'}: no complete checkpoint in")
    assert "--resume" not in line, line


def test_eval_against_a_target_with_damaged_weights_is_one_line(run_dir, tmp_path):
    from trainer.data.target import tiny_target

    tiny_target("cpu", torch.float32, 0, None).save_pretrained(tmp_path / "target")
    (tmp_path / "target" / "model.safetensors").write_text("cut short")
    line = one_line(run("eval", "--checkpoint", str(run_dir), "--target", str(tmp_path / "target"), "--device", "cpu"))
    assert line.startswith(f"dflash-train eval: error: target.spec: cannot load a causal LM from "
                           f"'{tmp_path / 'target'}': SafetensorError: "), line


@pytest.mark.parametrize("command, flag", [
    (["data", "cache-features", "--config", "tiny-cpu", "--out"], "--out"),
    (["gate", "--steps", "2", "--work-dir"], "--work-dir"),
])
def test_an_output_dir_that_is_a_file_is_one_line_before_any_work(tmp_path, command, flag):
    """cache-features said 'failed: [Errno 17] File exists; rerun the same command to continue' (exit 1)
    after loading the target; gate printed a NotADirectoryError traceback."""
    file = tmp_path / "taken"
    file.write_text("")
    prog = "dflash-train data" if command[0] == "data" else "dflash-train gate"
    line = one_line(run(*command, str(file)))
    assert line == f"{prog}: error: {flag} {file}: is a file, not a directory; give a directory (created if missing)"
    line = one_line(run(*command, str(file / "sub")))
    assert line.startswith(f"{prog}: error: {flag} {file / 'sub'}: lies under the file {file}, not a directory")


def test_an_export_whose_weights_do_not_fit_its_config_is_one_line_exit_2(run_dir, tmp_path):
    """It said 'failed: RuntimeError: Error(s) in loading state_dict for DFlashDrafter:' (no detail), exit 1."""
    import shutil

    from safetensors.torch import load_file, save_file

    export = tmp_path / "export"
    shutil.copytree(run_dir / "export", export)
    weights = load_file(str(export / "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(export / "model.safetensors"))
    line = one_line(run("eval", "--checkpoint", str(export), "--target", "tiny-random", "--device", "cpu"))
    assert line == ("dflash-train eval: error: --checkpoint's weights do not fit its drafter config (Missing key(s) "
                    'in state_dict: "fc.weight"). Fix: export the checkpoint again, or pass another --checkpoint.')
