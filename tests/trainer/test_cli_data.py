"""`dflash-train data`'s exit codes and last line for each way a command can end (trainer/cli/data.py):
what ops and shell scripts read to decide whether to rerun, resume or give up."""

from __future__ import annotations

import pytest

from trainer.cli import data as cli_data
from trainer.config import ConfigError

REGENERATE = ["regenerate", "--target", "tiny-random", "--in", "in.jsonl", "--out", "out.jsonl"]
CACHE = ["cache-features", "--config", "tiny-cpu", "--out", "cache"]


def ending(monkeypatch, capsys, argv, raised):
    """Run `dflash-train data ARGV` with its command raising `raised`: (exit code, stderr lines)."""

    def command(args):
        raise raised

    monkeypatch.setattr(cli_data, "_regenerate", command)
    monkeypatch.setattr(cli_data, "_cache_features", command)
    code = cli_data.main(argv)
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (
            KeyboardInterrupt(),
            130,
            "dflash-train data: interrupted; rerun the same command to continue{resume}",
        ),
        (
            cli_data.Terminated(),
            143,
            "dflash-train data: interrupted; rerun the same command to continue{resume}",
        ),
        (
            OSError(28, "No space left on device"),
            1,
            "dflash-train data: failed: [Errno 28] No space left on device; rerun the same command to continue{resume}",
        ),
        (RuntimeError("the target broke"), 1, "dflash-train data: failed: RuntimeError: the target broke"),
        (RuntimeError("CUDA out of memory.\nTried to allocate 2 GiB"), 1, "dflash-train data: failed: RuntimeError: CUDA out of memory."),
        (
            ConfigError("--batch-size must be at least 1"),
            2,
            "dflash-train data: error: --batch-size must be at least 1",
        ),
    ],
)
@pytest.mark.parametrize("argv, resume", [(REGENERATE, " with --resume"), (CACHE, "")])
def test_each_ending_has_its_exit_code_and_one_line(monkeypatch, capsys, raised, code, line, argv, resume):
    assert ending(monkeypatch, capsys, argv, raised) == (code, [line.format(resume=resume)])


def test_stop_reasons_are_named_as_people_say_them():
    assert cli_data._why(cli_data.Terminated()) == "SIGTERM"
    assert cli_data._why(KeyboardInterrupt()) == "interrupted"
    assert cli_data._why(ValueError("bad row")) == "ValueError: bad row"
    assert cli_data._why(ValueError("bad row\n  at line 3")) == "ValueError: bad row"


def test_sigterm_becomes_an_interrupt_only_inside_the_block_and_only_in_the_main_thread():
    import signal
    import threading

    def before(signum, frame):  # the suite's own handler, so a broken block cannot end the test run
        raise AssertionError("SIGTERM reached the handler from before the block")

    outer = signal.signal(signal.SIGTERM, before)
    try:
        with pytest.raises(cli_data.Terminated):
            with cli_data._sigterm_as_interrupt():
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is before, "the previous handler is back"
    finally:
        signal.signal(signal.SIGTERM, outer)
    seen = []

    def elsewhere():
        with cli_data._sigterm_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [outer], "a library caller's thread leaves signals alone"
