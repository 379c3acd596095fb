"""User playbooks: a YAML list of library steps with literal parameters, checked against the step
functions' signatures before anything runs; the run records each step, halts at the first failure
and, under dry-run, reaches nothing.

The steps here are small real steps (they run real bash through ctx.run); the engine sees only the
library it is given.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ops.job import model
from dflash_ops.errors import InputError, RemoteCommandError, StepFailed
from dflash_ops.job.model import Job
from dflash_ops.act.context import DryRunTransport, StepContext, StepOutcome
from dflash_ops.act.runner import DRY_RUN, FAILED, NOT_RUN, OK, SKIPPED, RunResult
from dflash_ops.playbook.signature import describe, inputs_of
from dflash_ops.playbook.user import (
    bind_options, list_playbooks, load, parse_option_assignments, run_playbook, search_dirs,
)
from dflash_ops.cli.progress_view import format_progress
from dflash_ops.transport.base import Result, Transport

HOSTILE = "a b 'single' \"double\" $(touch pwned) `touch pwned2` $HOME ; rm -rf x\nline2 ünï €"


class BashTransport(Transport):
    """A real local bash in `cwd`, counting what it is asked to do."""

    def __init__(self, name: str, cwd: Path):
        super().__init__(name)
        self.cwd, self.calls = cwd, 0

    def run(self, script, timeout=60, step="run", stdin=None):
        self.calls += 1
        started = time.monotonic()
        p = subprocess.run(["bash", "-c", script], cwd=self.cwd, input=stdin, capture_output=True, timeout=timeout)
        return Result(p.returncode, p.stdout.decode(), p.stderr.decode(), time.monotonic() - started)

    def put(self, data, remote_path, mode=0o644, step="put"):
        self.calls += 1
        Path(self.cwd, remote_path).write_bytes(data)

    def interactive(self, script):
        return subprocess.call(["bash", "-c", script])

    def command_line(self, script, timeout=60):
        return "bash -c " + shlex.quote(script)


# ----------------------------------------------------------------------------------- the test library
# Module-level, so their annotations resolve as the library's do.

@dataclasses.dataclass(kw_only=True)
class Noted(StepOutcome):
    text: str


def note(ctx: StepContext, text: str) -> Noted:
    """Append `text` to ./journal."""
    ctx.run(f"printf '%s\\n' {shlex.quote(text)} >> journal")
    return Noted(message=f"noted {text}", text=text)


def write_file(ctx: StepContext, path: str, content: str) -> str:
    ctx.run(f"printf '%s' {shlex.quote(content)} > {shlex.quote(path)}")
    return f"wrote {path}"


def fail(ctx: StepContext, how: str = "raise") -> StepOutcome | str:
    if how == "raise":
        raise StepFailed(f"[{ctx.target_name}] {ctx.step}: the disk is full")
    if how == "remote":
        ctx.run("echo 'no space left' >&2; exit 3")
    if how == "return":
        return StepOutcome.failed("GPU 2 still holds 4000 MiB")
    if how == "bug":
        return {}["missing"]
    return "did not fail"


def sleep(ctx: StepContext, seconds: float) -> str:
    ctx.run(f"sleep {seconds}")
    return f"slept {seconds:g}"


def record(ctx: StepContext, value: str = "", gpus: list[int] | None = None, number: float = 0.0,
           flag: bool = False) -> StepOutcome:
    return StepOutcome("recorded", data={"value": value, "gpus": gpus, "number": number, "flag": flag})


def rogue(ctx: StepContext) -> str:
    ctx.transport.run("touch rogue-ran")  # past ctx.run, straight to the transport
    ctx.transport.put(b"x", "rogue-put")
    return "touched"


def log_twice(ctx: StepContext) -> str:
    ctx.log("first line")
    ctx.log("second line")
    return "logged"


def use_result(ctx: StepContext, noted: Noted, prefix: str = "earlier note said") -> str:
    return f"{prefix} {noted.text}"


def session_of(ctx: StepContext, job: Job) -> str:
    return f"the job's session is {job.session}"


LIBRARY = {f.__name__: f for f in (note, write_file, fail, sleep, record, rogue, log_twice, use_result, session_of)}


def make_target(tmp_path: Path, **job_overrides) -> model.Target:
    fields = dict(workdir=str(tmp_path / "work"), python=sys.executable, config="tiny-cpu", session="dflash",
                  cache_dir=str(tmp_path / "cache"), target_gpus=(0,), drafter_gpus=(1, 2))
    return model.Target(name="box", transport="local", job=model.Job(**{**fields, **job_overrides}))


def make_ctx(tmp_path: Path, dry_run: bool = False, **job_overrides) -> StepContext:
    bash = BashTransport("box", tmp_path)
    return StepContext(make_target(tmp_path, **job_overrides), DryRunTransport(bash) if dry_run else bash)


def pb(text: str, tmp_path: Path, name: str = "test") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def play(tmp_path: Path, text: str, options=None, ctx=None, events=None) -> RunResult:
    book = load(str(pb(text, tmp_path)), [], LIBRARY)
    bound = bind_options(book, LIBRARY, options or {})
    return run_playbook(book, LIBRARY, ctx or make_ctx(tmp_path), bound, events.append if events is not None else None)


def journal(tmp_path: Path) -> list[str]:
    path = tmp_path / "journal"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def invalid(tmp_path: Path, text: str, options=None) -> str:
    """The one-line InputError (exit 2) for a playbook that must be refused before anything runs."""
    path = pb(text, tmp_path)
    with pytest.raises(InputError) as info:
        bind_options(load(str(path), [], LIBRARY), LIBRARY, options or {})
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message, message
    assert str(path) in message, "the message names the playbook file"
    assert journal(tmp_path) == []
    return message


# ----------------------------------------------------------------------------------- signatures

def test_a_steps_signature_says_what_the_file_gives_it_and_what_the_run_gives_it():
    info = inputs_of(use_result)
    assert dict(info.literals) == {"prefix": str} and dict(info.results) == {"noted": Noted}
    assert info.required == {"noted"} and info.job is None and info.gives is None
    assert inputs_of(session_of).job == "job" and inputs_of(note).gives is Noted
    assert describe("use_result", use_result) == "use_result(prefix: str = 'earlier note said') takes Noted"
    assert describe("note", note) == "note(text: str) gives Noted"
    assert describe("session_of", session_of) == "session_of()"  # the job comes from the run


def test_every_library_step_can_be_named_in_a_playbook():
    from dflash_ops.act import library, steps

    assert all(name == step.__name__ for name, step in library.LIBRARY.items())
    givers = {inputs_of(step).gives for step in library.LIBRARY.values()}
    for name, step in library.LIBRARY.items():
        info = inputs_of(step)
        assert info.job == "job", f"{name} takes the job"
        assert set(info.results.values()) <= givers, f"{name} takes a result no library step gives"
        assert describe(name, step).startswith(f"{name}(")
    assert describe("wait_first_step", steps.wait_first_step) == (
        "wait_first_step(timeout_s: float, poll_s: float = 1.0) takes Launched")
    assert describe("launch", steps.launch) == "launch(resume: bool) gives Launched"


# ----------------------------------------------------------------------------------- checked before running

def test_unknown_step_names_file_line_and_the_closest_name(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: note\n    params: {text: a}\n  - step: wirte_file\n")
    assert f"{tmp_path / 'test.yaml'}:4: step 2 (wirte_file): unknown step (did you mean 'write_file'?)" in msg


def test_unknown_parameter_suggests_the_closest_and_lists_the_known(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: sleep\n    params: {secnds: 1}\n")
    assert ":2: step 1 (sleep): unknown parameter 'secnds' (did you mean 'seconds'?); it takes seconds" in msg


def test_missing_required_parameter_is_named(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: write_file\n    params: {path: /x}\n")
    assert "step 1 (write_file): params.content is missing; add `content: VALUE` under params:" in msg


@pytest.mark.parametrize("params, expected", [
    ("{seconds: soon}", "params.seconds: expected float, got 'soon'"),
    ("{seconds: true}", "params.seconds: expected float, got True"),
    ("{seconds: [1]}", "params.seconds: expected float, got [1]"),
])
def test_mistyped_literal_parameter(tmp_path, params, expected):
    assert expected in invalid(tmp_path, f"steps:\n  - step: sleep\n    params: {params}\n")


def test_mistyped_list_element(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: record\n    params: {gpus: [0, two]}\n")
    assert "params.gpus: expected list[int] | None, got [0, 'two']" in msg


def test_literals_of_the_right_type_are_taken(tmp_path):
    result = play(tmp_path, "steps:\n  - step: record\n    params: {value: x, gpus: [1, 2], number: 3, flag: true}\n")
    assert result.ok and result.steps[0].data == {"value": "x", "gpus": [1, 2], "number": 3, "flag": True}


@pytest.mark.parametrize("text, expected", [
    ("", "write `steps:`"),
    ("- step: note\n", "write `steps:`"),
    ("stepz: []\n", "write `steps:`"),
    ("description: x\n", "`steps:` must be a list of one step or more"),
    ("steps: note\n", "`steps:` must be a list of one step or more"),
    ("steps: []\n", "`steps:` must be a list of one step or more"),
    ("steps:\n  - step: note\n    params: {text: [unclosed\n", "not valid YAML"),
    ("steps:\n  - 42\n", ":2: step 1: write a step name, or `step: NAME` with `params:` and `when:`"),
    ("steps:\n  - note: {text: a}\n", ":2: step 1: write a step name, or `step: NAME`"),
    ("steps:\n  - step: note\n    with: {text: a}\n", ":2: step 1 (note): write a step name, or `step: NAME`"),
    ("steps:\n  - step: note\n    params: [a]\n", "step 1 (note): params: write NAME: VALUE for each; it takes note("),
    ("steps:\n  - step: note\n    params: {text: a}\n    when: options.purge and x\n",
     "step 1 (note): when: write `options.NAME` or `not options.NAME`, NAME under options:"),
    ("steps:\n  - step: note\n    params: {text: a}\n    when: options.purge\n", "NAME under options:"),
    ("steps:\n  - step: note\n    params: {text: a}\n    when: purge\n", "write `options.NAME`"),
    ("options: {purge: {type: bool}}\nsteps: [log_twice]\n", "options: write NAME: DEFAULT for each"),
    ("options: {limit: null}\nsteps: [log_twice]\n", "options: write NAME: DEFAULT for each"),
    ("steps:\n  - step: note\n    step: fail\n", ":3: key 'step' under steps is defined twice (also on line 2)"),
])
def test_structural_problems(tmp_path, text, expected):
    assert expected in invalid(tmp_path, text)


def test_a_result_no_earlier_step_gives_is_refused_before_anything_runs(tmp_path):
    path = tmp_path / "test.yaml"
    msg = invalid(tmp_path, "steps:\n  - use_result\n  - step: note\n    params: {text: after}\n")
    assert msg == (f"{path}:2: step 1 (use_result): noted is what an earlier note step gives, and none runs "
                   "before it; add one, or the same `when:`")


def test_a_result_whose_giver_is_skipped_is_refused_before_anything_runs(tmp_path):
    text = ("options: {loud: false}\nsteps:\n  - step: note\n    when: options.loud\n    params: {text: hello}\n"
            "  - use_result\n")
    msg = invalid(tmp_path, text)
    assert ":6: step 2 (use_result): noted is what an earlier note step gives, and none runs before it" in msg
    result = play(tmp_path, text, {"loud": "true"})
    assert result.ok and result.steps[1].message == "earlier note said hello"


# ----------------------------------------------------------------------------------- options

OPTIONS_PB = """
options:
  purge: true
  timeout: 900.0
  retries: 3
  label: plain
steps:
  - log_twice
"""


def test_bind_options_defaults_overrides_and_text(tmp_path):
    book = load(str(pb(OPTIONS_PB, tmp_path)), [], LIBRARY)
    assert bind_options(book, LIBRARY, {}) == {"purge": True, "timeout": 900.0, "retries": 3, "label": "plain"}
    assert bind_options(book, LIBRARY, {"purge": None, "timeout": 5}) == \
        {"purge": True, "timeout": 5.0, "retries": 3, "label": "plain"}
    given = parse_option_assignments(["purge=false", "timeout=7.5", "retries=4", "label=a=b"])
    assert bind_options(book, LIBRARY, given) == {"purge": False, "timeout": 7.5, "retries": 4, "label": "a=b"}


@pytest.mark.parametrize("given, expected", [
    ({"prune": False}, "option 'prune': not in {path} (did you mean 'purge'?); it has purge, timeout, retries, label"),
    ({"purge": "perhaps"}, "option 'purge': expected bool, got 'perhaps'"),
    ({"purge": "off"}, "option 'purge': expected bool, got 'off'"),
    ({"timeout": "soon"}, "option 'timeout': expected float, got 'soon'"),
    ({"timeout": True}, "option 'timeout': expected float, got True"),
    ({"retries": "2.5"}, "option 'retries': expected int, got 2.5"),
])
def test_bad_options(tmp_path, given, expected):
    book = load(str(pb(OPTIONS_PB, tmp_path)), [], LIBRARY)
    with pytest.raises(InputError) as info:
        bind_options(book, LIBRARY, given)
    assert expected.format(path=book.source) in str(info.value) and info.value.exit_code == 2


def test_option_assignment_syntax():
    with pytest.raises(InputError, match="write NAME=VALUE"):
        parse_option_assignments(["purge"])


# ----------------------------------------------------------------------------------- running

SEQUENCE = """
steps:
  - step: note
    params: {text: one}
  - step: note
    params: {text: two}
  - step: note
    params: {text: three}
"""


def test_steps_run_in_file_order_and_reordering_needs_no_python(tmp_path):
    result = play(tmp_path, SEQUENCE)
    assert result.ok and [s.status for s in result.steps] == [OK, OK, OK]
    assert journal(tmp_path) == ["one", "two", "three"]
    (tmp_path / "journal").unlink()
    reordered = SEQUENCE.replace("text: one", "text: @").replace("text: three", "text: one").replace("text: @", "text: three")
    play(tmp_path, reordered)
    assert journal(tmp_path) == ["three", "two", "one"]


def test_bare_step_name_takes_default_parameters(tmp_path):
    assert play(tmp_path, "steps:\n  - fail\n").failed.message == "[box] fail: the disk is full"  # how=raise


def test_the_job_comes_from_the_target(tmp_path):
    result = play(tmp_path, "steps:\n  - session_of\n", ctx=make_ctx(tmp_path, session="train"))
    assert result.steps[0].message == "the job's session is train"


WHEN_PB = """
options:
  purge: true
  deploy: true
steps:
  - step: note
    params: {text: stop}
  - step: note
    when: options.purge
    params: {text: purge}
  - step: note
    when: not options.purge
    params: {text: kept-cache}
  - step: note
    when: options.deploy
    params: {text: deploy}
"""


@pytest.mark.parametrize("options, ran", [
    ({}, ["stop", "purge", "deploy"]),
    ({"purge": False}, ["stop", "kept-cache", "deploy"]),
    ({"purge": "false", "deploy": False}, ["stop", "kept-cache"]),
])
def test_when_skips_steps(tmp_path, options, ran):
    result = play(tmp_path, WHEN_PB, options)
    assert journal(tmp_path) == ran
    assert result.ok and sum(s.status == OK for s in result.steps) == len(ran)
    skipped = [s for s in result.steps if s.status == SKIPPED]
    assert len(skipped) == 4 - len(ran)
    reasons = {"purge": "options.purge is false", "kept-cache": "options.purge is true",
               "deploy": "options.deploy is false"}
    texts = ["stop", "purge", "kept-cache", "deploy"]
    assert [s.message for s in skipped] == [reasons[texts[s.number - 1]] for s in skipped]
    assert [s.number for s in result.steps] == [1, 2, 3, 4]


FAILING = """
steps:
  - step: note
    params: {text: before}
  - step: fail
    params: {how: HOW}
  - step: note
    params: {text: after}
  - step: note
    params: {text: later}
"""


@pytest.mark.parametrize("how, message", [
    ("raise", "[box] fail: the disk is full"),
    ("remote", "[box] fail: exit code 3\n  remote stderr: no space left"),
    ("return", "GPU 2 still holds 4000 MiB"),
    ("bug", "KeyError: 'missing'"),
])
def test_stops_at_the_first_failure(tmp_path, how, message):
    events = []
    book = load(str(pb(FAILING.replace("HOW", how), tmp_path, "failing")), [], LIBRARY)
    result = run_playbook(book, LIBRARY, make_ctx(tmp_path), bind_options(book, LIBRARY, {}), events.append)
    assert journal(tmp_path) == ["before"]
    assert [s.status for s in result.steps] == [OK, FAILED, NOT_RUN, NOT_RUN]
    assert not result.ok and result.exit_code == 1 and result.failed.number == 2
    assert result.failed.message == message
    assert result.summary().startswith("[box] failing: FAILED at step 2/4 fail after ")
    assert result.summary().endswith(message)
    if how == "remote":  # the error object travels with the report, as raised by the transport
        assert isinstance(result.failed.error, RemoteCommandError) and result.failed.error.result.exit_code == 3
    ends = [e for e in events if e.event == "end"]
    assert [e.report.status for e in ends] == [OK, FAILED, NOT_RUN, NOT_RUN]
    assert [e.step for e in events if e.event == "start"] == ["note", "fail"]


def test_progress_lines_show_position_status_time_and_message(tmp_path):
    text = ("options: {more: false}\nsteps:\n  - step: sleep\n    params: {seconds: 0.3}\n  - log_twice\n"
            "  - step: note\n    params: {text: x}\n    when: options.more\n")
    events = []
    result = play(tmp_path, text, events=events)
    assert 0.3 <= result.steps[0].seconds < 2.5 and result.seconds >= result.steps[0].seconds
    lines = [format_progress(e) for e in events]
    assert lines[0] == "[1/3] sleep ..."
    assert lines[1].startswith("[1/3] sleep ... ok (0.") and lines[1].endswith("s) slept 0.3")
    assert lines[2:5] == ["[2/3] log_twice ...", "      first line", "      second line"]
    assert lines[5].startswith("[2/3] log_twice ... ok (0.0s) logged")
    assert lines[6] == "[3/3] note ... skipped (options.more is false)"
    assert format_progress(events[0], with_target=True) == "[box] [1/3] sleep ..."


READS_NOTE = """
steps:
  - step: note
    params: {text: first}
  - step: note
    params: {text: hello}
  - step: use_result
    params: {prefix: "the latest note said"}
"""


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_later_step_takes_what_an_earlier_one_gave(tmp_path, dry_run):
    result = play(tmp_path, READS_NOTE, ctx=make_ctx(tmp_path, dry_run=dry_run))
    assert result.ok, result.summary()
    assert result.steps[2].message == "the latest note said hello"
    assert result.steps[1].data == {"text": "hello"}  # a result's typed fields are in its report


def test_a_run_lists_its_whole_plan_and_refuses_a_step_out_of_it(tmp_path):
    from dflash_ops.act.runner import Run

    with Run("check", make_ctx(tmp_path), ["note", "log_twice", "sleep"]) as run:
        run(note, "one")
        for wrong in (sleep, note):  # a bug in the caller: refused before anything of the step runs
            with pytest.raises(RuntimeError, match=rf"step {wrong.__name__} is not step 2 of its plan"):
                run(wrong, "two")
        run(log_twice)
    assert journal(tmp_path) == ["one"]
    assert [s.status for s in run.result().steps] == [OK, OK, NOT_RUN]


def test_a_failed_step_ends_the_run_and_the_rest_of_the_plan_is_not_run(tmp_path):
    from dflash_ops.act.runner import Run

    with Run("check", make_ctx(tmp_path), ["fail", "note"]) as run:
        run(fail, how="return")
        run(note, "never")
    result = run.result()
    assert [s.status for s in result.steps] == [FAILED, NOT_RUN] and journal(tmp_path) == []


def test_steps_get_no_other_input_than_their_arguments():
    fields = {f.name for f in dataclasses.fields(StepContext)}
    assert not fields & {"options", "results", "job"}, fields


# ----------------------------------------------------------------------------------- dry run

def test_dry_run_reports_exact_commands_and_touches_nothing(tmp_path):
    target_file = tmp_path / "out file.txt"
    text = f"steps:\n  - step: note\n    params: {{text: noted}}\n  - step: write_file\n" \
           f"    params: {{path: {json.dumps(str(target_file))}, content: {json.dumps(HOSTILE)}}}\n"
    dry = make_ctx(tmp_path, dry_run=True)
    events = []
    result = play(tmp_path, text, ctx=dry, events=events)
    assert result.ok and result.dry_run and [s.status for s in result.steps] == [DRY_RUN, DRY_RUN]
    script = f"printf '%s' {shlex.quote(HOSTILE)} > {shlex.quote(str(target_file))}"
    assert result.steps[1].commands == ("bash -c " + shlex.quote(script),)
    assert not target_file.exists() and journal(tmp_path) == [] and dry.transport.real.calls == 0
    assert "      $ bash -c " in format_progress(events[-1])
    # The command it reported is the one a real run executes: run it for real and compare.
    real = make_ctx(tmp_path)
    result = play(tmp_path, text, ctx=real)
    assert result.steps[1].commands == ("bash -c " + shlex.quote(script),)
    assert target_file.read_text(encoding="utf-8") == HOSTILE and real.transport.calls == 2


class Untouchable(BashTransport):
    """A transport that fails the test if anything reaches it but a description of a command."""

    def run(self, *args, **kwargs):
        raise AssertionError(f"a command ran during --dry-run: {args[:1]}")

    def put(self, *args, **kwargs):
        raise AssertionError(f"a file was written during --dry-run: {args[1:2]}")

    def run_on_host(self, *args, **kwargs):
        raise AssertionError(f"a host command ran during --dry-run: {args[:1]}")

    def hold(self, *args, **kwargs):
        raise AssertionError("a lock was taken during --dry-run")


def test_under_dry_run_even_a_step_that_goes_past_ctx_run_reaches_nothing(tmp_path):
    text = "steps:\n  - rogue\n  - step: note\n    params: {text: after}\n"
    ctx = StepContext(make_target(tmp_path), DryRunTransport(Untouchable("box", tmp_path)))
    result = play(tmp_path, text, ctx=ctx)
    assert [s.status for s in result.steps] == [DRY_RUN, DRY_RUN], result.summary()
    assert not (tmp_path / "rogue-ran").exists() and not (tmp_path / "rogue-put").exists()
    # Outside dry-run the same step does act: the transport, not the step, kept the file from appearing.
    play(tmp_path, text)
    assert (tmp_path / "rogue-ran").exists() and (tmp_path / "rogue-put").exists()


@pytest.mark.parametrize("command, options", [
    ("relaunch", {}), ("relaunch", {"purge": False, "deploy": False, "resume": False}), ("stop", {}),
    ("gpu_clean", {}), ("gpu_clean", {"force": True}), ("purge_cache", {}), ("deploy", {}),
    ("rollback", {"release": "0.1.0-abcdef012345"}),
])
def test_no_command_acts_under_dry_run(tmp_path, monkeypatch, command, options):
    """Every real step of every command, against a transport that fails if anything reaches it."""
    from dflash_ops import commands
    from dflash_ops.transport import factory

    monkeypatch.setattr(factory, "make_transport", lambda target: Untouchable(target.name, tmp_path))
    result = getattr(commands, command)(make_target(tmp_path), dry_run=True, **options)
    assert result.ok and result.dry_run, result.summary()
    assert {s.status for s in result.steps} <= {DRY_RUN, SKIPPED}
    assert all(s.commands for s in result.steps if s.status == DRY_RUN)
    assert not (tmp_path / "work").exists()


def test_hostile_literals_are_data_not_shell(tmp_path, monkeypatch):
    """A value that looks like a shell expansion or a template arrives byte for byte."""
    monkeypatch.chdir(tmp_path)
    sneaky = HOSTILE + " {job.workdir} {{ }"
    out = tmp_path / "got"
    text = f"steps:\n  - step: write_file\n    params: {{path: {json.dumps(str(out))}, content: {json.dumps(sneaky)}}}\n"
    result = play(tmp_path, text)
    assert result.ok, result.summary()
    assert out.read_text(encoding="utf-8") == sneaky
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


# ----------------------------------------------------------------------------------- finding playbooks

def test_the_example_in_the_readme_is_a_valid_playbook(tmp_path):
    from dflash_ops.act import library

    readme = (Path(__file__).resolve().parent.parent / "playbooks" / "README.md").read_text(encoding="utf-8")
    example = pb(readme.split("```yaml\n", 1)[1].split("```", 1)[0], tmp_path, "example")
    book = load(str(example), [], library.LIBRARY)
    assert [e.step for e in book.steps] == ["stop_session", "mark_stopped", "kill_gpu_processes", "wait_gpu_free",
                                            "purge_cache"]
    assert bind_options(book, library.LIBRARY, {"purge": "true"}) == {"purge": True}


def test_lookup_by_name_follows_the_search_order(tmp_path):
    mine, inv_dir = tmp_path / "mine", tmp_path / "inv"
    for d in (mine, inv_dir / "playbooks"):
        d.mkdir(parents=True)
    pb("description: mine\nsteps: [log_twice]\n", mine, "warmup")
    pb("description: inv\nsteps: [log_twice]\n", inv_dir / "playbooks", "warmup")
    pb("description: inv\nsteps: [log_twice]\n", inv_dir / "playbooks", "extra")
    dirs = search_dirs(str(mine), str(inv_dir / "inventory.yaml"))
    assert dirs == [mine, inv_dir / "playbooks"]
    assert load("warmup", dirs, LIBRARY).description == "mine"
    assert load("extra", dirs, LIBRARY).description == "inv"
    assert list_playbooks(dirs) == {"extra": inv_dir / "playbooks" / "extra.yaml", "warmup": mine / "warmup.yaml"}
    assert search_dirs(None, None) == []


def test_lookup_by_path_and_errors(tmp_path):
    path = pb("steps: [log_twice]\n", tmp_path, "custom")
    assert load(str(path), [], LIBRARY).name == "custom"
    pb("steps: [log_twice]\n", tmp_path, "relaunch-quick")
    with pytest.raises(InputError, match=r"no playbook 'relaunch-quik' \(did you mean 'relaunch-quick'\?\)"):
        load("relaunch-quik", [tmp_path], LIBRARY)
    with pytest.raises(InputError, match="no playbook '.*missing.yaml'"):
        load(str(tmp_path / "missing.yaml"), [], LIBRARY)
    with pytest.raises(InputError, match="--playbook-dir .*nowhere: no such directory"):
        search_dirs(str(tmp_path / "nowhere"), None)


# ----------------------------------------------------------------------------------- the CLI

def cli(tmp_path, *args):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  here:\n    transport: local\n"
                         f"    job: {{workdir: {tmp_path / 'w'}, python: /usr/bin/python3, config: tiny-cpu}}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_PLAYBOOKS")}
    return subprocess.run([sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_playbook_run_names_the_file_and_reports_each_step(tmp_path):
    d = tmp_path / "playbooks"  # next to the inventory: found by name
    d.mkdir()
    path = pb("options: {sure: false}\nsteps:\n  - require_job_stopped\n  - step: mark_stopped\n"
              "    when: options.sure\n", d, "check")
    ran = cli(tmp_path, "playbook", "run", "check", "-t", "here", "--dry-run", "--set", "sure=true")
    assert ran.returncode == 0, ran
    lines = ran.stdout.splitlines()
    assert lines[0] == f"check: ran {path}"
    assert lines[1].startswith("[1/2] require_job_stopped ... dry-run (")
    assert any(line.startswith("[2/2] mark_stopped ... dry-run (") for line in lines)
    assert lines[-1].startswith("[here] check (dry run): ok, 2 of 2 steps run")
    listed = cli(tmp_path, "playbook", "list")
    assert f"check          {path}" in listed.stdout and "  wait_first_step(timeout_s: float" in listed.stdout


def test_playbook_run_refuses_a_bad_file_in_one_line_before_touching_the_target(tmp_path):
    d = tmp_path / "playbooks"
    d.mkdir()
    path = pb("steps:\n  - step: stop_sesion\n", d, "bad")
    refused = cli(tmp_path, "playbook", "run", "bad", "-t", "here")
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr.strip() == (f"dflash-ops: {path}:2: step 1 (stop_sesion): unknown step (did you mean "
                                      f"'stop_session'?); steps: " + refused.stderr.split("steps: ", 1)[1].strip())
    assert not (tmp_path / "w").exists()
    unknown = cli(tmp_path, "playbook", "run", str(path).replace("bad", "good"), "-t", "here")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
