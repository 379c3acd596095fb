"""dflash-train input errors: one line naming the flag or path and the fix, exit 2, before torch loads."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs the CLI in a fresh interpreter and reports whether torch got imported on the way.
PROBE = """
import json, sys
from trainer.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


def cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env,
                          timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["rc"], result["torch"], proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["--config", "tiny-cpu", "--max-steps", "-5"], "argument --max-steps: must be at least 1, got -5"),
    (["--config", "tiny-cpu", "--max-steps", "many"], "argument --max-steps: expected a whole number"),
    (["--config", "no-such-config"], "config file 'no-such-config' not found"),
    (["--config", "tiny-cpu", "--set", "train.precision=fp16"], "`train.precision` must be one of fp32, bf16-mixed"),
    (["--config", "tiny-cpu", "--output-dir", "/proc/forbidden"],
     "output dir '/proc/forbidden' (--output-dir / run.output_dir): cannot create it"),
    (["export", "--checkpoint", "/nonexistent", "--out", "x"], "--checkpoint /nonexistent: no such file or directory"),
    (["--config", "tiny-cpu", "--output-dir", "{tmp}/run", "--resume"], "--resume latest: no checkpoint in"),
    # was `training failed: [Errno 21] Is a directory`, exit 1, after torch had loaded
    (["--config", "tiny-cpu", "--output-dir", "{tmp}/run", "--metrics-file", "{tmp}"],
     "metrics file '{tmp}' (--metrics-file / run.metrics_file): is a directory. Fix: name a file"),
    (["--config", "tiny-cpu", "--output-dir", "{tmp}"], "metrics file '{tmp}/metrics.jsonl' (--metrics-file"),
])
def test_input_errors_are_one_line_exit_2_and_come_before_torch(args, expected, tmp_path):
    if "metrics.jsonl" in expected:  # the default metrics file, a directory
        (tmp_path / "metrics.jsonl").mkdir()
    rc, torch_loaded, stderr = cli(*[arg.replace("{tmp}", str(tmp_path)) for arg in args])
    expected = expected.replace("{tmp}", str(tmp_path))
    assert rc == 2
    assert stderr.count("\n") == 1 and stderr.startswith("dflash-train"), stderr
    assert expected in stderr, stderr
    assert "Fix" in stderr or "--help" in stderr
    assert not torch_loaded  # so the message appears in well under a second


def test_an_output_dir_that_is_a_file_says_so(tmp_path):
    (tmp_path / "run").write_text("")
    _, _, stderr = cli("--config", "tiny-cpu", "--output-dir", str(tmp_path / "run"))
    assert f"output dir '{tmp_path / 'run'}' (--output-dir / run.output_dir): is a file. Fix: " in stderr, stderr


def test_output_dir_error_names_the_fix():
    _, _, stderr = cli("--config", "tiny-cpu", "--output-dir", "/proc/forbidden")
    assert "Fix: pass a directory you can write to" in stderr


def test_export_of_a_missing_path_suggests_only_export_flags(tmp_path):
    _, _, stderr = cli("export", "--checkpoint", "/nonexistent", "--out", str(tmp_path / "x"))
    flags = {word.strip(".,()") for word in stderr.split() if word.startswith("--")}
    assert flags <= {"--checkpoint", "--out", "--dtype", "--help"}, stderr
    assert not (tmp_path / "x").exists()


def test_export_of_a_run_without_checkpoints_says_so(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    rc, torch_loaded, stderr = cli("export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "x"))
    assert rc == 2 and not torch_loaded
    assert "no complete checkpoint in" in stderr and "--resume" not in stderr


def test_written_weights_follow_the_umask(tmp_path):
    from trainer.cli.main import main

    common = ["--config", "tiny-cpu", "--max-steps", "1", "--output-dir", str(tmp_path / "run"),
              "--set", "data.seq_len=32", "--set", "data.synthetic.num_samples=16", "--set", "train.epochs=30", "--set", "train.batch_size=2",
              "--set", "train.num_anchors=6", "--set", "run.torch_threads=1"]
    previous = os.umask(0o022)
    try:
        assert main(common) == 0
        assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    finally:
        os.umask(previous)
    step = tmp_path / "run" / "checkpoints" / "step-0000001"
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [*step.iterdir(), *(tmp_path / "export").iterdir()]
             if p.is_file()}
    assert set(modes.values()) == {"0o644"}, modes
    assert {"drafter.safetensors", "model.safetensors", "config.json"} <= set(modes)


def test_a_mistyped_subcommand_is_named_with_the_closest_one():
    rc, torch_loaded, err = cli("expor", "--checkpoint", "runs/tiny", "--out", "x")
    assert rc == 2 and not torch_loaded
    assert "unknown command 'expor' (did you mean 'export'?)" in err and "--config" not in err.split(";")[0]
    rc, _, err = cli("frobnicate")
    assert rc == 2 and "unknown command 'frobnicate'; commands: export, data, eval" in err


# --------------------------------------------------------------------------- run_command, in process


class BadInput(Exception):
    exit_code = 3


class Wrapped(Exception):
    """What a worker thread's failure looks like: the exception it carries as `original`."""

    def __init__(self, original):
        super().__init__("a worker failed")
        self.original = original


def test_bad_input_is_one_line_with_its_exit_code_and_a_wrapped_one_counts_too():
    from trainer.cli.errors import run_command

    for raised in (BadInput("data.path: no such file"), Wrapped(BadInput("data.path: no such file"))):
        err = io.StringIO()

        def command(raised=raised):
            raise raised

        assert run_command("dflash-train data", command, err=err) == 3
        assert err.getvalue() == "dflash-train data: error: data.path: no such file\n"


def test_anything_else_propagates_and_a_command_that_returns_gives_its_status():
    from trainer.cli.errors import input_error, run_command

    def broken():
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_command("dflash-train", broken, err=io.StringIO())
    assert run_command("dflash-train", lambda: 0) == 0 and run_command("dflash-train", lambda: 5) == 5
    not_int = type("NotInt", (Exception,), {"exit_code": "2"})
    assert input_error(not_int()) is None and input_error(Wrapped(ValueError())) is None
