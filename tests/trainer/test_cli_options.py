"""The small pieces every `dflash-train` command stands on: its option checks (refused before any work,
one line naming the flag), the --set reader, crash-safe writes, file modes and the block size's floor."""

from __future__ import annotations

import argparse
import os
import stat

import pytest
import torch

from trainer.atomic import write_atomic
from trainer.block_size import MIN_BLOCK_SIZE, block_size_problem
from trainer.cli import options
from trainer.config import ConfigError, load_config
from trainer.files import current_umask, follow_umask


def test_out_dir_is_refused_when_it_or_a_parent_is_a_file(tmp_path):
    options.check_out_dir(str(tmp_path / "new" / "deeper"))  # missing: created later
    options.check_out_dir(str(tmp_path))
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"--out .*weights.bin: is a file, not a directory"):
        options.check_out_dir(str(a_file))
    with pytest.raises(ConfigError, match=rf"--out .*: lies under the file {a_file}, not a directory"):
        options.check_out_dir(str(a_file / "export"))


@pytest.mark.parametrize("visible, devices, problem", [
    (0, ["cpu"], None),
    (0, ["cuda"], "names cuda but no CUDA device is visible (a CPU build of torch?)"),
    (1, ["cuda", "cuda:0"], None),
    (2, ["cuda:0", "cuda:2", "cpu", "cuda:3"], "names cuda:2, cuda:3 but 2 CUDA device(s) are visible"),
])
def test_cuda_devices_named_must_exist_here(monkeypatch, visible, devices, problem):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if problem is None:
        options.check_cuda_devices("--devices", devices)
        return
    with pytest.raises(ConfigError) as caught:
        options.check_cuda_devices("--devices", devices)
    assert str(caught.value) == f"--devices {problem}. Fix: name existing devices, or cpu"


def test_counts_and_temperature_are_checked_by_name():
    options.check_at_least_one(("--batch-size", 1), ("--max-new-tokens", 64))
    with pytest.raises(ConfigError, match=r"^--max-new-tokens must be at least 1, got 0$"):
        options.check_at_least_one(("--batch-size", 4), ("--max-new-tokens", 0))
    options.check_temperature(0.0)
    with pytest.raises(ConfigError, match=r"^--temperature must be >= 0, got -0.5$"):
        options.check_temperature(-0.5)


def _args(*sets: str, **flags) -> argparse.Namespace:
    return argparse.Namespace(set=list(sets), **flags)


def test_set_values_follow_the_config_files_rules_and_flags_win_by_short_name():
    got = options.overrides_from_args(_args(
        "train.lr=3e-4", " eval.every = 0", "run.note=off", "data.path=a=b.jsonl",
        max_steps=7, resume=None, output_dir="/tmp/o"))
    # YAML 1.1 reads 3e-4 (no dot) as text, as in a config file; the typed config makes it the float
    assert got == {"train.lr": "3e-4", "eval.every": 0, "run.note": "off", "data.path": "a=b.jsonl",
                   "max_steps": 7, "output_dir": "/tmp/o"}
    assert "resume" not in got  # a flag not given sets nothing
    assert load_config("tiny-cpu", {"train.lr": got["train.lr"]}).train.lr == 3e-4


@pytest.mark.parametrize("item", ["train.lr", "=3", "  =x"])
def test_a_set_without_key_and_value_is_refused_with_an_example(item):
    with pytest.raises(ConfigError, match=r"expected KEY=VALUE, e\.g\. --set train\.lr=3e-4"):
        options.overrides_from_args(_args(item))


def test_a_usage_error_is_one_line_exit_2(capsys):
    parser = options.command_parser("dflash-train demo", "demo")
    parser.add_argument("--count", type=int)
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--count", "many"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-train demo: error: argument --count")
    assert err.endswith("See dflash-train demo --help\n")


def test_an_atomic_write_leaves_the_old_file_whole_when_it_fails_before_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomic(str(path), "old")
    write_atomic(str(path), "new")
    assert path.read_text() == "new" and not (tmp_path / "state.json.tmp").exists()

    def no_rename(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        write_atomic(str(path), "half")
    assert path.read_text() == "new"


def test_files_the_trainer_writes_follow_the_umask(tmp_path):
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"")
        os.chmod(path, 0o600)  # as safetensors creates it
        follow_umask(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(before)


def test_the_block_needs_an_anchor_and_something_to_draft():
    assert block_size_problem(MIN_BLOCK_SIZE) is None and block_size_problem(16) is None
    assert block_size_problem(1) == "must be >= 2 (position 0 is the anchor), got 1"
