"""The examples in `--help` are real output: status and health are what this code prints for the
status object recorded on an H200 (benchmarks/results/gpu-ops.md), tail-log's lines are recorded
log lines that the trainer's own formatter writes again character for character."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

from click.testing import CliRunner

from dflash_ops.observe import health
from dflash_ops.observe.status import TargetStatus
from dflash_ops.observe.status_output import target_text
from dflash_ops.cli import cli
from trainer.train.metrics import step_line

RECORDING = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu-ops.md"


def recorded(command: str) -> str:
    """The output recorded after `$ dflash-ops COMMAND` (up to its `[exit N]` line)."""
    return RECORDING.read_text(encoding="utf-8").split(f"$ dflash-ops {command}\n", 1)[1].split("\n[exit", 1)[0]


def help_example(*command: str) -> tuple[str, list[str]]:
    """(the command line after `$ `, the output lines) of the example in `dflash-ops COMMAND --help`."""
    result = CliRunner().invoke(cli, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    after = result.output.split("Example", 1)[1].split(":\n", 1)[1]
    block = textwrap.dedent(after.split("\n\n", 1)[0]).splitlines()
    assert block[0].startswith("$ dflash-ops "), block
    return block[0][2:], block[1:]


def recorded_status() -> dict:
    return json.loads(recorded("status --json"))


def test_the_status_example_is_what_status_prints_for_the_recorded_state():
    line, lines = help_example("status")
    assert line == "dflash-ops status"
    assert lines == target_text(TargetStatus.from_json(recorded_status()), color=False).splitlines()


def test_the_health_example_is_what_health_prints_for_the_recorded_state():
    st = recorded_status()
    verdict = health.Verdict(st["verdict"], tuple(st["reasons"]),
                             {label: health.Perf(**perf) for label, perf in st["perfdata"].items()})
    line, lines = help_example("health")
    assert line == "dflash-ops health"
    assert lines == [health.nagios_line(st["target"], verdict)]


STEP = re.compile(r"step +(\d+)/(\d+)  loss (\S+)  acc@1 (\S+)  acc_avg (\S+)  ([\d,]+) tok/s  lr (\S+)  "
                  r"gnorm (\S+)  eta (\d+)m(\d+)s")


def test_the_tail_log_example_is_recorded_log_lines_in_the_trainers_format():
    line, lines = help_example("tail-log")
    n = int(line.split("-n ")[1])
    assert line == f"dflash-ops tail-log -n {n}" and lines == recorded("tail-log -n 20").splitlines()[-n:]
    for text in lines:
        step, total, loss, acc1, acc_avg, tps, lr, gnorm, minutes, seconds = STEP.fullmatch(text).groups()
        acc = [float(acc1), 2 * float(acc_avg) - float(acc1)]  # a mean of acc_avg with acc@1 first
        again = step_line(int(step), int(total), float(loss), acc, float(tps.replace(",", "")),
                          60 * int(minutes) + int(seconds), float(lr), float(gnorm))
        assert again == text


def test_the_readme_examples_are_recorded_output():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    for command in ("status", "health", "tail-log -n 20"):
        example = readme.split(f"$ dflash-ops {command.split(' -n')[0]}", 1)[1].split("\n```", 1)[0]
        body = list(example.splitlines()[1:])
        assert body and all(line in recorded(command).splitlines() for line in body), (command, body)
    assert not re.search(r"age_s=-", readme)  # ages are clamped at 0
