"""What the target says is data, never an order: a dead pane's pid taken over by a foreign process, a
symlinked cache path, damaged job state files, a deleted log whose metrics stay, two relaunches at once.

Real tmux, real sshd + the pct simulator (a container with its own pid namespace, so a test can put
a foreign process on a chosen pid through /proc/sys/kernel/ns_last_pid), the stand-in trainer.
Each test checks that no foreign process was signalled, no checkpoint was lost, and that every
failure is one line with a defined exit code and no traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.transport.factory import connect

from dflash_ops.job import jobpaths

try:
    from tests.test_ops_e2e import STANDIN, cleanup, quick, standin, step  # noqa: F401 (cleanup: a fixture)
    from tests.ops_helpers import ops_argv, wait_for
    from tests.test_unattended_e2e import alive, bystander, checkpoints, finite, job_state  # noqa: F401
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_ops_e2e import STANDIN, cleanup, quick, standin, step  # noqa: F401
    from ops_helpers import ops_argv, wait_for
    from test_unattended_e2e import alive, bystander, checkpoints, finite, job_state  # noqa: F401

# Run in the container: fork until a child gets pid WANT (ns_last_pid says which pid comes next in
# this pid namespace); that child leaves the session and becomes `sleep 300`, a process that has
# nothing to do with the job. Prints the pid it got.
ON_PID = r"""
import os, sys
want = int(sys.argv[1])
for _ in range(50):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(want - 1))
    pid = os.fork()
    if pid == 0:
        if os.getpid() == want:
            os.setsid()
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execvp("sleep", ["sleep", "300"])
        os._exit(0)
    if pid == want:
        print(pid)
        sys.exit(0)
    os.waitpid(pid, 0)
sys.exit("pid %d stayed taken" % want)
"""


def in_ct(target, script: str, timeout: float = 30):
    with connect(target) as t:
        return t.run(script, timeout=timeout)


def foreign_on_pid(target, pid: int) -> int:
    """A real foreign process in the target's container, on `pid` (which must be free)."""
    got = in_ct(target, _python_c(ON_PID, str(pid)))
    assert got.ok, got.stderr
    assert int(got.stdout.strip()) == pid
    return pid


def _python_c(code: str, *args: str) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in (sys.executable, "-c", code, *args))


def alive_in(target, pid: int) -> bool:
    return in_ct(target, f"test -d /proc/{pid} && ! grep -q '^State:.*Z' /proc/{pid}/status").ok


def dead_pane_pid(target) -> int:
    """The pid tmux still lists for the job's pane after its trainer ended (remain-on-exit)."""
    out = in_ct(
        target,
        f"tmux -L {target.job.tmux_socket} list-panes -s -t '={target.job.session}:' "
        "-F '#{pane_pid} #{pane_dead}'",
    ).stdout.split()
    assert out[1] == "1", out
    return int(out[0])


def cli(*argv: str, inventory: Path) -> tuple[int, str, str]:
    """The CLI as cron runs it, on the inventory's one target: its own process, so a traceback
    would show on stderr."""
    (name,) = json.loads(inventory.read_text())["targets"]
    proc = subprocess.run(
        ops_argv(inventory, *argv, "-t", name),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


# 1 ------------------------------------------------------------------------------------------------


def test_a_foreign_process_on_a_dead_panes_pid_is_never_the_jobs(pct_target, cleanup, bystander):
    target = finite(standin(pct_target), 6)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    wait_for(lambda: job_state(target)["state"] == "finished", what="the run to finish")
    seen: list = []
    try:
        pane = wait_for(lambda: _dead(target, seen), seconds=60, what="tmux to reap the pane")
    except AssertionError:
        raise AssertionError(f"the pane never became dead and reaped: {seen[-3:]}") from None
    foreign = foreign_on_pid(target, pane)
    kept = checkpoints(target, 1)
    try:
        checked = check_lib.check(target)
        assert foreign not in [p.pid for p in checked.status.processes], checked.status.processes

        stopped = commands.stop(target)
        assert stopped.ok, stopped.summary()
        assert "ended" not in step(stopped, "stop_session").message, step(stopped, "stop_session").message
        assert alive_in(target, foreign), "stop signalled a foreign process that took the dead pane's pid"

        assert commands.purge_cache(target).ok  # never "the job is running (pids <foreign>)"
        cleaned = commands.gpu_clean(target, gpu_free_timeout=5.0)
        assert cleaned.ok and str(foreign) not in cleaned.summary(), cleaned.summary()
        relaunched = commands.relaunch(finite(target, 400), **quick())
        assert relaunched.ok, relaunched.summary()
        assert alive_in(target, foreign)
        assert commands.stop(target).ok
        assert alive_in(target, foreign)
        assert set(kept) <= set(checkpoints(target, 1)) | set(checkpoints(target, 2))
    finally:
        in_ct(target, f"kill {foreign}")
    assert alive(bystander.pid)


def _dead(target, seen: list):
    try:
        pid = dead_pane_pid(target)
    except AssertionError as exc:
        seen.append(str(exc))
        return None
    # reaped: nothing (not even a zombie) holds the pid any more
    holder = in_ct(target, f"cat /proc/{pid}/stat 2>/dev/null; true").stdout.strip()
    seen.append(holder)
    if holder.split(") ", 1)[-1].startswith("Z "):
        _nudge_tmux(target, parent=int(holder.split(") ", 1)[1].split()[1]))
    return pid if not holder else None


def _nudge_tmux(target, parent: int) -> None:
    """A pane's zombie stays until its tmux server gets another SIGCHLD: tmux built with
    libutempter (Debian's) loses the SIGCHLD of a child that exits while utempter's own handler is
    in (tmux/tmux#311, #4559), about 1 run in 15 here. The pid is only free for a foreign process
    once tmux reaps it, so hand the server the signal it missed (only if it is a tmux server)."""
    in_ct(target, f"grep -q '^Name:.*tmux' /proc/{parent}/status && kill -CHLD {parent}; true")


# helpers for the CLI runs --------------------------------------------------------------------------

def inventory_of(target, path: Path) -> Path:
    """An inventory file naming `target` as the tests built it (JSON is YAML)."""
    job = target.job
    fields = {"transport": target.transport,
              "job": {"workdir": job.workdir, "python": job.python, "config": job.config,
                      "session": job.session, "tmux_socket": job.tmux_socket, "cache_dir": job.cache_dir,
                      "env": dict(job.env), "health": {"stall_seconds": job.health.stall_seconds}}}
    if target.ssh is not None:
        s = target.ssh
        fields.update(host=s.host, port=s.port, user=s.user, identity_file=s.identity_file,
                      known_hosts_file=s.known_hosts_file, connect_timeout_s=s.connect_timeout_s)
    if target.ctid is not None:
        fields["ctid"] = target.ctid
    path.write_text(json.dumps({"targets": {target.name: fields}}))
    return path


def named(target, session="job-1"):
    """`target` with a session name the inventory accepts (the fixtures' names hold a space)."""
    return dataclasses.replace(target, job=dataclasses.replace(target.job, session=session))


def one_line(stdout: str, stderr: str) -> str:
    assert "Traceback" not in stdout + stderr, stdout + stderr
    lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
    return lines[-1] if lines else ""


# 2 ------------------------------------------------------------------------------------------------

def test_a_cache_dir_through_a_symlink_into_runs_is_refused_on_the_target(ssh_target, cleanup, bystander, tmp_path):
    target = named(standin(ssh_target))
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    wait_for(lambda: len(checkpoints(target, 1)) >= 2, what="checkpoints")
    assert commands.stop(target).ok
    kept = checkpoints(target, 1)
    work = Path(target.job.workdir)
    (work / "scratch").symlink_to(work / "runs")  # on the target: scratch -> runs
    aimed = dataclasses.replace(target, job=dataclasses.replace(target.job, cache_dir=str(work / "scratch" / "0001")))
    (work / "runs" / "0001" / jobpaths.CACHE_MARKER).write_text("planted\n")  # as a past launch marked it
    inventory = inventory_of(aimed, tmp_path / "inv.json")
    real = work / "runs" / "0001"

    for command in (["purge-cache"], ["relaunch", "--timeout", "30"]):
        code, out, err = cli(*command, inventory=inventory)
        line = one_line(out, err)
        assert code == 1, (command, out, err)
        assert f"job.cache_dir {work}/scratch/0001 (on the target: {real}) lies inside the runs" in line, line
    relaunch_err = cli("relaunch", "--timeout", "30", inventory=inventory)[2]
    assert "check 'cache'" in relaunch_err and "nothing was stopped" in relaunch_err
    assert checkpoints(target, 1) == kept and (real / "checkpoints").is_dir()
    assert alive(bystander.pid)


# 3 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["$(touch /tmp/dflash-pwned)", 1e308, "yesterday", [1, 2], {"t": 1}, True, -5])
def test_a_stopped_state_with_an_unusable_when_is_ok_in_one_line(pct_target, tmp_path, when):
    target = named(standin(pct_target))
    work = Path(target.job.workdir)
    work.mkdir(parents=True)
    Path(jobpaths.state_file(target.job)).write_text(json.dumps({"state": "stopped", "by": "dflash-ops stop",
                                                                 "when": when, "run": 1}))
    inventory = inventory_of(target, tmp_path / "inv.json")
    code, out, err = cli("health", inventory=inventory)
    assert code == 0, (out, err)
    assert out.count("DFLASH ") == 1 and one_line(out, err).startswith(
        f"DFLASH OK: {target.name}: stopped by dflash-ops stop at an unknown time"), out
    code, out, err = cli("status", "--json", inventory=inventory)
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["verdict"] == "OK"
    code, out, err = cli("status", inventory=inventory)
    assert code == 0 and "job: stopped by dflash-ops stop, run 0001" in out and "Traceback" not in err
    assert not Path("/tmp/dflash-pwned").exists()


def test_a_check_that_raises_is_one_unknown_line_naming_the_target(pct_target, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dflash_ops.cli import cli as cli_group

    target = named(standin(pct_target))
    inventory = inventory_of(target, tmp_path / "inv.json")

    def broken(*_args, **_kwargs):
        raise OverflowError("timestamp out of range for platform time_t")

    monkeypatch.setattr(check_lib, "check", broken)
    result = CliRunner().invoke(cli_group, ["--inventory", str(inventory), "health", "-t", target.name])
    assert result.exit_code == 3 and result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.strip() == (f"DFLASH UNKNOWN: {target.name}: the check itself failed "
                                     "(OverflowError: timestamp out of range for platform time_t)")
    result = CliRunner().invoke(cli_group, ["--inventory", str(inventory), "status", "--json", "-t", target.name])
    assert result.exit_code == 3
    assert json.loads(result.output)["reasons"] == [
        "the check itself failed (OverflowError: timestamp out of range for platform time_t)"]


# 4 ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("log", [12345, ["/etc/passwd"], {"path": "x"}, ""])
def test_tail_log_on_a_log_that_is_no_path_is_one_line(pct_target, tmp_path, log):
    target = named(standin(pct_target))
    Path(target.job.workdir).mkdir(parents=True)
    Path(jobpaths.state_file(target.job)).write_text(json.dumps({"state": "running", "run": 1, "log": log}))
    code, out, err = cli("tail-log", "-n", "3", inventory=inventory_of(target, tmp_path / "inv.json"))
    line = one_line(out, err)
    assert code == 1 and len((out + err).strip().splitlines()) == 1, (out, err)
    assert "job state" in line and ("names a log that is not a path" in line or "no dflash-ops job state" in line)
    assert "--log PATH" in line


# 5 ------------------------------------------------------------------------------------------------

def no_session(target) -> bool:
    return not in_ct(target, f"tmux -L {target.job.tmux_socket} has-session -t '={target.job.session}'").ok


@pytest.mark.parametrize("text, why", [
    ("[" * 50_000, "not JSON (RecursionError)"),
    ('{"state": "stopped", "by": "' + "x" * 100_000 + '"}', "larger than 65536 bytes"),
    ('{"state": ["stopped"], "when": 1}', "not a dflash-ops job state"),
    ("\x00\xff garbage", "not JSON"),
])
def test_a_damaged_state_is_unknown_never_relaunched_and_tail_log_says_so(pct_target, tmp_path, monkeypatch,
                                                                         text, why):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    target = named(standin(pct_target))
    Path(target.job.workdir).mkdir(parents=True)
    Path(jobpaths.state_file(target.job)).write_text(text)
    inventory = inventory_of(target, tmp_path / "inv.json")
    code, out, err = cli("health", "--auto-relaunch", inventory=inventory)
    line = out.splitlines()[0]
    assert code == 3 and out.count("DFLASH ") == 1 and "Traceback" not in err, (out, err)
    assert line.startswith(f"DFLASH UNKNOWN: {target.name}: job state ") and why in line, line
    assert "nothing is relaunched" in line and no_session(target)
    code, out, err = cli("status", "--json", inventory=inventory)
    assert code == 3 and why in json.loads(out)["job_state_error"]
    code, out, err = cli("tail-log", inventory=inventory)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--log PATH" in err


def test_wrong_types_in_every_field_of_a_stop_read_as_absent(pct_target, tmp_path):
    target = named(standin(pct_target))
    Path(target.job.workdir).mkdir(parents=True)
    Path(jobpaths.state_file(target.job)).write_text(json.dumps(
        {"state": "stopped", "run": "0001", "run_dir": 7, "pid": "1", "since": [], "when": {"t": 1},
         "by": {"who": "x"}, "extra": [[[]]]}))
    inventory = inventory_of(target, tmp_path / "inv.json")
    code, out, err = cli("health", inventory=inventory)
    assert code == 0 and one_line(out, err).startswith(
        f"DFLASH OK: {target.name}: stopped by dflash-ops stop at an unknown time"), (out, err)
    code, out, err = cli("status", inventory=inventory)
    assert code == 0 and "\njob: stopped\n" in out and "Traceback" not in err


def test_a_stop_that_cannot_be_recorded_fails_loudly_and_is_never_undone(pct_target, cleanup, bystander,
                                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    target = named(standin(pct_target))
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    wait_for(lambda: checkpoints(target, 1), what="a checkpoint")
    state = Path(jobpaths.state_file(target.job))
    state.unlink()
    state.mkdir()  # job-state.json is a directory: no state can be written there
    inventory = inventory_of(target, tmp_path / "inv.json")

    code, out, err = cli("stop", inventory=inventory)
    assert code == 1 and "Traceback" not in out + err, (out, err)
    assert "mark_stopped" in err and "the stop could not be recorded" in err, err
    assert f"{state} is not a regular file" in err and "job state: stopped" not in out
    assert state.is_dir() and list(state.iterdir()) == []  # nothing written inside it
    assert no_session(target)

    code, out, err = cli("health", "--auto-relaunch", inventory=inventory)
    assert code == 3 and out.startswith(f"DFLASH UNKNOWN: {target.name}: job state {state} is unusable "
                                        "(not a regular file)"), (out, err)
    assert "auto-relaunch" not in out and no_session(target), out
    code, out, err = cli("relaunch", "--timeout", "30", inventory=inventory)  # never launched unrecorded
    assert code == 1 and f"check 'job state': {state} is not a regular file" in err, (out, err)
    assert "nothing was stopped" in err and no_session(target) and list(state.iterdir()) == []
    assert checkpoints(target, 1) and alive(bystander.pid)


# 6 ------------------------------------------------------------------------------------------------

def test_a_deleted_logs_number_and_metrics_are_never_reused(pct_target, cleanup, bystander):
    target = standin(pct_target)
    cleanup(target)
    first = commands.relaunch(target, **quick())
    assert first.ok
    old_log = Path(step(first, "launch").data["log"])
    old_metrics = Path(str(old_log)[: -len(".log")] + ".metrics.jsonl")
    wait_for(lambda: old_metrics.read_text().count('"step"') >= 12, what="a dozen steps")
    assert commands.stop(target).ok
    before = old_metrics.read_bytes()
    last_old = max(json.loads(line).get("step", 0) for line in before.decode().splitlines())
    old_log.unlink()

    again = commands.relaunch(target, **quick())
    assert again.ok, again.summary()
    new_log = step(again, "launch").data["log"]
    assert new_log.endswith("train-0002.log"), new_log
    assert old_metrics.read_bytes() == before  # the old trainer's file is nobody's to append to
    first_step = step(again, "wait_first_step").data["step"]["step"]
    assert first_step > last_old  # resumed past the old run's checkpoint; never its last step read back
    assert job_state(target)["log"] == new_log
    assert alive(bystander.pid)


def test_progress_counts_only_records_of_the_trainer_the_launch_started(pct_target, tmp_path, cleanup):
    """A metrics file that holds an earlier trainer's records (its start older than the launch)
    shows no progress until the new trainer's start record."""
    target = named(standin(pct_target))
    cleanup(target)
    work = Path(target.job.workdir)
    logs = work / "logs"
    logs.mkdir(parents=True)
    log = logs / "train-0001.log"
    log.write_text("starting\n")
    now = time.time()
    old = [{"v": 1, "event": "start", "time": now - 1000, "pid": 1, "total_steps": 1000},
           {"v": 1, "event": "step", "time": now - 900, "step": 156, "total_steps": 1000, "loss": 1.0,
            "tokens_per_s": 50000.0, "eta_s": 10.0}]
    (logs / "train-0001.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    Path(jobpaths.state_file(target.job)).write_text(json.dumps(
        {"state": "running", "run": 1, "log": str(log), "since": int(now) - 1}))
    in_ct(target, f"tmux -L {target.job.tmux_socket} new-session -d -s {target.job.session} 'sleep 300'")
    code, out, err = cli("status", "--json", inventory=inventory_of(target, tmp_path / "inv.json"))
    assert json.loads(out)["training"]["step"] is None, out  # never the old trainer's step 156


# the job's lock -----------------------------------------------------------------------------------

def test_two_relaunches_at_once_one_says_who_runs_and_touches_nothing(pct_target, cleanup, bystander, tmp_path):
    slow = tmp_path / "slow-trainer"  # the trainer starts 10 s late: the first relaunch holds the lock meanwhile
    slow.write_text(f'#!/bin/bash\ncase " $* " in *" -m trainer "*) sleep 10 ;; esac\nexec {STANDIN} "$@"\n')
    slow.chmod(0o755)
    target = named(standin(pct_target))
    target = dataclasses.replace(target, job=dataclasses.replace(target.job, python=str(slow)))
    cleanup(target)
    inventory = inventory_of(target, tmp_path / "inv.json")
    argv = ops_argv(inventory, "relaunch", "-t", target.name, "--timeout", "60", "--grace", "30")
    winner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        seen = [winner.stdout.readline()]
        while "preflight ... ok" not in seen[-1]:  # the first relaunch is under way
            assert seen[-1], "".join(seen)
            seen.append(winner.stdout.readline())
        loser = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        stop = subprocess.run([*argv[:5], "stop", "-t", target.name], capture_output=True, text=True, timeout=120)
        won_out, won_err = winner.communicate(timeout=240)
        won_out = "".join(seen) + won_out
    finally:
        winner.kill()
    assert winner.returncode == 0, won_out + won_err
    for other, _command in ((loser, "relaunch"), (stop, "stop")):
        assert other.returncode == 75, other.stdout + other.stderr
        line = one_line(other.stdout, other.stderr)
        assert f"another relaunch is running (pid {winner.pid} on " in line, line
        assert "nothing was done here" in line and "[1/" not in other.stdout  # no step ran
    assert job_state(target)["state"] == "running" and job_state(target)["run"] == 1
    assert check_lib.check(target).status.session.running is True  # the winner's trainer, never stopped
    assert not Path(jobpaths.lock_file(target.job)).read_text().strip()  # released when the winner ended
    assert alive(bystander.pid)


def test_the_lock_goes_with_a_command_that_dies(pct_target, cleanup, tmp_path):
    target = named(standin(pct_target))
    cleanup(target)
    inventory = inventory_of(target, tmp_path / "inv.json")
    lock = Path(jobpaths.lock_file(target.job))
    argv = ops_argv(inventory, "relaunch", "-t", target.name, "--timeout", "60", "--grace", "30")
    doomed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: lock.exists() and lock.read_text().strip(), what="the relaunch to hold the lock")
    doomed.kill()  # SIGKILL: no cleanup of ours runs; the connection closes with the process
    doomed.wait()
    result = wait_for(lambda: (lambda r: r if r.returncode != 75 else None)(
        subprocess.run(argv, capture_output=True, text=True, timeout=240)), seconds=60, what="the lock to go")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_live_panes_pid_needs_proof_a_foreign_process_there_is_never_a_root():
    """The state a real tmux shows only for an instant (a pane still open while its pid was reaped
    and reused) is written here as tmux's answer; the processes are real."""
    from dflash_ops.remote import procs

    marker = b"DFLASH_OPS_JOB=t/job"
    foreign = subprocess.Popen(["sleep", "60"])
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, "DFLASH_OPS_JOB": "t/job"})
    try:
        time.sleep(0.2)
        table = procs.process_table()
        started = procs.started_at(table, foreign.pid, procs.boot_time())
        answer = "\n".join([
            f"{foreign.pid}:0::{int(started) - 600}",  # alive per tmux, but started long after the session
            f"{marked.pid}:0::{int(started) - 600}",  # the same, carrying the job's marker: the job's
            f"{foreign.pid}:1:0:{int(started)}",  # dead: never a root, whenever it started
            "garbage:line", "12x:0::1",
        ])
        panes = procs.parse_panes(answer)
        assert [p["pid"] for p in panes] == [foreign.pid, marked.pid, foreign.pid]
        assert procs.owned_pane_roots(panes, table, marker) == [marked.pid]
        assert foreign.pid not in procs.job_pids(panes, table, marker)
        fresh = procs.parse_panes(f"{foreign.pid}:0::{int(started)}")  # forked with its session: the job's
        assert procs.owned_pane_roots(fresh, table, marker) == [foreign.pid]
        assert len(procs.parse_panes("1:0\n" * 1000)) == procs.MAX_PANES
    finally:
        for proc in (foreign, marked):
            proc.kill()
            proc.wait()


def test_metrics_records_of_the_wrong_types_read_as_absent():
    from dflash_ops.observe import logs

    records = [{"v": 1, "event": "start", "time": "soon", "total_steps": "many"},
               {"v": 1, "event": "step", "time": 5.0, "step": 3, "total_steps": 9},
               {"v": 1, "event": "step", "time": [], "step": "four", "total_steps": None, "loss": "low"},
               {"v": 1, "event": "done", "time": {}, "reason": "max_steps"}]
    progress = logs.progress(records)
    assert (progress.step, progress.total_steps, progress.loss, progress.start_time) == (None, None, None, None)
    assert progress.done_reason == "max_steps"


def test_an_unreachable_target_is_left_to_the_preflight_not_the_lock(silent_server, ssh_target):
    target = dataclasses.replace(ssh_target, ssh=dataclasses.replace(ssh_target.ssh, port=silent_server,
                                                                     connect_timeout_s=1.0))
    result = commands.relaunch(target, **quick())
    assert result.failed.step == "preflight" and "check 'reachable'" in result.failed.message
    assert "nothing was stopped" in result.failed.message


@pytest.mark.parametrize("locale", [{}, {"LANG": "C.UTF-8"}])
def test_the_pane_answer_reads_the_same_outside_a_utf8_locale(tmp_path, locale):
    """cron and a bare ssh session run tmux in the C locale, where it prints a tab as "_": the pane
    list must still read as the live pane it is (else health would call a running job gone)."""
    from dflash_ops.job import tmux
    from dflash_ops.remote import procs

    socket = f"locale-{os.getpid()}-{len(locale)}"
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "job", "sleep 60"], check=True)
    try:
        bare = {k: v for k, v in os.environ.items() if not k.startswith(("LANG", "LC_"))}  # the C locale
        env = {**bare, **locale}
        answer = subprocess.run(procs.pane_command(socket, "job"), env=env, capture_output=True, text=True).stdout
        panes = procs.parse_panes(answer)
        assert len(panes) == 1 and not panes[0]["dead"] and panes[0]["created"], answer
        assert tmux.pane_problem(answer) is None
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
