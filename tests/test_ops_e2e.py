"""relaunch / status / health / tail-log / stop end to end: real tmux, real sshd, the pct simulator,
the nvidia-smi simulator, and a stand-in trainer that honours the metrics contract."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.transport.factory import connect
from dflash_ops.observe.log_tail import tail_log
from dflash_ops.observe.status_output import target_text
from dflash_ops.job import jobpaths
from dflash_ops.act import launch
from dflash_ops.job.model import Health
from dflash_ops.job.relaunch_guard import RelaunchGuard

try:
    from tests.ops_helpers import wait_for
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import wait_for

STANDIN = str(Path(__file__).parent / "sim" / "standin-trainer")


def standin(target, mode="train", gpus=((), ()), health=None, **job_fields):
    """The target's job, running the stand-in trainer on its own tmux socket."""
    tag = uuid.uuid4().hex[:8]
    job = dataclasses.replace(
        target.job, python=STANDIN, env=(("STANDIN_MODE", mode),), tmux_socket=f"t-{tag}",
        session=f"job {tag}", target_gpus=tuple(gpus[0]), drafter_gpus=tuple(gpus[1]),
        health=health or Health(stall_seconds=30), **job_fields)
    return dataclasses.replace(target, job=job)


def quick(**options):
    # import_torch false: preflight only finds torch (the full import costs seconds per relaunch;
    # test_case4 in test_unattended_e2e.py runs it)
    base = {"timeout": 30.0, "min_free_gib": 0.5, "import_torch": False}
    base.update(options)
    return base


def step(result, name):
    """The report of the step called `name` in a playbook result."""
    return next(s for s in result.steps if s.step == name)


@pytest.fixture
def cleanup():
    """Kill the tmux servers the test started, whatever happens."""
    sockets = []
    yield sockets.append
    for target in sockets:
        try:
            with connect(target) as t:
                t.run(f"tmux -L {target.job.tmux_socket} kill-server", timeout=20)
        except Exception:  # noqa: BLE001 - best effort teardown
            pass


def test_relaunch_local_then_status_health_tail_stop(local_target, cleanup):
    target = standin(local_target)
    cleanup(target)
    lines = []
    result = commands.relaunch(target, **quick(), on_progress=lambda p: lines.append(p))
    assert result.ok, result.summary()
    assert [s.step for s in result.steps] == ["preflight", "stop_session", "kill_gpu_processes", "wait_gpu_free",
                                              "purge_cache", "deploy", "launch", "wait_first_step"]
    assert all(s.seconds >= 0 for s in result.steps)
    log = step(result, "launch").data["log"]
    assert log.endswith("train-0001.log")
    assert (Path(target.job.workdir) / "current" / "trainer" / "train" / "loop.py").exists()

    checked = check_lib.check(target)
    st = checked.status.to_json()
    assert st["session"]["running"] is True and st["session"]["name"] == target.job.session
    assert st["training"]["step"] >= 1 and st["training"]["tokens_per_s"] == 50000.0
    assert st["verdict"] == "OK", st["reasons"]

    shown = []
    tail_log(target, lines=3, grep=r"^step \d+", emit=shown.append)
    assert 1 <= len(shown) <= 3 and all(line.startswith("step ") for line in shown)

    stopped = commands.stop(target)
    assert stopped.ok, stopped.summary()
    assert "1 on SIGTERM" in stopped.steps[0].message or "SIGTERM" in stopped.steps[0].message
    after = check_lib.check(target)
    assert after.status.session.running is not True
    assert after.verdict.level == "OK" and after.verdict.reasons[0].startswith("stopped by dflash-ops stop at ")
    metrics = Path(log[:-4] + ".metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["event"] == "done"  # SIGTERM reached the trainer, which said so


def test_relaunch_twice_in_a_row_is_safe_and_numbers_logs(local_target, cleanup):
    target = standin(local_target)
    cleanup(target)
    first = commands.relaunch(target, **quick())
    second = commands.relaunch(target, **quick())
    assert first.ok and second.ok, second.summary()
    assert step(first, "launch").data["log"].endswith("train-0001.log")
    assert step(second, "launch").data["log"].endswith("train-0002.log")
    assert "ended" in step(second, "stop_session").message  # the first run's trainer was stopped
    assert check_lib.check(target).status.session.running is True


def test_dry_run_touches_nothing(local_target, cleanup):
    target = standin(local_target)
    cleanup(target)
    result = commands.relaunch(target, **quick(), dry_run=True)
    assert result.ok and all(s.status == "dry-run" for s in result.steps)
    assert not Path(target.job.workdir).exists()
    assert subprocess.run(["tmux", "-L", target.job.tmux_socket, "has-session"],
                          capture_output=True).returncode != 0
    lines = [c for s in result.steps for c in s.commands]
    # the launch is the launcher's one JSON word, which names the session it would start
    assert any(launch.LAUNCHER in c and json.dumps(target.job.session) in c for c in lines), lines
    assert any("rm -rf" in c for c in lines)


def _write_gpus(path: Path, apps=()):
    state = {"free_when_pid_dead": True,
             "gpus": [{"index": i, "name": "NVIDIA H200", "memory_total_mib": 143771, "ghost_memory_mib": 0,
                       "utilization_pct": 90} for i in range(4)],
             "compute_apps": list(apps)}
    path.write_text(json.dumps(state))


def test_relaunch_in_container_kills_only_the_jobs_gpu_processes(pct_target, gpu_state_path, cleanup, tmp_path):
    target = standin(pct_target, gpus=((0,), (1,)))
    cleanup(target)
    # An unrelated GPU process in the same container, on a GPU that is not the job's.
    pid_file = tmp_path / "bystander.pid"
    with connect(target) as t:
        t.check(f"setsid -f bash -c 'echo $$ > {pid_file}; exec sleep 300' </dev/null >/dev/null 2>&1", timeout=20)
        for _ in range(50):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.1)
        bystander = int(pid_file.read_text())
        _write_gpus(gpu_state_path, [{"pid": bystander, "gpu_index": 3, "used_memory_mib": 5000,
                                      "process_name": "sleep"}])
        try:
            first = commands.relaunch(target, **quick())
            assert first.ok, first.summary()
            state = json.loads(gpu_state_path.read_text())
            job_pids = [a["pid"] for a in state["compute_apps"] if a["gpu_index"] in (0, 1)]
            assert len(job_pids) == 2  # the trainer shows up on both job GPUs

            second = commands.relaunch(target, **quick())
            assert second.ok, second.summary()
            assert "ended" in step(second, "stop_session").message
            assert t.run(f"kill -0 {bystander}", timeout=20).ok, "an unrelated process was killed"
            st = check_lib.check(target).status.to_json()
            assert st["verdict"] in ("OK", "WARNING"), st["reasons"]
            gpu3 = [g for g in st["gpus"] if g["index"] == 3][0]
            assert [p["pid"] for p in gpu3["processes"]] == [bystander]
            live_job_pids = {p["pid"] for g in st["gpus"] if g["index"] in (0, 1) for p in g["processes"]}
            assert live_job_pids and not (live_job_pids & set(job_pids)), "the first launch's trainer survived"
        finally:
            t.run(f"kill {bystander}", timeout=20)
            gpu_state_path.unlink(missing_ok=True)


def test_unrelated_process_on_a_job_gpu_is_named_and_spared(local_target, gpu_state_path, cleanup, monkeypatch):
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(gpu_state_path))
    monkeypatch.setenv("PATH", str(Path(STANDIN).parent) + os.pathsep + os.environ["PATH"])
    target = standin(local_target, gpus=((0,), (1,)))
    cleanup(target)
    squatter = subprocess.Popen(["sleep", "300"])
    _write_gpus(gpu_state_path, [{"pid": squatter.pid, "gpu_index": 1, "used_memory_mib": 7000,
                                  "process_name": "sleep"}])
    try:
        result = commands.relaunch(target, **quick(gpu_free_timeout=2.0))
        assert not result.ok and result.failed.step == "preflight"
        assert f"pid {squatter.pid} sleep on GPU 1 (7000 MiB" in result.failed.message
        assert "--allow-shared-gpus" in result.failed.message
        assert [s.status for s in result.steps[1:]] == ["not-run"] * 7
        shared = commands.relaunch(target, **quick(gpu_free_timeout=2.0, allow_shared_gpus=True))
        assert shared.ok, shared.summary()
        assert f"pid {squatter.pid} sleep on GPU 1" in step(shared, "kill_gpu_processes").message
        assert "left alone" in step(shared, "kill_gpu_processes").message
        assert squatter.poll() is None
    finally:
        squatter.kill()
        gpu_state_path.unlink(missing_ok=True)


@pytest.mark.parametrize("mode, signature", [("crash", "traceback"), ("fx", "fx")])
def test_a_failing_launch_reports_the_log_and_the_signature(local_target, cleanup, mode, signature):
    target = standin(local_target, mode=mode)
    cleanup(target)
    result = commands.relaunch(target, **quick())
    assert not result.ok and result.failed.step == "wait_first_step" if mode == "fx" else True
    # crash mode passes its first step, so the relaunch returns before the trainer dies
    deadline = time.monotonic() + 20
    checked = check_lib.check(target)
    while checked.verdict.level == "OK" and mode == "crash" and time.monotonic() < deadline:
        time.sleep(0.2)
        checked = check_lib.check(target)
    assert checked.verdict.level == "CRITICAL"
    reasons = " ".join(checked.verdict.reasons).lower()
    assert signature in reasons or ("fx" in reasons if signature == "fx" else "valueerror" in reasons)
    if mode == "fx":
        assert "signature" in result.failed.message and "Detected that you are using FX" in result.failed.message


def test_health_stalled_and_slow(local_target, cleanup):
    stalled = standin(local_target, mode="stall", health=Health(stall_seconds=1))
    cleanup(stalled)
    assert commands.relaunch(stalled, **quick()).ok
    time.sleep(2.5)
    verdict = check_lib.check(stalled).verdict
    assert verdict.level == "CRITICAL" and any("no new step" in r or "stall" in r for r in verdict.reasons), verdict

    slow = standin(local_target, mode="slow", health=Health(min_tokens_per_s=1000, stall_seconds=60),
                   workdir=str(Path(local_target.job.workdir).with_name("work-slow")))
    cleanup(slow)
    assert commands.relaunch(slow, **quick()).ok
    verdict = check_lib.check(slow).verdict
    assert verdict.level == "WARNING" and any("eager" in r for r in verdict.reasons), verdict


def test_unreachable_target_is_unknown(stopped_pct_target):
    checked = check_lib.check(stopped_pct_target)
    assert checked.verdict.level == "UNKNOWN"
    assert "not running" in checked.verdict.reasons[0]


def test_auto_relaunch_is_limited_and_never_concurrent(local_target, cleanup, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    target = standin(local_target, health=Health(stall_seconds=30, max_relaunches_per_hour=1))
    cleanup(target)
    crashed = check_lib.check(target)  # never launched: no session -> CRITICAL
    assert crashed.verdict.level == "CRITICAL"

    # Two overlapping health runs: one holds the lock while relaunching, the other must back off.
    guard = RelaunchGuard(target.name, 1)
    entered, release = threading.Event(), threading.Event()

    def hold_lock():
        with guard.hold() as allowed:
            assert allowed is True
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    entered.wait(5)
    busy = commands.auto_relaunch(target, crashed)
    release.set()
    holder.join()
    assert not busy.attempted and "another health run" in busy.message

    first = commands.auto_relaunch(target, crashed)
    assert first.attempted and first.result.ok, first.message
    second = commands.auto_relaunch(target, crashed)
    assert not second.attempted and "limit" in second.message
    assert len(RelaunchGuard(target.name, 1).recent()) == 1


def test_fan_out_runs_each_target_and_reports_each(ssh_target, ssh_target_b, cleanup):
    from dflash_ops.transport.fanout import fan_out

    a, b = standin(ssh_target), standin(ssh_target_b)
    cleanup(a)
    cleanup(b)
    started = time.monotonic()
    outcomes = fan_out([a, b], lambda t: commands.relaunch(t, **quick()))
    assert [o.target.name for o in outcomes] == ["box-a", "box-b"]
    assert all(o.error is None and o.value.ok for o in outcomes), [o.error or o.value.summary() for o in outcomes]
    checked = fan_out([a, b], check_lib.check)
    assert [c.value.status.session.running for c in checked] == [True, True]
    assert time.monotonic() - started < 60


def _host_pids_of_job(job) -> dict[int, int]:
    """{host pid: in-container pid} of the stand-in trainer, read from the host's /proc."""
    found = {}
    marker = f"{jobpaths.JOB_MARKER_ENV}={jobpaths.marker_value(job)}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{entry}/cmdline", "rb").read()
            status = open(f"/proc/{entry}/status").read()
        except OSError:
            continue
        # the pane's shell carries the marker too; its argv names the trainer's
        if marker in env and b"standin-trainer" in cmd and not cmd.startswith(b"bash\0"):
            nspid = [line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")][0]
            found[int(entry)] = int(nspid[-1])
    return found


def test_gpus_queried_on_the_proxmox_host_map_pids_into_the_container(pct_target, gpu_state_path, cleanup):
    target = dataclasses.replace(standin(pct_target, gpus=((0,), (1,))), gpu_query_on="host")
    cleanup(target)
    host_bystander = subprocess.Popen(["sleep", "300"])  # a host process on a GPU the job does not use
    _write_gpus(gpu_state_path)
    try:
        first = commands.relaunch(target, **quick())
        assert first.ok, first.summary()
        pids = {}
        for _ in range(50):
            pids = _host_pids_of_job(target.job)
            if pids:
                break
            time.sleep(0.1)
        (host_pid, inside_pid), = pids.items()
        if "/lxc/200" not in open(f"/proc/{host_pid}/cgroup").read():
            pytest.skip("this machine does not let the pct simulator place containers in an lxc/200 cgroup")
        assert host_pid != inside_pid  # the container has its own pid namespace
        # What the real driver does in LXC: it reports HOST pids.
        _write_gpus(gpu_state_path, [{"pid": host_pid, "gpu_index": i, "used_memory_mib": 20000,
                                      "process_name": "python3"} for i in (0, 1)]
                    + [{"pid": host_bystander.pid, "gpu_index": 3, "used_memory_mib": 3000, "process_name": "sleep"}])

        target_status = check_lib.check(target).status
        by_index = {g["index"]: g for g in target_status.to_json()["gpus"]}
        assert [(p["pid"], p["owner"]) for p in by_index[0]["processes"]] == [(inside_pid, None)]
        assert [(p["pid"], p["owner"]) for p in by_index[3]["processes"]] == [(host_bystander.pid, "host")]
        assert f"sleep/{host_bystander.pid}(3000M)[host]" in target_text(target_status)

        # the host's own nvidia-smi and kernel log answer for the GPU faults too
        machine = json.loads(gpu_state_path.read_text())
        machine["gpus"][1]["ecc_uncorrected"] = 2  # the others answer [N/A]
        machine["kernel_log"] = ["[    1.000000] Linux version 6.8",
                                 "[    2.000000] NVRM: Xid (PCI:0000:19:00): 79, pid=1, GPU has fallen off the bus."]
        gpu_state_path.write_text(json.dumps(machine))
        checked = check_lib.check(target)
        faults = checked.report.gpu_faults
        assert (faults.source, faults.kernel_log, faults.error) == ("nvidia-smi", "dmesg", None), faults
        assert [g.ecc_uncorrected for g in faults.gpus] == [None, 2, None, None], faults
        assert [(x.code, x.gpu) for x in faults.xids] == [(79, 1)], faults
        assert "GPU 1: 2 uncorrected ECC error(s) since the driver loaded" in checked.verdict.reasons

        dry = commands.relaunch(target, **quick(), dry_run=True)
        gpu_cmds = [c for s in dry.steps if s.step == "wait_gpu_free" for c in s.commands]
        assert gpu_cmds and all("pct exec" not in c and "nvidia-smi" in c for c in gpu_cmds)

        second = commands.relaunch(target, **quick())
        assert second.ok, second.summary()
        assert not os.path.exists(f"/proc/{host_pid}") or "Z" in open(f"/proc/{host_pid}/stat").read().split()[2]
        assert host_bystander.poll() is None
    finally:
        host_bystander.kill()
        gpu_state_path.unlink(missing_ok=True)


def test_tail_log_follow_prints_new_lines_and_stops_cleanly(ssh_target):
    logs = Path(ssh_target.job.log_dir)
    logs.mkdir(parents=True)
    (logs / "train-0001.log").write_text("old run\n")
    log = logs / "train-0002.log"
    log.write_text("line 1\nline 2\n")
    shown, stop = [], threading.Event()
    follower = threading.Thread(target=tail_log, kwargs=dict(
        target=ssh_target, lines=1, follow=True, grep=r"^line", emit=shown.append, poll_s=0.1,
        should_stop=stop.is_set))
    follower.start()
    try:
        wait_for(lambda: shown, 2.5, "the last line", every=0.05)
        assert shown == ["line 2"]  # -n 1 of the newest log, not train-0001.log
        with log.open("a") as f:
            f.write("noise\nline 3\nline 4 without its newline yet")
        wait_for(lambda: "line 3" in shown, 5, "line 3", every=0.05)
        with log.open("a") as f:
            f.write("\n")
        wait_for(lambda: "line 4 without its newline yet" in shown, 5, "line 4 once whole", every=0.05)
        assert shown == ["line 2", "line 3", "line 4 without its newline yet"]  # whole lines, grep applied
    finally:
        stop.set()
        follower.join(10)
    assert not follower.is_alive()


def test_resuming_a_run_that_is_already_complete_says_so(local_target, cleanup):
    # A complete run whose FINISHED marker is missing (e.g. a trainer that stopped at its last step
    # without leaving one) is resumed; the trainer has nothing to train and exits 0 at once.
    target = standin(local_target)
    target = dataclasses.replace(target, job=dataclasses.replace(target.job, env=(*target.job.env, ("STANDIN_STEPS", "2"))))
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    runs = Path(target.job.workdir) / "runs"
    finished = runs / "0001" / "FINISHED"
    deadline = time.monotonic() + 20
    while not finished.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    finished.unlink()
    again = commands.relaunch(target, **quick())
    assert not again.ok and again.failed.step == "wait_first_step"
    assert "already complete (step 2)" in again.failed.message and "--fresh" in again.failed.message
    assert commands.relaunch(target, **quick(resume=False)).ok
    assert sorted(p.name for p in runs.iterdir()) == ["0001", "0002"]
