"""Unattended operation end to end, one test per way it went wrong: a stop undone by health, a
healthy job reported dead after its log was deleted, a cache_dir that purged checkpoints, a relaunch
that stopped the job before finding out it could not start it, a relaunch after a finished run,
--fresh losing checkpoints, gpu-clean/purge-cache acting on a running job, foreign GPU processes.

Real tmux, real sshd + the pct simulator where the container matters, the nvidia-smi simulator and
the stand-in trainer (fast: 0.2 s steps, short timeouts). Each test also checks that a bystander
process outside the job is alive and that no checkpoint was lost."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.transport.factory import connect
from dflash_ops.observe.log_tail import tail_log
from dflash_ops.observe.status_output import target_text

from dflash_ops.job import jobpaths
from dflash_ops.cli import cli
from dflash_ops.errors import DflashOpsError
from dflash_ops.job.model import Health

try:
    from tests.ops_helpers import wait_for
    from tests.test_ops_e2e import _write_gpus, cleanup, quick, standin, step  # noqa: F401 (cleanup: a fixture)
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import wait_for
    from test_ops_e2e import _write_gpus, cleanup, quick, standin, step  # noqa: F401


def job_state(target) -> dict:
    return json.loads(Path(jobpaths.state_file(target.job)).read_text())


def checkpoints(target, run: int) -> list[str]:
    root = Path(jobpaths.runs_dir(target.job)) / f"{run:04d}" / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def finite(target, steps: int):
    """The stand-in trainer with a run of `steps` steps (a checkpoint every 5)."""
    return dataclasses.replace(target, job=dataclasses.replace(
        target.job, env=target.job.env + (("STANDIN_STEPS", str(steps)),)))


@pytest.fixture
def bystander():
    """A process outside the job: nothing dflash-ops does may signal it."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trainer_pid(target) -> int:
    checked = check_lib.check(target)
    start = next(r for r in checked.report.records if r.get("event") == "start")
    return int(start["pid"])


# 1 ------------------------------------------------------------------------------------------------

def test_case1_a_stop_is_never_undone_by_health(pct_target, cleanup, bystander, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    target = standin(pct_target)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    wait_for(lambda: checkpoints(target, 1), what="a checkpoint")
    stopped = commands.stop(target)
    assert stopped.ok, stopped.summary()
    assert step(stopped, "mark_stopped").message == "job state: stopped by dflash-ops stop"
    kept = checkpoints(target, 1)

    checked = check_lib.check(target)
    assert checked.verdict.level == "OK", checked.verdict
    assert checked.verdict.reasons[0].startswith("stopped by dflash-ops stop at ")
    assert commands.auto_relaunch(target, checked) is None  # nothing to do: nobody relaunches a stop
    assert checked.status.session.running is not True
    assert "job: stopped by dflash-ops stop, run 0001" in target_text(checked.status)

    again = commands.relaunch(target, **quick())  # only a relaunch clears the stop
    assert again.ok, again.summary()
    assert job_state(target)["state"] == "running" and job_state(target)["run"] == 1
    newest = int(max(kept)[len("step-"):])
    assert f"resumed from step {newest}" in Path(job_state(target)["log"]).read_text()
    assert alive(bystander.pid)


# 2 ------------------------------------------------------------------------------------------------

def test_case2_a_deleted_log_of_a_live_trainer_is_a_warning_not_a_fallback(local_target, cleanup, bystander):
    target = standin(local_target, health=Health(stall_seconds=2))
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    second = commands.relaunch(target, **quick())
    assert second.ok
    log = step(second, "launch").data["log"]
    assert log.endswith("train-0002.log")
    os.unlink(log)  # log rotation or a cleanup script
    pid = trainer_pid(target)
    time.sleep(3)  # longer than stall_seconds: the run goes on, only its log is gone

    checked = check_lib.check(target)
    assert checked.verdict.level == "WARNING", checked.verdict
    assert any(f"log {log} is missing while the trainer (pid {pid}) is alive" in r for r in checked.verdict.reasons)
    assert checked.status.log_missing == log and checked.status.log is None
    assert checked.status.metrics.endswith("train-0002.metrics.jsonl")  # never train-0001's
    assert checked.status.training.last_update_age_s < 2
    with pytest.raises(DflashOpsError, match="the log of run 0001, .*train-0002.log, is missing"):
        tail_log(target, lines=3, emit=lambda _line: None)
    assert alive(pid) and alive(bystander.pid)


# 3 ------------------------------------------------------------------------------------------------

def test_case3_purge_cache_deletes_only_what_the_launcher_marked(ssh_target, cleanup, bystander):
    target = standin(ssh_target)
    cleanup(target)
    # a cache_dir that is someone's data (validation refuses runs/releases/…; this one passes it)
    data = Path(target.job.workdir) / "data"
    (data / "inductor").mkdir(parents=True)
    (data / "precious.bin").write_text("not a cache")
    pointed = dataclasses.replace(target, job=dataclasses.replace(target.job, cache_dir=str(data)))
    refused = commands.purge_cache(pointed)
    assert not refused.ok and "no .dflash-ops-cache file" in refused.failed.message
    assert (data / "precious.bin").exists()
    relaunched = commands.relaunch(pointed, **quick())  # relaunch leaves it alone and goes on
    assert relaunched.ok, relaunched.summary()
    assert "left " + str(data) + " alone" in step(relaunched, "purge_cache").message
    assert not (data / jobpaths.CACHE_MARKER).exists()  # a dir with foreign files is never adopted
    assert commands.stop(pointed).ok
    assert (data / "precious.bin").exists()

    # the job's own cache: created with the marker by the launch, purged once the job is stopped
    assert commands.relaunch(target, **quick()).ok
    cache = Path(target.job.cache_dir)
    assert (cache / jobpaths.CACHE_MARKER).exists() and (cache / "inductor").is_dir()
    busy = commands.purge_cache(target)
    assert not busy.ok and "the job is running" in busy.failed.message and cache.exists()
    assert commands.stop(target).ok
    purged = commands.purge_cache(target)
    assert purged.ok and not cache.exists(), purged.summary()
    assert checkpoints(target, 1) and alive(bystander.pid)


# 4 ------------------------------------------------------------------------------------------------

@pytest.mark.slow  # one full torch import in preflight, seven relaunch attempts: ~15-30 s on 2 cores
def test_case4_relaunch_checks_before_it_stops(pct_target, gpu_state_path, cleanup, bystander):
    target = standin(pct_target, gpus=((0,), (1,)))
    cleanup(target)
    _write_gpus(gpu_state_path)
    try:
        assert commands.relaunch(target, **quick()).ok
        pid = trainer_pid(target)
        assert commands.relaunch(target, **quick(deploy=False)).ok  # a release is current: fine
        pid = trainer_pid(target)
        state = json.loads(gpu_state_path.read_text())

        gpu_state_path.write_text(json.dumps(dict(state, driver_error=True)))
        failed = commands.relaunch(target, **quick())
        assert failed.failed.step == "preflight" and "check 'GPU query'" in failed.failed.message
        assert "nothing was stopped" in failed.failed.message
        assert [s.status for s in failed.steps[1:]] == ["not-run"] * 7
        health = check_lib.check(target).verdict
        assert health.level == "WARNING" and any("GPUs 0,1 are assigned but the GPU query failed" in r
                                                 for r in health.reasons), health
        gpu_state_path.write_text(json.dumps(state))

        no_python = dataclasses.replace(target, job=dataclasses.replace(target.job, python="/nonexistent/python3"))
        failed = commands.relaunch(no_python, **quick())
        assert failed.failed.step == "preflight" and "check 'python'" in failed.failed.message
        assert "not installed" in failed.failed.message
        if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0:
            no_torch = dataclasses.replace(target, job=dataclasses.replace(target.job, python="/usr/bin/python3"))
            for full_import in (True, False):
                failed = commands.relaunch(no_torch, **quick(import_torch=full_import))
                assert failed.failed.step == "preflight" and "check 'python'" in failed.failed.message
                assert "/usr/bin/python3 cannot import torch" in failed.failed.message
                assert "No module named" in failed.failed.message, failed.failed.message
        imported = commands.relaunch(target, **quick(import_torch=True, min_free_gib=1e9))
        assert imported.failed.step == "preflight" and "check 'disk'" in imported.failed.message  # torch imported

        (Path(target.job.workdir) / "current").unlink()  # the release is gone and --no-deploy is asked
        failed = commands.relaunch(target, **quick(deploy=False))
        assert failed.failed.step == "preflight" and "check 'release'" in failed.failed.message

        assert alive_in_ct(target, pid) and trainer_pid(target) == pid, "a failed preflight stopped the job"
        assert check_lib.check(target).status.session.running is True

        # stop with the GPU query failing: the job's processes end, so the stop succeeds and says so
        gpu_state_path.write_text(json.dumps(dict(state, driver_error=True)))
        stopped = commands.stop(target)
        assert stopped.ok, stopped.summary()
        assert step(stopped, "wait_gpu_free").message.startswith("the job's processes are gone; GPUs not checked")
        assert not alive_in_ct(target, pid)
        assert check_lib.check(target).verdict.reasons[0].startswith("stopped by dflash-ops stop")
        assert alive(bystander.pid)
    finally:
        gpu_state_path.unlink(missing_ok=True)


def alive_in_ct(target, pid: int) -> bool:
    with connect(target) as t:
        return t.run(f"kill -0 {pid}", timeout=20).ok


# 5 and 6 ------------------------------------------------------------------------------------------

def test_case5_6_runs_finish_resume_and_fresh_keep_every_checkpoint(local_target, cleanup, bystander):
    target = finite(standin(local_target), 12)
    cleanup(target)
    first = commands.relaunch(target, **quick())
    assert first.ok, first.summary()
    wait_for(lambda: job_state(target)["state"] == "finished", what="the run to finish")
    assert checkpoints(target, 1) == ["step-0000005", "step-0000010", "step-0000012"]
    assert (Path(jobpaths.runs_dir(target.job)) / "0001" / jobpaths.RUN_FINISHED).exists()
    checked = check_lib.check(target)
    assert checked.verdict.level == "OK" and checked.verdict.reasons == ("finished at step 12",)

    # the README's main command, run a second time: a new run, not a resume of the finished one
    second = commands.relaunch(target, **quick())
    assert second.ok, second.summary()
    assert job_state(target)["run"] == 2 and job_state(target)["state"] in ("running", "finished")
    wait_for(lambda: job_state(target)["state"] == "finished", what="run 2 to finish")

    # --fresh after a finished run, then stop: each run keeps its own newest checkpoints
    long_run = finite(target, 400)
    fresh = commands.relaunch(long_run, **quick(resume=False))
    assert fresh.ok, fresh.summary()
    assert job_state(target)["run"] == 3
    wait_for(lambda: checkpoints(target, 3), what="a checkpoint of run 3")
    assert commands.stop(target).ok
    newest = checkpoints(target, 3)[-1]
    log = Path(job_state(target)["log"]).read_text()
    assert f"last checkpoint {jobpaths.runs_dir(target.job)}/0003/checkpoints/{newest}" in log
    assert checkpoints(target, 1) == ["step-0000005", "step-0000010", "step-0000012"]
    assert checkpoints(target, 2) == ["step-0000005", "step-0000010", "step-0000012"]

    # the next relaunch resumes run 3 where it stopped, not run 1's step 12
    resumed = commands.relaunch(long_run, **quick())
    assert resumed.ok, resumed.summary()
    assert job_state(target)["run"] == 3
    assert f"resumed from step {int(newest[5:])}" in Path(job_state(target)["log"]).read_text()
    assert alive(bystander.pid)


# 7 ------------------------------------------------------------------------------------------------

def test_case7_gpu_clean_and_purge_cache_refuse_while_the_job_lives(local_target, cleanup, bystander):
    target = standin(local_target)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    pid = trainer_pid(target)
    refused = commands.gpu_clean(target, gpu_free_timeout=5.0)
    assert refused.failed.step == "require_job_stopped" and str(pid) in refused.failed.message
    assert "--force" in refused.failed.message and alive(pid)
    help_text = CliRunner().invoke(cli, ["gpu-clean", "--help"]).output
    assert "the trainer included" in help_text and "--force" in help_text

    # an orphan carrying the job's marker, outside the tmux tree
    assert commands.stop(target).ok
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True,
                              env={**os.environ, jobpaths.JOB_MARKER_ENV: jobpaths.marker_value(target.job)})
    try:
        busy = commands.purge_cache(target)
        assert not busy.ok and f"{orphan.pid} (sleep 300)" in busy.failed.message
        assert Path(target.job.cache_dir).exists()
        forced = commands.gpu_clean(target, force=True, gpu_free_timeout=5.0)
        assert forced.ok and "ended 1 process" in step(forced, "kill_gpu_processes").message
        orphan.wait(10)
        assert commands.purge_cache(target).ok and not Path(target.job.cache_dir).exists()
    finally:
        orphan.kill()
    assert checkpoints(target, 1) and alive(bystander.pid)


# 8 ------------------------------------------------------------------------------------------------

def test_case8_foreign_gpu_processes_are_reported_and_do_not_block_stop(pct_target, gpu_state_path, cleanup,
                                                                          bystander, tmp_path):
    target = standin(pct_target, gpus=((0,), (1,)))
    cleanup(target)
    _write_gpus(gpu_state_path)
    pid_file = tmp_path / "foreign.pid"
    with connect(target) as t:  # a foreign process in the container, on the job's GPU 1
        t.check(f"setsid -f bash -c 'echo $$ > {pid_file}; exec sleep 300' </dev/null >/dev/null 2>&1", timeout=20)
    foreign = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="the foreign pid"))
    try:
        started = commands.relaunch(target, **quick())
        assert started.ok
        state = json.loads(gpu_state_path.read_text())
        state["compute_apps"].append({"pid": foreign, "gpu_index": 1, "used_memory_mib": 7000, "process_name": "sleep"})
        gpu_state_path.write_text(json.dumps(state))

        checked = check_lib.check(target)
        assert checked.verdict.level == "WARNING", checked.verdict
        assert any(f"pid {foreign} sleep on GPU 1 (7000 MiB" in r for r in checked.verdict.reasons)
        procs = {p.pid: p for g in checked.status.gpus for p in g.processes}
        assert procs[foreign].foreign is True
        assert [p.foreign for pid, p in procs.items() if pid != foreign] == [False]  # the trainer, on GPUs 0 and 1
        assert "[foreign]" in target_text(checked.status)

        began = time.monotonic()
        stopped = commands.stop(target, gpu_free_timeout=30.0)
        assert stopped.ok, stopped.summary()
        assert time.monotonic() - began < 20  # no wait for a process that is not the job's
        assert f"pid {foreign} sleep on GPU 1" in step(stopped, "kill_gpu_processes").message
        assert alive_in_ct(target, foreign)

        # a job whose trainer already exited: stop says so instead of "ended 1 process(es)"
        crashed = standin(pct_target, mode="crash")
        cleanup(crashed)
        commands.relaunch(crashed, **quick())
        wait_for(lambda: check_lib.check(crashed).status.session.exists and
                 not check_lib.check(crashed).status.session.running, what="the crash")
        again = commands.stop(crashed)
        message = step(again, "stop_session").message
        # tmux (3.3a, in the simulated container) now and then marks the pane dead without ever
        # reporting #{pane_dead_status}: stop then says the status is unknown, never "ended N process(es)".
        assert again.ok and message.startswith(("the trainer had already exited (status 1)",
                                                "the trainer had already exited (status ?)")), message
    finally:
        with connect(target) as t:
            t.run(f"kill {foreign}", timeout=20)
        gpu_state_path.unlink(missing_ok=True)
    assert alive(bystander.pid)


def test_the_single_run_dir_of_earlier_versions_becomes_run_0001_and_is_resumed(local_target, cleanup):
    target = standin(local_target)
    cleanup(target)
    legacy = Path(target.job.workdir) / "run" / "checkpoints" / "step-0000007"
    legacy.mkdir(parents=True)
    (legacy / "state.json").write_text('{"step": 7}')
    old_cache = Path(target.job.cache_dir) / "inductor"
    old_cache.mkdir(parents=True)  # what an earlier version's launch left: adopted, so purgeable
    assert commands.relaunch(target, **quick()).ok
    assert (Path(target.job.cache_dir) / jobpaths.CACHE_MARKER).exists()
    assert job_state(target)["run"] == 1 and not legacy.parent.parent.exists()
    assert "resumed from step 7" in Path(job_state(target)["log"]).read_text()
    assert "step-0000007" in checkpoints(target, 1)


def test_a_host_pid_invisible_in_the_container_is_never_called_foreign():
    from dflash_ops.act.processes import surely_foreign

    others = [{"pid": 1, "owner": "", "visible": False},  # inside LXC: maybe the job's own trainer
              {"pid": 2, "owner": "ct 201", "visible": False}, {"pid": 3, "owner": "", "visible": True},
              {"pid": 4, "owner": "gone", "visible": False}]
    assert [o["pid"] for o in surely_foreign(others)] == [2, 3]


def test_an_unreachable_container_fails_the_reachable_check_before_anything(stopped_pct_target):
    result = commands.relaunch(stopped_pct_target, **quick())
    assert result.failed.step == "preflight" and "check 'reachable'" in result.failed.message
    assert "not running" in result.failed.message and "nothing was stopped" in result.failed.message
    assert [s.status for s in result.steps[1:]] == ["not-run"] * 7
