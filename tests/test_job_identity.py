"""One job, one identity: two jobs on one machine never share a session or a process marker, the
inventory refuses two targets that would, and a job launched by an earlier version (its marker
`<socket>/<session>`, its state without "job") is still seen and stopped. Real tmux, the stand-in
trainer on the local target."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.job import jobpaths
from dflash_ops.errors import InputError
from dflash_ops.inventory.load import builtin_inventory, load_inventory_text
from dflash_ops.job.model import Job

try:
    from tests.test_ops_e2e import STANDIN, cleanup, quick, standin  # noqa: F401 (cleanup: a fixture)
    from tests.ops_helpers import wait_for
    from tests.test_unattended_e2e import job_state
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_ops_e2e import STANDIN, cleanup, quick, standin  # noqa: F401
    from ops_helpers import wait_for
    from test_unattended_e2e import job_state


def trainer_pids(target) -> list[int]:
    """The living processes of the target's job, as the probe sees them."""
    return [p.pid for p in check_lib.check(target).status.processes]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------ the identity and the inventory


def test_the_default_session_and_the_marker_follow_the_workdir():
    a = Job(workdir="/srv/a", python="/p", config="tiny-cpu")
    b = Job(workdir="/srv/b", python="/p", config="tiny-cpu")
    assert a.session != b.session and a.session.startswith("dflash-")
    assert Job(workdir="/srv/a/", python="/q", config="x").session == a.session  # the workdir, not the rest
    # an explicit session shared by two workdirs still leaves them two markers
    shared_a, shared_b = (dataclasses.replace(j, session="train") for j in (a, b))
    assert jobpaths.marker_value(shared_a) != jobpaths.marker_value(shared_b)
    assert jobpaths.legacy_marker_value(shared_a) == "dflash/dflash"  # the old form, for old jobs only


TWO_LOCAL = """
targets:
  local: {{job: {{workdir: /tmp/a{extra_a}}}}}
  other: {{transport: local, job: {{workdir: {workdir_b}{extra_b}}}}}
"""


def test_the_inventory_refuses_two_jobs_on_one_machine_that_share_a_session():
    with pytest.raises(InputError) as info:
        load_inventory_text(
            TWO_LOCAL.format(extra_a=", session: s", workdir_b="/tmp/b", extra_b=", session: s")
        )
    message = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in message
    assert "target 'other': field 'job.session'" in message and "'local' runs another job" in message
    assert "leave job.session out" in message
    # without a session each gets its own; one workdir reached twice is one job, allowed
    apart = load_inventory_text(TWO_LOCAL.format(extra_a="", workdir_b="/tmp/b", extra_b=""))
    assert apart.targets["local"].job.session != apart.targets["other"].job.session
    load_inventory_text(TWO_LOCAL.format(extra_a=", session: s", workdir_b="/tmp/a", extra_b=", session: s"))


def test_ssh_targets_on_one_host_collide_only_for_one_user_with_different_workdirs():
    def inventory(user_b: str, workdir_b: str) -> str:
        return textwrap.dedent(f"""\
            defaults: {{host_key_policy: off, job: {{python: /v/bin/python3, config: tiny-cpu, session: dflash}}}}
            targets:
              a: {{transport: ssh, host: gpu.lan, job: {{workdir: /srv/a}}}}
              b: {{transport: ssh, host: gpu.lan, user: {user_b}, job: {{workdir: {workdir_b}}}}}
              ct: {{transport: pct, host: pve.lan, ctid: 200, job: {{workdir: /srv/a}}}}
            """)

    with pytest.raises(InputError, match="target 'b': field 'job.session'"):
        load_inventory_text(inventory("root", "/srv/b"))
    load_inventory_text(inventory("ops", "/srv/b"))  # another user: another tmux server
    load_inventory_text(inventory("root", "/srv/a"))  # one job, reached twice (and through pct)


# ------------------------------------------------------------------ two jobs on one machine, for real


def test_stopping_a_job_whose_session_name_another_job_holds_leaves_that_job_alone(
    local_target, tmp_path, cleanup
):
    """Two inventories (the loader cannot compare them) give two workdirs the same socket and
    session: stopping b ends nothing of a's and does not record a as stopped."""
    a = standin(local_target)
    cleanup(a)
    b = dataclasses.replace(
        a,
        name="b",
        job=dataclasses.replace(
            a.job,
            workdir=str(tmp_path / "work-b"),
            log_dir=str(tmp_path / "work-b/logs"),
            cache_dir=str(tmp_path / "work-b/cache"),
        ),
    )
    assert commands.relaunch(a, **quick()).ok
    pids = trainer_pids(a)
    assert pids

    stopped = commands.stop(b, grace=35.0)
    assert stopped.ok, stopped.summary()
    assert "runs another job's trainer: left alone" in stopped.steps[0].message
    assert all(alive(pid) for pid in pids), "b's stop ended a's trainer"
    assert job_state(a)["state"] == "running" and job_state(b)["state"] == "stopped"
    checked = check_lib.check(a)
    assert checked.verdict.level == "OK", checked.verdict.reasons
    assert check_lib.check(b).status.session.running is False  # a's trainer is never shown as b's
    relaunched = commands.relaunch(b, **quick())
    assert not relaunched.ok and "runs another job (pane pid" in relaunched.failed.message, relaunched.summary()
    assert "give this job another job.session" in relaunched.failed.message
    assert all(alive(pid) for pid in pids)


def test_the_builtin_local_target_under_two_homes_is_two_jobs(tmp_path, monkeypatch, cleanup):
    socket = f"t-{uuid.uuid4().hex[:8]}"
    targets = []
    for home in ("home-a", "home-b"):
        monkeypatch.setenv("HOME", str(tmp_path / home))
        local = builtin_inventory().targets["local"]
        targets.append(
            dataclasses.replace(
                local,
                job=dataclasses.replace(
                    local.job, python=STANDIN, tmux_socket=socket, env=(("STANDIN_MODE", "train"),)
                ),
            )
        )
    a, b = targets
    cleanup(a)
    assert a.job.session != b.job.session
    assert commands.relaunch(a, **quick()).ok
    pids = trainer_pids(a)
    assert commands.relaunch(b, **quick()).ok
    assert all(alive(pid) for pid in pids), "b's relaunch ended a's trainer"
    assert set(trainer_pids(a)) == set(pids) and not set(trainer_pids(b)) & set(pids)
    assert commands.stop(b).ok
    assert all(alive(pid) for pid in pids) and check_lib.check(a).verdict.level == "OK"


# ------------------------------------------------------------------ a job launched by an earlier version


def test_a_job_an_earlier_version_launched_is_seen_and_stopped(local_target, cleanup):
    target = standin(local_target)
    target = dataclasses.replace(target, job=dataclasses.replace(target.job, legacy_session="dflash-old"))
    cleanup(target)
    job = target.job
    Path(job.workdir).mkdir(parents=True)
    Path(job.log_dir).mkdir(parents=True)
    log = Path(job.log_dir) / "train-0001.log"
    log.write_text("")
    # what that version launched: its marker `<socket>/<session>`, its state without "job"
    marker = f"{jobpaths.JOB_MARKER_ENV}={jobpaths.legacy_marker_value(job)}"
    subprocess.run(
        [
            "tmux",
            "-L",
            job.tmux_socket,
            "new-session",
            "-d",
            "-s",
            "dflash-old",
            f"env {marker} {sys.executable} -c 'import time; time.sleep(300)'",
        ],
        check=True,
    )
    pane = subprocess.run(
        ["tmux", "-L", job.tmux_socket, "list-panes", "-s", "-t", "=dflash-old:", "-F", "#{pane_pid}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    Path(jobpaths.state_file(job)).write_text(
        json.dumps({"state": "running", "run": 1, "log": str(log), "pid": int(pane), "since": time.time()})
    )
    wait_for(lambda: trainer_pids(target), what="the old job's processes")

    seen = check_lib.check(target).status
    assert seen.session.running is True and seen.session.name == "dflash-old"
    pids = trainer_pids(target)
    stopped = commands.stop(target, grace=35.0)
    assert stopped.ok, stopped.summary()
    assert not any(alive(pid) for pid in pids)
    assert subprocess.run(["tmux", "-L", job.tmux_socket, "has-session", "-t", "=dflash-old"]).returncode != 0
    assert job_state(target)["state"] == "stopped"
    assert os.path.exists(jobpaths.state_file(job))
