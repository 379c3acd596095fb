"""The playbook engine: validation, templates, dry-run, ordering, failures, timings, lookup.

Steps here are small real steps (they write files, run real bash); the engine sees only the registry.
"""
from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_ops import model
from dflash_ops.errors import InputError, RemoteCommandError
from dflash_ops.playbook import (
    DRY_RUN, FAILED, NOT_RUN, OK, SHIPPED_PLAYBOOKS, SKIPPED, Param, StepContext, StepFailed,
    StepOutcome, StepRegistry, bind_options, format_progress, load_playbook, parse_option_assignments,
    parse_playbook, playbook_search_dirs, run_playbook, validate_playbook,
)
from dflash_ops.transport.base import Result, Transport

HOSTILE = "a b 'single' \"double\" $(touch pwned) `touch pwned2` $HOME ; rm -rf x\nline2 ünï €"


class BashTransport(Transport):
    """A real local bash, for steps that run commands (the project's local transport stands apart)."""

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
        tmp = Path(remote_path + ".tmp")
        tmp.write_bytes(data)
        tmp.chmod(mode)
        tmp.rename(remote_path)

    def interactive(self, script):
        return subprocess.call(["bash", "-c", script])

    def command_line(self, script, timeout=60):
        return "bash -c " + shlex.quote(script)


def make_job(tmp_path: Path, **overrides) -> model.Job:
    fields = dict(workdir=str(tmp_path / "work"), python=sys.executable, config="tiny-cpu",
                  session="dflash", cache_dir=str(tmp_path / "cache"), target_gpus=(0,), drafter_gpus=(1, 2))
    fields.update(overrides)
    return model.Job(**fields)


def make_ctx(tmp_path: Path, **job_overrides) -> StepContext:
    target = model.Target(name="box", transport="local", job=make_job(tmp_path, **job_overrides))
    return StepContext(target=target, transport=BashTransport("box", tmp_path))


def file_registry(tmp_path: Path) -> StepRegistry:
    """Steps with visible effects in tmp_path: a journal of what ran, files written through bash."""
    registry = StepRegistry()
    journal = tmp_path / "journal"

    @registry.step("note", params={"text": str}, outputs={"text": str})
    def note(ctx, text):
        if not ctx.dry_run:
            with journal.open("a", encoding="utf-8") as f:
                f.write(text + "\n")
        return StepOutcome(f"noted {text}", data={"text": text})

    @registry.step("write_file", params={"path": str, "content": str})
    def write_file(ctx, path, content):
        ctx.run(f"printf '%s' {shlex.quote(content)} > {shlex.quote(path)}")
        return f"wrote {path}"

    @registry.step("fail", params={"how": (str, "raise")})
    def fail(ctx, how):
        if how == "raise":
            raise StepFailed(f"[{ctx.target_name}] {ctx.step}: the disk is full")
        if how == "remote":
            ctx.run("echo 'no space left' >&2; exit 3")
        if how == "return":
            return StepOutcome.failed("GPU 2 still holds 4000 MiB")
        if how == "bug":
            return {}["missing"]
        return "did not fail"

    @registry.step("sleep", params={"seconds": float})
    def sleep(ctx, seconds):
        if not ctx.dry_run:
            time.sleep(seconds)
        return f"slept {seconds}"

    @registry.step("record", params={"value": (str, ""), "gpus": (list[int], []),
                                     "number": (float, 0.0), "flag": (bool, False),
                                     "env": (dict[str, str], {})})
    def record(ctx, value, gpus, number, flag, env):
        return StepOutcome("recorded", data={"value": value, "gpus": gpus, "number": number,
                                             "flag": flag, "env": env})

    @registry.step("rogue")
    def rogue(ctx):
        ctx.transport.run("touch rogue-ran")  # ignores ctx.dry_run on purpose
        return "touched"

    @registry.step("log_twice")
    def log_twice(ctx):
        ctx.log("first line")
        ctx.log("second line")
        return "logged"

    @registry.step("use_result", params={"said": str})
    def use_result(ctx, said):
        return f"earlier note said {said}"

    @registry.step("forgetful", params={"give": (bool, False)}, outputs={"count": int})
    def forgetful(ctx, give):
        return StepOutcome("done", data={"count": 3} if give else {"other": 1})

    return registry


def pb(text: str, tmp_path: Path, name: str = "test") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def journal(tmp_path: Path) -> list[str]:
    path = tmp_path / "journal"
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def invalid(tmp_path: Path, text: str, registry: StepRegistry | None = None) -> str:
    """The InputError message for a playbook that must be rejected (by parse or by validation)."""
    path = pb(text, tmp_path)
    with pytest.raises(InputError) as info:
        load_playbook(path, registry=registry or file_registry(tmp_path))
    assert info.value.exit_code == 2
    assert str(path) in str(info.value), "the message names the playbook file"
    return str(info.value)


# ----------------------------------------------------------------------------------- registry

def test_registry_declares_params_three_ways_and_lists_signatures():
    registry = StepRegistry()

    @registry.step("wait", params={"gpus": list[int], "timeout_s": (float, 120.0),
                                   "poll_s": Param(float, 2.0, help="between polls")})
    def wait(ctx, gpus, timeout_s, poll_s):
        """Wait for free GPUs."""

    spec = registry.get("wait")
    assert spec.params["gpus"].required and not spec.params["timeout_s"].required
    assert spec.params["poll_s"].help == "between polls" and spec.doc == "Wait for free GPUs."
    assert spec.signature() == "wait(gpus: list[int], timeout_s: float = 120.0, poll_s: float = 2.0)"
    assert "wait" in registry and registry.names() == ["wait"] and len(registry) == 1


@pytest.mark.parametrize("declare, fn, complaint", [
    ({"a": int}, lambda ctx, b: None, "does not match"),           # declared a, function takes b
    ({}, lambda ctx, needed: None, "does not match"),               # function needs an undeclared one
    ({"a": (int, "x")}, lambda ctx, a: None, "default"),            # default of the wrong type
    ({"a": set}, lambda ctx, a: None, "unsupported type"),
])
def test_registry_rejects_step_declarations_that_do_not_fit(declare, fn, complaint):
    with pytest.raises(ValueError, match=complaint):
        StepRegistry().add("s", fn, declare)


def test_registry_rejects_a_name_twice():
    registry = StepRegistry()
    registry.add("s", lambda ctx: None)
    with pytest.raises(ValueError, match="twice"):
        registry.add("s", lambda ctx: None)


# ----------------------------------------------------------------------------------- validation

def test_unknown_step_suggests_the_closest_name(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: note\n    params: {text: a}\n  - step: wirte_file\n")
    assert "step 2 (wirte_file, line 4)" in msg and "did you mean 'write_file'" in msg


def test_unknown_parameter_suggests_the_closest_and_lists_the_known(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: sleep\n    params: {secnds: 1}\n")
    assert "step 1 (sleep" in msg and "params.secnds" in msg and "did you mean 'seconds'" in msg


def test_missing_required_parameter_is_named_with_its_type(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: write_file\n    params: {path: /x}\n")
    assert "params.content" in msg and "missing required parameter (str)" in msg


@pytest.mark.parametrize("params, field, expected", [
    ("{seconds: soon}", "params.seconds", "expected float, got str 'soon'"),
    ("{seconds: true}", "params.seconds", "expected float, got bool True"),
    ("{seconds: [1]}", "params.seconds", "expected float, got list"),
])
def test_mistyped_literal_parameter(tmp_path, params, field, expected):
    msg = invalid(tmp_path, f"steps:\n  - step: sleep\n    params: {params}\n")
    assert field in msg and expected in msg


def test_mistyped_list_element_names_its_index(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: record\n    params: {gpus: [0, two]}\n")
    assert "params.gpus[1]" in msg and "expected int, got str 'two'" in msg


@pytest.mark.parametrize("value, expected", [
    ("{jobb.session}", "must start with target., job., options. or steps. (did you mean 'job'?)"),
    ("{job.cach_dir}/inductor", "job has no field 'cach_dir' (did you mean 'cache_dir'?)"),
    ("{options.nope}", "declare 'nope' under options:"),
    ("{job.session", "unmatched '{'"),
    ("x}", "unmatched '}'"),
    ("{job session}", "bad reference"),
    ("{target.job}/x", "cannot be put inside text"),
    ("{job.session.name}", "job.session is of type str"),
    ("{target.ssh.port}", "{target.ssh.port} is of type int but the parameter takes str"),
    ("{target.ssh.hots}", "did you mean 'host'"),
])
def test_bad_template_references(tmp_path, value, expected):
    msg = invalid(tmp_path, f"steps:\n  - step: record\n    params:\n      value: {value!r}\n")
    assert "step 1 (record" in msg and "params.value" in msg and expected in msg


def test_whole_value_reference_of_the_wrong_kind(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: sleep\n    params: {seconds: '{job.session}'}\n")
    assert "params.seconds" in msg and "{job.session} is of type str but the parameter takes float" in msg
    msg = invalid(tmp_path, "steps:\n  - step: record\n    params: {gpus: '{job.cache_dir}'}\n")
    assert "params.gpus" in msg and "takes list[int]" in msg


@pytest.mark.parametrize("text, expected", [
    ("", "got an empty file"),
    ("- step: note\n", "expected a mapping with a 'steps:' list at the top, got a list"),
    ("steps: note\n", "steps: expected a list of steps"),
    ("steps: []\n", "the list is empty"),
    ("description: x\n", "no 'steps:' list"),
    ("stepz: []\n", "top-level key 'stepz': unknown key (did you mean 'steps'?)"),
    ("steps:\n  - step: note\n    params: {text: [unclosed\n", "not valid YAML"),
    ("steps:\n  - 42\n", "step 1 (line 2): expected a step name or a mapping"),
    ("steps:\n  - note: {text: a}\n", "write `- step: note` and put its parameters under `params:`"),
    ("steps:\n  - step: note\n    with: {text: a}\n", "with: unknown key; allowed: step, params, when"),
    ("steps:\n  - step: note\n    params: [a]\n", "params: expected a mapping"),
    ("steps:\n  - step: note\n    params: {text: a}\n    when: options.purge and x\n", "when: expected `options.NAME`"),
    ("steps:\n  - step: note\n    params: {text: a}\n    when: options.purge\n", "declare 'purge' under options:"),
    ("options: {purge: {type: boolean}}\nsteps: [deploy]\n", "options.purge.type: unknown type 'boolean'"),
    ("options: {purge: {type: bool, default: 3}}\nsteps: [deploy]\n", "options.purge.default: expected bool"),
    ("options: {purge: {type: bool, defualt: true}}\nsteps: [deploy]\n", "did you mean 'default'"),
    ("options: {limit: null}\nsteps: [deploy]\n", "options.limit: give a default or a type"),
])
def test_structural_problems(tmp_path, text, expected):
    assert expected in invalid(tmp_path, text)


def test_yaml_error_names_the_line(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: note\n    params: {text: a\n")
    assert "line 4" in msg or "line 3" in msg


def test_all_problems_are_reported_together(tmp_path):
    msg = invalid(tmp_path, "steps:\n  - step: nope\n  - step: sleep\n    params: {seconds: x}\n"
                            "  - step: write_file\n")
    assert "has 4 problems" in msg
    for part in ("step 1 (nope", "step 2 (sleep", "params.seconds", "step 3 (write_file", "params.path",
                 "params.content"):
        assert part in msg


def test_invalid_playbook_runs_nothing(tmp_path):
    """The first step is fine; the third is wrong: not even the first one runs."""
    registry = file_registry(tmp_path)
    playbook = parse_playbook("steps:\n  - step: note\n    params: {text: first}\n  - step: sleep\n"
                              "    params: {seconds: 0}\n  - step: sleep\n    params: {secs: 1}\n", "inline.yaml")
    with pytest.raises(InputError, match=r"step 3 \(sleep"):
        run_playbook(playbook, registry, make_ctx(tmp_path))
    assert journal(tmp_path) == []


def test_template_that_cannot_be_filled_for_this_target_runs_nothing(tmp_path):
    """An empty inventory field must not silently turn "{job.session}/inductor" into "/inductor"."""
    registry = file_registry(tmp_path)
    playbook = parse_playbook("steps:\n  - step: note\n    params: {text: first}\n  - step: record\n"
                              "    params: {value: '{job.config}/inductor'}\n  - step: record\n"
                              "    params: {value: '{target.ssh.host}'}\n", "inline.yaml")
    with pytest.raises(InputError) as info:
        run_playbook(playbook, registry, make_ctx(tmp_path, config=""))
    msg = str(info.value)
    assert "step 2 (record" in msg and "{job.config} is empty for target 'box'" in msg
    assert "step 3 (record" in msg and "target.ssh is not set for target 'box'" in msg
    assert journal(tmp_path) == []


# ----------------------------------------------------------------------------------- options

OPTIONS_PB = """
options:
  purge: {type: bool, default: true, help: purge the cache}
  timeout: 900.0
  retries: 3
  label: {type: str}
steps:
  - step: record
    params: {flag: "{options.purge}", number: "{options.timeout}", value: "{options.label}"}
"""


def test_bind_options_defaults_overrides_and_text(tmp_path):
    playbook = parse_playbook(OPTIONS_PB)
    # Shorthand `name: default` takes its type from the default.
    assert playbook.options["timeout"].type is float and playbook.options["retries"].type is int
    assert bind_options(playbook, {"label": "x"}) == {"purge": True, "timeout": 900.0, "retries": 3, "label": "x"}
    assert bind_options(playbook, {"label": "x", "purge": None, "timeout": 5}) == \
        {"purge": True, "timeout": 5.0, "retries": 3, "label": "x"}
    given = parse_option_assignments(["purge=off", "timeout=7.5", "retries=4", "label=a=b"])
    assert bind_options(playbook, given) == {"purge": False, "timeout": 7.5, "retries": 4, "label": "a=b"}


@pytest.mark.parametrize("given, expected", [
    ({"label": "x", "prune": False}, "option 'prune': playbook test has no such option (did you mean 'purge'?)"),
    ({"label": "x", "purge": "perhaps"}, "option 'purge': expected true or false, got 'perhaps'"),
    ({"label": "x", "timeout": "soon"}, "option 'timeout': expected float, got 'soon'"),
    ({"label": "x", "timeout": True}, "option 'timeout': expected float, got bool"),
    ({"label": "x", "retries": "2.5"}, "option 'retries': expected int, got '2.5'"),
    ({}, "option 'label': required (str) and not given"),
])
def test_bad_options(given, expected):
    playbook = parse_playbook(OPTIONS_PB, "opts.yaml", "test")
    with pytest.raises(InputError) as info:
        bind_options(playbook, given)
    assert expected in str(info.value) and "opts.yaml" in str(info.value)


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
    registry = file_registry(tmp_path)
    result = run_playbook(parse_playbook(SEQUENCE), registry, make_ctx(tmp_path))
    assert result.ok and [s.status for s in result.steps] == [OK, OK, OK]
    assert journal(tmp_path) == ["one", "two", "three"]
    (tmp_path / "journal").unlink()
    reordered = SEQUENCE.replace("text: one", "text: @").replace("text: three", "text: one").replace("text: @", "text: three")
    run_playbook(parse_playbook(reordered), registry, make_ctx(tmp_path))
    assert journal(tmp_path) == ["three", "two", "one"]


def test_bare_step_name_takes_default_parameters(tmp_path):
    result = run_playbook(parse_playbook("steps:\n  - fail\n"), file_registry(tmp_path), make_ctx(tmp_path))
    assert result.failed.message == "[box] fail: the disk is full"  # default how=raise


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
    when: "{options.deploy}"
    params: {text: deploy}
  - step: note
    when: false
    params: {text: disabled}
  - step: note
    when: job.drafter_gpus
    params: {text: has-drafters}
"""


@pytest.mark.parametrize("options, ran", [
    ({}, ["stop", "purge", "deploy", "has-drafters"]),
    ({"purge": False}, ["stop", "kept-cache", "deploy", "has-drafters"]),
    ({"purge": "false", "deploy": False}, ["stop", "kept-cache", "has-drafters"]),
])
def test_when_skips_steps(tmp_path, options, ran):
    result = run_playbook(parse_playbook(WHEN_PB), file_registry(tmp_path), make_ctx(tmp_path), options=options)
    assert journal(tmp_path) == ran
    assert result.ok and sum(s.status == OK for s in result.steps) == len(ran)
    skipped = [s for s in result.steps if s.status == SKIPPED]
    assert len(skipped) == 6 - len(ran)
    reasons = {"purge": "options.purge is false", "kept-cache": "options.purge is true",
               "deploy": "options.deploy is false", "disabled": "when: false"}
    texts = ["stop", "purge", "kept-cache", "deploy", "disabled", "has-drafters"]
    assert [s.message for s in skipped] == [reasons[texts[s.number - 1]] for s in skipped]
    assert [s.number for s in result.steps] == [1, 2, 3, 4, 5, 6]


def test_when_on_an_empty_job_field_is_false(tmp_path):
    run_playbook(parse_playbook(WHEN_PB), file_registry(tmp_path), make_ctx(tmp_path, drafter_gpus=()))
    assert "has-drafters" not in journal(tmp_path)


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
    result = run_playbook(parse_playbook(FAILING.replace("HOW", how), "failing.yaml"), file_registry(tmp_path),
                          make_ctx(tmp_path), on_progress=events.append)
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
    text = "steps:\n  - step: sleep\n    params: {seconds: 0.3}\n  - log_twice\n  - step: note\n" \
           "    params: {text: x}\n    when: false\n"
    events = []
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), make_ctx(tmp_path),
                          on_progress=events.append)
    assert 0.3 <= result.steps[0].seconds < 2.5 and result.seconds >= result.steps[0].seconds
    lines = [format_progress(e) for e in events]
    assert lines[0] == "[1/3] sleep ..."
    assert lines[1].startswith("[1/3] sleep ... ok (0.") and lines[1].endswith("s) slept 0.3")
    assert lines[2:5] == ["[2/3] log_twice ...", "      first line", "      second line"]
    assert lines[5].startswith("[2/3] log_twice ... ok (0.0s) logged")
    assert lines[6] == "[3/3] note ... skipped (when: false)"
    assert format_progress(events[0], with_target=True) == "[box] [1/3] sleep ..."


READS_NOTE = """
steps:
  - step: note
    params: {text: first}
  - step: note
    params: {text: hello}
  - step: use_result
    params: {said: "{steps.note.text}, twice: {steps.note.text}"}
"""


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_later_step_reads_an_earlier_ones_output_through_a_parameter(tmp_path, dry_run):
    result = run_playbook(parse_playbook(READS_NOTE), file_registry(tmp_path), make_ctx(tmp_path), dry_run=dry_run)
    assert result.ok, result.summary()
    assert result.steps[2].message == "earlier note said hello, twice: hello"  # the latest run of `note`
    assert result.steps[1].data == {"text": "hello"}


def test_steps_get_no_other_input_than_their_parameters():
    import dataclasses
    fields = {f.name for f in dataclasses.fields(StepContext)}
    assert not fields & {"options", "results"}, fields


@pytest.mark.parametrize("steps, complaint", [
    ('  - step: use_result\n    params: {said: "{steps.note.text}"}\n  - step: note\n    params: {text: a}\n',
     "step 1 (use_result, line 2): params.said: unknown reference {steps.note.text}: no step 'note' runs "
     "before this one (earlier steps: none)"),
    ('  - step: note\n    params: {text: a}\n  - step: use_result\n    params: {said: "{steps.note.txt}"}\n',
     "params.said: unknown reference {steps.note.txt}: step note has no output 'txt' (did you mean 'text'?) "
     "(outputs: text)"),
    ('  - step: note\n    params: {text: a}\n  - step: use_result\n    params: {said: "{steps.note}"}\n',
     "bad reference {steps.note}: write {steps.STEP.OUTPUT}"),
    ('  - step: note\n    params: {text: a}\n  - step: record\n    params: {gpus: "{steps.note.text}"}\n',
     "params.gpus: {steps.note.text} is of type str but the parameter takes list[int]"),
    ('  - step: note\n    params: {text: a}\n  - step: sleep\n    when: steps.note.text\n'
     '    params: {seconds: 0}\n', "when: {steps.note.text}: `when:` is decided before any step runs"),
])
def test_a_reference_to_a_step_output_is_checked_when_loaded(tmp_path, steps, complaint):
    assert complaint in invalid(tmp_path, "steps:\n" + steps)


def test_a_reference_to_a_skipped_step_fails_before_anything_runs(tmp_path):
    text = ("options: {loud: false}\nsteps:\n  - step: note\n    params: {text: first}\n"
            "  - step: note\n    when: options.loud\n    params: {text: hello}\n"
            "  - step: use_result\n    params: {said: \"{steps.note.text}\"}\n")
    with pytest.raises(InputError) as info:
        run_playbook(parse_playbook(text, "skips.yaml"), file_registry(tmp_path), make_ctx(tmp_path))
    assert str(info.value) == (
        "playbook skips.yaml: step 3 (use_result, line 8): params.said: {steps.note.text} reads step 2 "
        "(note, line 5), which is skipped (options.loud is false); give both steps the same `when:` or "
        "drop the reference")
    assert journal(tmp_path) == []
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), make_ctx(tmp_path), options={"loud": True})
    assert result.ok and result.steps[2].message == "earlier note said hello"


def test_a_step_that_does_not_return_a_declared_output_fails(tmp_path):
    text = "steps:\n  - forgetful\n  - step: note\n    params: {text: after}\n"
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), make_ctx(tmp_path))
    assert [s.status for s in result.steps] == [FAILED, NOT_RUN]
    assert result.failed.message == "TypeError: step forgetful returned no 'count', an output it declares"
    given = run_playbook(parse_playbook("steps:\n  - step: forgetful\n    params: {give: true}\n"),
                         file_registry(tmp_path), make_ctx(tmp_path))
    assert given.ok, given.summary()


# ----------------------------------------------------------------------------------- dry run

def test_dry_run_reports_exact_commands_and_touches_nothing(tmp_path):
    target_file = tmp_path / "out file.txt"
    text = f"""
steps:
  - step: note
    params: {{text: noted}}
  - step: write_file
    params: {{path: {str(target_file)!r}, content: "{{job.session}}"}}
"""
    registry, ctx = file_registry(tmp_path), make_ctx(tmp_path, session=HOSTILE)
    events = []
    result = run_playbook(parse_playbook(text), registry, ctx, dry_run=True, on_progress=events.append)
    assert result.ok and result.dry_run and [s.status for s in result.steps] == [DRY_RUN, DRY_RUN]
    script = f"printf '%s' {shlex.quote(HOSTILE)} > {shlex.quote(str(target_file))}"
    assert result.steps[1].commands == ("bash -c " + shlex.quote(script),)
    assert not target_file.exists() and journal(tmp_path) == [] and ctx.transport.calls == 0
    assert "      $ bash -c " in format_progress(events[-1])
    # The command it reported is the one a real run executes: run it for real and compare.
    result = run_playbook(parse_playbook(text), registry, ctx)
    assert result.steps[1].commands == ("bash -c " + shlex.quote(script),)
    assert target_file.read_text(encoding="utf-8") == HOSTILE and ctx.transport.calls == 1


def test_dry_run_from_the_context_flag(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dry_run = True
    result = run_playbook(parse_playbook(SEQUENCE), file_registry(tmp_path), ctx)
    assert [s.status for s in result.steps] == [DRY_RUN] * 3 and journal(tmp_path) == []


def test_dry_run_blocks_a_step_that_ignores_it(tmp_path):
    text = "steps:\n  - rogue\n  - step: note\n    params: {text: after}\n"
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), make_ctx(tmp_path), dry_run=True)
    assert [s.status for s in result.steps] == [FAILED, NOT_RUN]
    assert "tried to run a command during --dry-run" in result.failed.message
    assert not (tmp_path / "rogue-ran").exists()
    # Outside dry-run the same step does run: the guard, not the step, kept the file from appearing.
    run_playbook(parse_playbook(text), file_registry(tmp_path), make_ctx(tmp_path))
    assert (tmp_path / "rogue-ran").exists()


# ----------------------------------------------------------------------------------- templates

def test_template_values_keep_or_convert_their_types(tmp_path):
    text = """
options: {timeout: 900.0, purge: false}
steps:
  - step: record
    params:
      value: "gpus={job.gpus} t={options.timeout}s p={options.purge} {{literal}} {target.name}"
      gpus: "{job.gpus}"
      number: "{options.timeout}"
      flag: "{options.purge}"
      env: {CACHE: "{job.cache_dir}/inductor", N: "port {target.ssh.port}"}
"""
    ctx = make_ctx(tmp_path)
    ctx.target = model.Target(name="box", transport="ssh", job=ctx.job, ssh=model.HostSpec(host="h", port=2222))
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), ctx)
    data = result.steps[0].data
    assert data["value"] == "gpus=0,1,2 t=900s p=false {literal} box"
    assert data["gpus"] == [0, 1, 2] and data["number"] == 900.0 and data["flag"] is False
    assert data["env"] == {"CACHE": f"{tmp_path}/cache/inductor", "N": "port 2222"}


def test_a_value_of_the_wrong_type_at_run_time(tmp_path):
    """A job object whose field holds the wrong type is caught when the template is filled in."""
    text = "steps:\n  - step: record\n    params: {value: '{job.session}'}\n"
    ctx = make_ctx(tmp_path)
    ctx.job = {"session": 7}  # not what the inventory loader produces, but the engine must not trust it
    with pytest.raises(InputError, match=r"params.value: after filling in templates: expected str, got int 7"):
        run_playbook(parse_playbook(text), file_registry(tmp_path), ctx)


def test_hostile_values_are_data_not_templates_and_not_shell(tmp_path, monkeypatch):
    """A value that looks like a template or a shell expansion arrives byte for byte."""
    monkeypatch.chdir(tmp_path)
    sneaky = HOSTILE + " {job.workdir} {{ }"
    out = tmp_path / "got"
    text = f"""
options: {{msg: {{type: str}}}}
steps:
  - step: write_file
    params: {{path: {str(out)!r}, content: "<{{options.msg}}|{{job.session}}>"}}
"""
    ctx = make_ctx(tmp_path, session="s'e\"s $(id)")
    result = run_playbook(parse_playbook(text), file_registry(tmp_path), ctx, options={"msg": sneaky})
    assert result.ok, result.summary()
    assert out.read_text(encoding="utf-8") == f"<{sneaky}|s'e\"s $(id)>"
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


# ----------------------------------------------------------------------------------- finding playbooks

def test_lookup_by_name_follows_the_search_order(tmp_path, monkeypatch):
    mine, env_dir, inv_dir = tmp_path / "mine", tmp_path / "env", tmp_path / "inv"
    for d in (mine, env_dir, inv_dir / "playbooks"):
        d.mkdir(parents=True)
    pb("description: mine\nsteps: [deploy]\n", mine, "stop")
    pb("description: env\nsteps: [deploy]\n", env_dir, "stop")
    pb("description: env\nsteps: [deploy]\n", env_dir, "warmup")
    pb("description: inv\nsteps: [deploy]\n", inv_dir / "playbooks", "warmup")
    pb("description: inv\nsteps: [deploy]\n", inv_dir / "playbooks", "extra")
    environ = {"DFLASH_OPS_PLAYBOOKS": str(env_dir)}
    dirs = playbook_search_dirs(mine, inv_dir / "inventory.yaml", environ)
    assert dirs == [mine, env_dir, inv_dir / "playbooks", SHIPPED_PLAYBOOKS]
    assert load_playbook("stop", dirs).description == "mine"
    assert load_playbook("warmup", dirs).description == "env"
    assert load_playbook("extra", dirs).description == "inv"
    assert load_playbook("relaunch", dirs).source == str(SHIPPED_PLAYBOOKS / "relaunch.yaml")
    monkeypatch.setenv("DFLASH_OPS_PLAYBOOKS", str(env_dir))
    assert playbook_search_dirs() == [env_dir, SHIPPED_PLAYBOOKS]


def test_lookup_by_path_and_errors(tmp_path):
    path = pb("steps: [deploy]\n", tmp_path, "custom")
    assert load_playbook(str(path)).name == "custom"
    with pytest.raises(InputError, match="no playbook named 'relanch' \\(did you mean 'relaunch'\\?\\)"):
        load_playbook("relanch", [SHIPPED_PLAYBOOKS])
    with pytest.raises(InputError, match="playbook file .*missing.yaml not found"):
        load_playbook(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="--playbook-dir .*nowhere: no such directory"):
        playbook_search_dirs(tmp_path / "nowhere", environ={})
    with pytest.raises(InputError, match="DFLASH_OPS_PLAYBOOKS: .*nowhere is not a directory"):
        playbook_search_dirs(environ={"DFLASH_OPS_PLAYBOOKS": str(tmp_path / "nowhere")})


def test_shipped_dir_is_inside_the_package():
    import dflash_ops
    assert SHIPPED_PLAYBOOKS == Path(dflash_ops.__file__).resolve().parent / "playbooks"


# ----------------------------------------------------------------------------------- shipped playbooks
# The step library must declare exactly these parameters (name: type, or (type, default)).
# If a shipped playbook drifts from this table, or the table from dflash_ops.steps, a test fails.

EXPECTED_STEPS = {
    "stop_session": {"session": str, "grace_s": (float, 30.0)},
    "kill_gpu_processes": {"gpus": list[int], "grace_s": (float, 10.0)},
    "wait_gpu_free": {"gpus": list[int], "timeout_s": (float, 120.0), "max_used_mib": (int, 1024),
                      "poll_s": (float, 2.0), "ignore": (list[dict[str, Any]], []), "processes_ended": (bool, False)},
    "purge_cache": {"paths": list[str], "if_unmarked": (str, "fail")},
    "deploy": {"keep_releases": (int, 5)},
    "launch": {"session": str, "cache_dir": str, "resume": (bool, True)},
    "wait_first_step": {"log": str, "timeout_s": (float, 900.0), "poll_s": (float, 1.0)},
    "rollback": {"release": (str, "previous")},
    "preflight": {"gpus": list[int], "deploy": (bool, True), "min_free_gib": (float, 10.0),
                  "allow_shared_gpus": (bool, False), "import_torch": (bool, True)},
    "mark_stopped": {},
    "require_job_stopped": {},
}
# ... and these outputs, with what the stand-ins below give.
EXPECTED_OUTPUTS = {
    "stop_session": {"foreign": list[dict[str, Any]]},
    "kill_gpu_processes": {"foreign": list[dict[str, Any]]},
    "launch": {"log": str},
}
STAND_IN_OUTPUTS = {
    "stop_session": {"foreign": [{"pid": 5, "owner": "ct 201"}]},
    "kill_gpu_processes": {"foreign": [{"pid": 7, "owner": ""}]},
    "launch": {"log": "/logs/train-0003.log"},
}


def expected_registry(calls: list):
    """Steps with the library's names and parameters that record how they were called."""
    registry = StepRegistry()
    for name, params in EXPECTED_STEPS.items():
        def fn(ctx, _name=name, **kwargs):
            calls.append((_name, kwargs))
            command = ctx.run(f"echo {shlex.quote(_name)}")
            return StepOutcome(f"{_name} done", data={"had_output": command is not None,
                                                      **STAND_IN_OUTPUTS.get(_name, {})})
        registry.add(name, fn, params, outputs=EXPECTED_OUTPUTS.get(name))
    return registry


@pytest.mark.parametrize("name, order", [
    ("relaunch", ["preflight", "stop_session", "kill_gpu_processes", "wait_gpu_free", "purge_cache", "deploy",
                  "launch", "wait_first_step"]),
    ("stop", ["stop_session", "mark_stopped", "kill_gpu_processes", "wait_gpu_free"]),
    ("gpu-clean", ["require_job_stopped", "kill_gpu_processes", "wait_gpu_free"]),
    ("deploy", ["deploy"]),
])
def test_shipped_playbooks_validate_and_keep_their_order(name, order):
    playbook = load_playbook(name, [SHIPPED_PLAYBOOKS], registry=expected_registry([]))
    assert [s.step for s in playbook.steps] == order and playbook.description


def test_shipped_relaunch_fills_parameters_from_the_job(tmp_path):
    calls = []
    registry = expected_registry(calls)
    playbook = load_playbook("relaunch", [SHIPPED_PLAYBOOKS])
    ctx = make_ctx(tmp_path, session="train", target_gpus=(3,), drafter_gpus=(1, 2))
    result = run_playbook(playbook, registry, ctx, dry_run=True, options={"timeout": "60"})
    assert result.ok and all(s.status == DRY_RUN for s in result.steps)
    assert all(s.commands == ("bash -c " + shlex.quote(f"echo {s.step}"),) for s in result.steps)
    assert all(s.data["had_output"] is False for s in result.steps)
    cache = str(tmp_path / "cache")
    assert calls == [
        ("preflight", {"gpus": [1, 2, 3], "deploy": True, "min_free_gib": 10.0, "allow_shared_gpus": False,
                       "import_torch": True}),
        ("stop_session", {"session": "train", "grace_s": 30.0}),
        ("kill_gpu_processes", {"gpus": [1, 2, 3], "grace_s": 10.0}),
        ("wait_gpu_free", {"gpus": [1, 2, 3], "timeout_s": 120.0, "max_used_mib": 1024, "poll_s": 2.0,
                           "ignore": [{"pid": 7, "owner": ""}], "processes_ended": True}),
        ("purge_cache", {"paths": [cache], "if_unmarked": "skip"}),
        ("deploy", {"keep_releases": 5}),
        ("launch", {"session": "train", "cache_dir": cache, "resume": True}),
        ("wait_first_step", {"log": "/logs/train-0003.log", "timeout_s": 60.0, "poll_s": 1.0}),
    ]


def test_shipped_relaunch_no_purge_no_deploy(tmp_path):
    calls = []
    playbook = load_playbook("relaunch", [SHIPPED_PLAYBOOKS])
    result = run_playbook(playbook, expected_registry(calls), make_ctx(tmp_path),
                          options={"purge": False, "deploy": False, "resume": "false"})
    assert [c[0] for c in calls] == ["preflight", "stop_session", "kill_gpu_processes", "wait_gpu_free", "launch",
                                     "wait_first_step"]
    assert calls[0][1]["deploy"] is False  # then the release must already be there
    assert calls[4] == ("launch", {"session": "dflash", "cache_dir": str(tmp_path / "cache"), "resume": False})
    assert [s.status for s in result.steps] == [OK, OK, OK, OK, SKIPPED, SKIPPED, OK, OK]
    assert all(s.data["had_output"] is True for s in result.steps if s.status == OK)


def test_step_library_matches_the_expected_table():
    if importlib.util.find_spec("dflash_ops.steps") is None:
        pytest.skip("dflash_ops.steps is not written yet")
    from dflash_ops import steps
    registry = steps.registry
    for name, params in EXPECTED_STEPS.items():
        spec = registry.get(name)
        assert spec is not None, f"dflash_ops.steps.registry lacks step {name!r}"
        declared = {k: (p.type if p.required else (p.type, p.default)) for k, p in spec.params.items()}
        assert declared == params, f"step {name!r}: declared {declared}, playbooks expect {params}"
        assert dict(spec.outputs) == EXPECTED_OUTPUTS.get(name, {}), f"step {name!r}: outputs {spec.outputs}"
    for name in ("relaunch", "stop", "deploy", "gpu-clean", "purge-cache", "rollback"):
        validate_playbook(load_playbook(name, [SHIPPED_PLAYBOOKS]), registry)
