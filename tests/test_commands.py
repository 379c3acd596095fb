"""The built-in commands (dflash_ops.commands): which steps each runs, in which order, with which
values; what their options default to; and that the CLI's --help states those same defaults.

The steps here are stand-ins that record how they were called (the real ones run end to end in
test_ops_e2e.py and test_unattended_e2e.py)."""
from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from dflash_ops import commands

from dflash_ops.job import model

from dflash_ops.act import preflight, steps
from dflash_ops.errors import StepFailed
from dflash_ops.act.runner import DRY_RUN, FAILED, NOT_RUN, OK, SKIPPED
from dflash_ops.transport.local import LocalTransport

PREFLIGHT_STEPS = ("preflight", "require_job_stopped")  # in act/preflight.py, the others in act/steps.py
LIBRARY_STEPS = ("preflight", "require_job_stopped", "stop_session", "mark_stopped", "kill_gpu_processes",
                 "wait_gpu_free", "purge_cache", "deploy", "launch", "wait_first_step", "rollback")


@pytest.fixture
def target(tmp_path):
    job = model.Job(workdir=str(tmp_path / "work"), python=sys.executable, config="tiny-cpu", session="train",
                    cache_dir=str(tmp_path / "cache"), target_gpus=(3,), drafter_gpus=(1, 2))
    return model.Target(name="box", transport="local", job=job)


@pytest.fixture
def calls(monkeypatch):
    """Stand-ins for every library step: each records (name, args, kwargs, what it returned) and
    runs one harmless command; `calls.fail = NAME` makes that step fail."""
    made = Calls()

    def stand_in(name):
        def step(ctx, *args, **kwargs):
            ctx.run(f"echo {name}")
            if name == made.fail:
                raise StepFailed(f"[{ctx.target_name}] {name}: failed on purpose")
            given = {"stop_session": steps.Ended(foreign=[{"pid": 5, "owner": "ct 201"}]),
                     "kill_gpu_processes": steps.Ended(foreign=[{"pid": 7, "owner": ""}]),
                     "launch": steps.Launched(log="/logs/train-0003.log")}.get(name, steps.StepOutcome(f"{name} done"))
            made.append((name, args, kwargs, given))
            return given

        step.__name__ = name
        return step

    for name in LIBRARY_STEPS:
        monkeypatch.setattr(preflight if name in PREFLIGHT_STEPS else steps, name, stand_in(name))
    return made


class Calls(list):
    fail: str | None = None  # the step that fails


def test_relaunch_runs_its_steps_in_order_with_the_jobs_values_and_its_defaults(target, calls):
    result = commands.relaunch(target, timeout=60, dry_run=True)
    assert result.ok and all(s.status == DRY_RUN for s in result.steps), result.summary()
    transport = LocalTransport("box")
    assert all(s.commands == (transport.command_line(f"echo {s.step}", 60),) for s in result.steps)
    job = target.job
    killed, launched = calls[2][3], calls[6][3]
    assert [c[:3] for c in calls] == [
        ("preflight", (job,), {"deploy": True, "min_free_gib": 10.0, "allow_shared_gpus": False,
                               "import_torch": True}),
        ("stop_session", (job,), {"grace_s": 30.0}),
        ("kill_gpu_processes", (job,), {}),
        ("wait_gpu_free", (job, killed), {"timeout_s": 120.0}),  # not stop_session's foreign processes
        ("purge_cache", (job,), {"if_unmarked": "skip"}),
        ("deploy", (job,), {}),
        ("launch", (job,), {"resume": True}),
        ("wait_first_step", (job, launched), {"timeout_s": 60}),
    ]
    assert result.source == "dflash_ops.commands.relaunch" and result.name == "relaunch"


def test_relaunch_no_purge_no_deploy_fresh(target, calls):
    result = commands.relaunch(target, purge=False, deploy=False, resume=False, grace=35.0)
    assert [c[0] for c in calls] == ["preflight", "stop_session", "kill_gpu_processes", "wait_gpu_free", "launch",
                                     "wait_first_step"]
    assert calls[0][2]["deploy"] is False  # then the release must already be there
    assert calls[1][2] == {"grace_s": 35.0} and calls[4][2] == {"resume": False}
    assert [s.status for s in result.steps] == [OK, OK, OK, OK, SKIPPED, SKIPPED, OK, OK]
    assert [s.message for s in result.steps if s.status == SKIPPED] == ["--no-purge", "--no-deploy"]


def test_a_failed_preflight_stops_nothing(target, calls):
    calls.fail = "preflight"
    result = commands.relaunch(target)
    assert calls == []  # preflight failed before it recorded; nothing after it ran
    assert result.failed.step == "preflight" and "failed on purpose" in result.failed.message
    assert [s.status for s in result.steps] == [FAILED] + [NOT_RUN] * 7
    assert result.summary().startswith("[box] relaunch: FAILED at step 1/8 preflight after ")


def test_stop_records_the_operators_stop_and_waits_only_for_the_jobs_processes(target, calls):
    result = commands.stop(target, grace=42.0)
    job = target.job
    assert [c[:3] for c in calls] == [
        ("stop_session", (job,), {"grace_s": 42.0, "record_stop": True}),
        ("mark_stopped", (job,), {}),
        ("kill_gpu_processes", (job,), {}),
        ("wait_gpu_free", (job, calls[2][3]), {"timeout_s": 120.0}),
    ]
    assert result.ok and [s.step for s in result.steps] == ["stop_session", "mark_stopped", "kill_gpu_processes",
                                                             "wait_gpu_free"]


@pytest.mark.parametrize("force, first", [(False, OK), (True, SKIPPED)])
def test_gpu_clean_refuses_a_running_job_unless_forced(target, calls, force, first):
    result = commands.gpu_clean(target, force=force, gpu_free_timeout=5.0)
    assert [s.step for s in result.steps] == ["require_job_stopped", "kill_gpu_processes", "wait_gpu_free"]
    assert result.steps[0].status == first and calls[-1][2] == {"timeout_s": 5.0}


@pytest.mark.parametrize("command, kwargs, step, expected", [
    (commands.purge_cache, {}, "purge_cache", {}),
    (commands.deploy, {}, "deploy", {}),
    (commands.rollback, {}, "rollback", {"release": None}),
    (commands.rollback, {"release": "0.1.0-abcdef012345"}, "rollback", {"release": "0.1.0-abcdef012345"}),
])
def test_one_step_commands(target, calls, command, kwargs, step, expected):
    result = command(target, **kwargs)
    assert result.ok and calls == [(step, (target.job,), expected, calls[0][3])]


def test_the_help_states_the_commands_own_defaults():
    def shown(*args):
        return " ".join(CliRunner().invoke(commands_cli(), [*args, "--help"], terminal_width=200).output.split())

    relaunch = shown("relaunch")
    assert f"first training step (default {commands.default_of(commands.relaunch, 'timeout'):g})" in relaunch
    assert f"when stopping (default {commands.GRACE_S:g})" in relaunch
    assert f"SIGKILL (default {commands.default_of(commands.stop, 'grace'):g})" in shown("stop")
    assert commands.default_of(commands.relaunch, "timeout") == 900.0 and commands.GRACE_S == 30.0


def commands_cli():
    from dflash_ops.cli import cli

    return cli
