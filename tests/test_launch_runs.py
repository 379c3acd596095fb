"""The launcher on the target (remote/launch_job.py) and its pieces: the run it chooses, the log it
numbers, the cache it adopts, the job state it writes with json (and the pane with the same
program), through real tmux and the stand-in trainer where it starts one."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops import remote
from dflash_ops.job import jobpaths, jobstate
from dflash_ops.act import launch
from dflash_ops.remote import launch_job, runs
from dflash_ops.transport.local import LocalTransport
from trainer import metrics_format

try:
    from tests.ops_helpers import wait_for
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import wait_for

STANDIN = str(Path(__file__).parent / "sim" / "standin-trainer")
HOSTILE = "w ö'q\" $(touch PWNED) `touch PWNED2` ; x;"


def test_the_pane_writes_the_finished_state_with_json_hostile_paths_as_data(tmp_path):
    root = tmp_path / HOSTILE
    root.mkdir()
    path = root / "job-state.json"
    fields = {"state": "finished", "run": 7, "run_dir": str(root / "runs/0007"), "log": str(root / "train-0012.log")}
    subprocess.run([sys.executable, "-I", "-c", remote.script_source("state_write.py"), str(path), json.dumps(fields),
                    "when"], cwd=tmp_path, check=True, timeout=30)
    written = json.loads(path.read_text())
    assert written == {**fields, "when": written["when"]} and isinstance(written["when"], int)
    assert jobstate.parse(path.read_text()) == jobstate.JobState(**written)
    assert [p.name for p in root.iterdir()] == ["job-state.json"]  # renamed into place, no tmp left
    assert not list(tmp_path.rglob("PWNED*"))


def test_a_state_that_cannot_be_renamed_into_place_leaves_no_tmp(tmp_path):
    from dflash_ops.remote import state_write

    (tmp_path / "state").mkdir()  # a directory where the file belongs
    with pytest.raises(OSError):
        state_write.write(str(tmp_path / "state"), {"state": "running"})
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


def test_resume_continues_the_newest_unfinished_run_by_number_not_by_text(tmp_path):
    for name in ("0009", "10000", "0011x", "abc", "012"):
        (tmp_path / name).mkdir()
    assert runs.choose(str(tmp_path), resume=True) == "10000"
    (tmp_path / "10000" / metrics_format.RUN_FINISHED).write_text("")
    assert runs.choose(str(tmp_path), resume=True) == "10001" and (tmp_path / "10001").is_dir()
    assert runs.choose(str(tmp_path), resume=False) == "10002"


def test_the_first_run_is_0001_and_its_dir_is_made(tmp_path):
    assert runs.choose(str(tmp_path / "runs"), resume=True) == "0001"
    assert (tmp_path / "runs" / "0001").is_dir()


def test_the_log_is_numbered_after_every_log_and_metrics_file(tmp_path):
    assert launch_job.next_log_number(str(tmp_path)) == "0001"
    for name in ("train-0003.log", "train-0007.metrics.jsonl", "train-x.log", "train-.log", "other-0099.log"):
        (tmp_path / name).write_text("")
    assert launch_job.next_log_number(str(tmp_path)) == "0008"


def test_the_cache_dir_is_adopted_only_when_it_holds_what_the_launcher_puts_there(tmp_path):
    entries = ["inductor", "triton", jobpaths.CACHE_MARKER]
    fresh, ours, foreign = tmp_path / "fresh", tmp_path / "ours", tmp_path / "foreign"
    (ours / "inductor").mkdir(parents=True)
    (foreign / "inductor").mkdir(parents=True)
    (foreign / "data.bin").write_text("")
    for cache in (fresh, ours, foreign):
        launch_job.prepare_cache(str(cache), str(cache / jobpaths.CACHE_MARKER), "sock/sess", entries)
    assert (fresh / jobpaths.CACHE_MARKER).read_text() == "sock/sess\n"
    assert (ours / jobpaths.CACHE_MARKER).read_text() == "sock/sess\n"
    assert not (foreign / jobpaths.CACHE_MARKER).exists()


@pytest.fixture
def job(local_target, tmp_path):
    root = tmp_path / HOSTILE
    job = dataclasses.replace(local_target.job, workdir=str(root / "work"), log_dir=str(root / "logs"),
                              cache_dir=str(root / "cache"), python=STANDIN, env=(("STANDIN_STEPS", "3"),),
                              session="s $(touch PWNED3) x;", tmux_socket=f"l-{tmp_path.name}"[:40])
    yield job
    subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], capture_output=True, timeout=20)


def run_launcher(job, **how) -> subprocess.CompletedProcess:
    with LocalTransport("local") as t:
        result = t.run(launch.launch_command(job, **how), stdin=remote.bundle(launch.LAUNCHER), timeout=60)
    return subprocess.CompletedProcess([], result.exit_code, result.stdout, result.stderr)


def state(job) -> dict:
    return json.loads(Path(jobpaths.state_file(job)).read_text())


def test_the_launcher_starts_the_run_and_records_running_then_the_pane_finished(job, tmp_path):
    launched = run_launcher(job)
    log = f"{job.log_dir}/train-0001.log"
    assert launched.returncode == 0 and launched.stdout.splitlines()[-1] == log, launched
    running = state(job)
    run_dir = f"{jobpaths.runs_dir(job)}/0001"
    assert list(running) == ["state", "run", "run_dir", "log", "job", "pid", "since"]
    assert running["job"] == jobpaths.marker_value(job)  # whose state it is (an earlier version wrote none)
    assert running["state"] == "running" and running["run"] == 1 and running["run_dir"] == run_dir
    assert running["log"] == log and running["pid"] > 0 and isinstance(running["since"], int)
    assert jobstate.parse(json.dumps(running)).pid == running["pid"]
    assert (Path(job.cache_dir) / jobpaths.CACHE_MARKER).read_text() == jobpaths.marker_value(job) + "\n"
    assert Path(jobpaths.inductor_cache(job)).is_dir() and Path(jobpaths.triton_cache(job)).is_dir()

    wait_for(lambda: state(job)["state"] == "finished", 30, "the run to finish")
    finished = state(job)
    assert finished == {"state": "finished", "run": 1, "run_dir": run_dir, "log": log, "job": running["job"],
                        "when": finished["when"]}
    assert f"--output-dir {run_dir} " in Path(log).read_text().splitlines()[0]

    subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], check=True, timeout=20)
    again = run_launcher(job)  # the finished run is not resumed: a new run, the next log
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == f"{job.log_dir}/train-0002.log", again
    assert state(job)["run"] == 2 and state(job)["run_dir"] == f"{jobpaths.runs_dir(job)}/0002"
    assert not list(tmp_path.rglob("PWNED*"))


def test_a_running_session_is_refused_with_exit_3_and_nothing_changes(job):
    long_job = dataclasses.replace(job, env=())
    assert run_launcher(long_job).returncode == 0
    before = state(job)
    refused = run_launcher(long_job)
    assert refused.returncode == 3 and refused.stderr.strip() == f"session {job.session} is already running; stop it first"
    assert state(job) == before and not Path(job.log_dir, "train-0002.log").exists()


def test_a_chosen_run_is_used_as_it_is_and_anything_else_is_refused(job):
    bad = run_launcher(job, run="12")
    assert bad.returncode == 2 and bad.stderr.strip() == "run 12 is not a run number (NNNN)", bad
    chosen = run_launcher(job, run="0042")
    assert chosen.returncode == 0, chosen
    assert state(job)["run"] == 42 and Path(jobpaths.runs_dir(job), "0042").is_dir()


def test_the_run_dir_of_earlier_versions_becomes_run_0001(job):
    legacy = Path(jobpaths.legacy_run_dir(job)) / "checkpoints" / "step-0000007"
    legacy.mkdir(parents=True)
    assert run_launcher(dataclasses.replace(job, env=())).returncode == 0
    assert (Path(jobpaths.runs_dir(job)) / "0001" / "checkpoints" / "step-0000007").is_dir()
    assert not Path(jobpaths.legacy_run_dir(job)).exists()


def test_the_launcher_and_the_run_choice_run_where_only_the_standard_library_is(job, tmp_path):
    def isolated(filename, args):  # -I -S: nothing of dflash_ops or the trainer is importable
        return subprocess.run([sys.executable, "-I", "-S", "-", json.dumps(args)], input=remote.bundle(filename),
                              capture_output=True, cwd=tmp_path, timeout=60)

    chosen = isolated("choose_run.py", {"runs": jobpaths.runs_dir(job), "resume": True})
    assert chosen.returncode == 0 and chosen.stdout == b"0001\n", chosen
    launched = isolated(launch.LAUNCHER, launch.launch_args(job, run="0001"))
    assert launched.returncode == 0 and launched.stdout.decode() == f"{job.log_dir}/train-0001.log\n", launched
    assert state(job)["run"] == 1 and state(job)["state"] == "running"
    wait_for(lambda: state(job)["state"] == "finished", 30, "the run to finish")
