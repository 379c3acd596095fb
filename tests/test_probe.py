"""The one-round-trip probe against real tmux sessions, real files and the nvidia-smi simulator:
through a bare `bash -c` runner, through LocalTransport, and through ssh + `pct exec`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops.observe import acceptance, health, probe, status
from dflash_ops.errors import RemoteCommandError
from dflash_ops.job.model import Job
from dflash_ops.transport.base import Result, Transport
from trainer import metrics_format

SIM_DIR = Path(__file__).resolve().parent / "sim"
HOSTILE = "wörk 'q' \"d\" $(touch PWNED) `touch PWNED2` ü\nnext"
UUID0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID1 = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
GPU_STATE = {
    "gpus": [{"index": 0, "uuid": UUID0, "name": "NVIDIA H200", "memory_total_mib": 143771,
              "utilization_pct": 91},
             {"index": 1, "uuid": UUID1, "name": "NVIDIA H200", "memory_total_mib": 143771,
              "ghost_memory_mib": 1500}],
    "compute_apps": [{"pid": 3000001, "gpu_uuid": UUID0, "used_memory_mib": 64000, "process_name": "python3"}],
}


class BashRunner(Transport):
    """The smallest honest runner: `bash -c script` here, counting its calls."""

    def __init__(self, name="bare", env=None):
        super().__init__(name)
        self.calls = 0
        self.env = env

    def run(self, script, timeout=60, step="run", stdin=None):
        self.calls += 1
        start = time.monotonic()
        proc = subprocess.run(["/bin/bash", "-c", script], input=stdin, capture_output=True, timeout=timeout,
                              env=self.env)
        return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode(), time.monotonic() - start)

    def put(self, data, remote_path, mode=0o644, step="put"):
        raise NotImplementedError

    def interactive(self, script):
        raise NotImplementedError

    def command_line(self, script, timeout=60):
        return script


def counting(transport):
    """Wrap a real transport's run to count round trips."""
    real_run = transport.run
    transport.calls = 0

    def run(*args, **kwargs):
        transport.calls += 1
        return real_run(*args, **kwargs)

    transport.run = run
    return transport


@pytest.fixture
def sim_gpus(tmp_path, monkeypatch):
    """nvidia-smi on PATH is the simulator, reading a state file this test controls."""
    state = tmp_path / "gpu-state.json"
    state.write_text(json.dumps(GPU_STATE))
    monkeypatch.setenv("PATH", f"{SIM_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(state))
    return state


def tmux(socket, *args, check=True):
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def tmux_socket():
    """A private tmux server (never the user's), killed after the test."""
    socket = f"dflash-probe-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield socket
    tmux(socket, "kill-server", check=False)


def start_trainer_like_session(socket, session, marker, tmp_path):
    """pane pid = a bash whose child is python, as the launcher makes it."""
    launcher = tmp_path / "launch.sh"
    launcher.write_text(f'#!/bin/bash\n"{sys.executable}" -c "import time; time.sleep(300)" "$1"\necho exited\n')
    tmux(socket, "new-session", "-d", "-s", session, f"bash {launcher} {marker}")
    pane_pid = int(tmux(socket, "display-message", "-p", "-t", f"={session}:", "#{pane_pid}").stdout)
    # wait until the python child is there (tmux returns before the pane's command has forked)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(marker in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
               for p in _children(pane_pid)):
            break
        time.sleep(0.05)
    return pane_pid


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def write_run(log_dir: Path, number: int, log_lines: int, steps: int, start_time: float) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"train-{number:04d}.log"
    log.write_text("".join(f"log line {i} é\n" for i in range(1, log_lines + 1)))
    text = metrics_format.encode("start", time=start_time, total_steps=1000, config={}, devices=["cpu"],
                                 compile_lock="first_step", pid=1)
    for step in range(1, steps + 1):
        text += metrics_format.encode("step", time=start_time + step, step=step, total_steps=1000, loss=2.0,
                                      tokens_per_s=1000.0 + step, eta_s=1000.0 - step, lr=1e-4, grad_norm=1.0)
    Path(metrics_format.metrics_path_for_log(str(log))).write_text(text)
    return log


def job_in(workdir: Path, socket: str, session: str, python: str = sys.executable) -> Job:
    return Job(workdir=str(workdir), python=python, config="tiny-cpu", session=session, tmux_socket=socket)


# --------------------------------------------------------------------------- bare runner


def test_probe_gathers_everything_in_one_call(tmp_path, tmux_socket, sim_gpus):
    workdir = tmp_path / HOSTILE
    session = "dflash 'q' \"d\" $(x) é"
    marker = f"marker-{uuid.uuid4().hex}"
    pane_pid = start_trainer_like_session(tmux_socket, session, marker, tmp_path)
    logs = workdir / "logs"
    older = write_run(logs, 11, 5, 2, time.time() - 100)
    newest = write_run(logs, 12, 1000, 600, time.time() - 700)
    os.utime(older, None)  # a newer mtime on a lower number must not win: numbers order runs
    (logs / "train-99.log").write_text("only two digits: not a run log\n")
    (logs / "train-0999.log.bak").write_text("not a run log\n")

    runner = BashRunner()
    report = probe.run_probe(runner, job_in(workdir, tmux_socket, session), log_lines=50, metrics_lines=100)

    assert runner.calls == 1
    assert report.target == "bare" and report.seconds is not None
    assert abs(report.time - time.time()) < 30 and report.hostname == os.uname().nodename
    # session and its process tree
    assert report.session.exists and report.session.running and report.session.error is None
    assert report.session.pane_pid == pane_pid
    pids = {p.pid: p for p in report.processes}
    (python,) = [p for p in report.processes if marker in p.cmdline and p.name.startswith("python")]
    chain, pid = [], python.pid
    while pid in pids:  # walk up to the pane
        chain.append(pid)
        pid = pids[pid].ppid
    assert chain[-1] == pane_pid
    # newest log by number, exact tail, and the metrics next to it
    assert report.log.path == str(newest)
    assert report.log.lines == tuple(f"log line {i} é" for i in range(951, 1001))
    assert report.log.first_line == "log line 1 é"
    assert report.metrics.path == str(logs / "train-0012.metrics.jsonl")
    assert report.records[0]["event"] == "start"  # kept although far before the tail
    assert [r["step"] for r in report.records[1:]] == list(range(501, 601))
    # GPUs from the simulator (pynvml finds no driver here, so the probe falls back to nvidia-smi)
    assert report.gpu.ok and report.gpu.source == "nvidia-smi"
    g0, g1 = report.gpu.gpus
    assert (g0.memory_used_mib, g0.utilization_pct, [p.pid for p in g0.processes]) == (64000, 91, [3000001])
    assert (g1.memory_used_mib, g1.utilization_pct, g1.ghost_memory_mib) == (1500, None, 1500)
    assert report.errors == ()
    assert not list(tmp_path.rglob("PWNED*")) and not Path("PWNED").exists()


def test_probe_log_numbers_beyond_four_digits(tmp_path, tmux_socket, sim_gpus):
    logs = tmp_path / "logs"
    write_run(logs, 9999, 3, 1, time.time())
    write_run(logs, 10000, 3, 1, time.time())
    report = probe.run_probe(BashRunner(), job_in(tmp_path, tmux_socket, "s"))
    assert report.log.path.endswith("train-10000.log")
    assert report.log.first_line is None  # the whole file fits in the tail


def test_probe_when_nothing_runs_and_no_log_exists(tmp_path, tmux_socket, sim_gpus):
    report = probe.run_probe(BashRunner(), job_in(tmp_path / "never-deployed", tmux_socket, "dflash"))
    assert not report.session.exists and not report.session.running and report.session.error is None
    assert report.processes == () and report.log is None and report.metrics is None and report.records == ()
    assert report.log_dir == str(tmp_path / "never-deployed" / "logs")


def test_a_broken_section_is_reported_and_the_rest_still_answers(tmp_path, tmux_socket, sim_gpus):
    (tmp_path / "logs" / "train-0001.log").mkdir(parents=True)  # a directory where a log should be
    start_trainer_like_session(tmux_socket, "dflash", "m", tmp_path)
    report = probe.run_probe(BashRunner(), job_in(tmp_path, tmux_socket, "dflash"))
    (error,) = report.errors
    assert error.startswith("files: IsADirectoryError")
    assert report.log is None and report.session.running and report.gpu.ok


def test_probe_session_name_is_matched_exactly(tmp_path, tmux_socket, sim_gpus):
    start_trainer_like_session(tmux_socket, "dflash-other", "m", tmp_path)  # a prefix of it must not match
    report = probe.run_probe(BashRunner(), job_in(tmp_path, tmux_socket, "dflash"))
    assert not report.session.exists


def test_probe_reports_a_dead_pane_and_its_exit_status(tmp_path, tmux_socket, sim_gpus):
    tmux(tmux_socket, "new-session", "-d", "-s", "job", "sleep 0.3; exit 3", ";",
         "set-option", "-t", "=job:", "remain-on-exit", "on")
    deadline = time.monotonic() + 10
    while tmux(tmux_socket, "display-message", "-p", "-t", "=job:", "#{pane_dead}").stdout.strip() != "1":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    report = probe.run_probe(BashRunner(), job_in(tmp_path, tmux_socket, "job"))
    assert report.session.exists and not report.session.running
    # tmux 3.3 sometimes marks a pane dead (pty EOF) without ever recording its status: then
    # the status is honestly unknown; when it is known it must be the command's.
    assert report.session.exit_status in (3, None)


def test_probe_without_driver_still_reports_the_job(tmp_path, tmux_socket, sim_gpus):
    sim_gpus.write_text(json.dumps({"driver_error": True}))
    start_trainer_like_session(tmux_socket, "dflash", "m", tmp_path)
    report = probe.run_probe(BashRunner(), job_in(tmp_path, tmux_socket, "dflash"))
    assert report.gpu.error.startswith("no NVIDIA driver") and report.gpu.gpus == ()
    assert "couldn't communicate with the NVIDIA driver" in report.gpu.error
    assert report.session.running


def test_probe_falls_back_to_python3_when_the_venv_is_missing(tmp_path, tmux_socket, sim_gpus):
    job = job_in(tmp_path, tmux_socket, "dflash", python=str(tmp_path / "no venv 'yet'" / "bin" / "python"))
    report = probe.run_probe(BashRunner(), job)
    assert report.raw["python"].startswith("3.")


def test_probe_without_any_python_says_so(tmp_path, tmux_socket):
    job = job_in(tmp_path, tmux_socket, "dflash", python="/nonexistent/python")
    only_bash = tmp_path / "only-bash"  # every transport starts bash from PATH: it is there, python3 is not
    only_bash.mkdir()
    (only_bash / "bash").symlink_to(shutil.which("bash"))
    runner = BashRunner(env={"PATH": str(only_bash)})
    with pytest.raises(RemoteCommandError) as info:
        probe.run_probe(runner, job)
    assert info.value.result.exit_code == 127
    assert "neither /nonexistent/python nor python3 is installed" in str(info.value)


def test_probe_script_passes_hostile_strings_unchanged(tmp_path):
    """Whatever the inventory holds, the python runs with exactly the probe and its JSON argument."""
    fake_dir = tmp_path / "v env 'q' $(touch PWNED) `x`"
    fake_dir.mkdir()
    fake_python = fake_dir / "python"
    argv_file = tmp_path / "argv.json"
    fake_python.write_text(f"#!{sys.executable}\nimport json, sys\n"
                           f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake_python.chmod(0o755)
    job = Job(workdir=HOSTILE, python=str(fake_python), config="x", session="a'b $(c)", tmux_socket='s"q`d`',
              legacy_session="o'ld $(e)")
    result = BashRunner().run(probe.probe_script_for(job, log_lines=7))
    assert result.ok, result.stderr
    flag, args = json.loads(argv_file.read_text())
    assert flag == "-"
    assert json.loads(args) == {"log_dir": HOSTILE + "/logs", "session": "a'b $(c)", "socket": 's"q`d`',
                                "log_lines": 7, "metrics_lines": probe.DEFAULT_METRICS_LINES,
                                "gpu_source": "auto",
                                "state_file": HOSTILE + "/job-state.json", "marker": f"DFLASH_OPS_JOB=s\"q`d`/a'b $(c)/{job.job_id}",
                                "legacy_session": "o'ld $(e)", "legacy_marker": "DFLASH_OPS_JOB=s\"q`d`/o'ld $(e)",
                                "eval_context_steps": acceptance.ACC_WINDOW}
    assert not list(tmp_path.rglob("PWNED*"))


def test_probe_finds_the_newest_eval_far_behind_the_tail_and_says_when_its_search_hit_the_cap(
        tmp_path, tmux_socket, sim_gpus):
    logs = tmp_path / "logs"
    t = time.time() - 3600
    metrics = Path(metrics_format.metrics_path_for_log(str(write_run(logs, 1, 3, 0, t))))
    def step(n, acc):
        return metrics_format.encode("step", time=t + n, step=n, total_steps=10**6, loss=2.0, acc=acc,
                                                    tokens_per_s=1000.0, eta_s=1.0, lr=1e-4, grad_norm=1.0)
    with metrics.open("a") as f:
        f.write("".join(step(n, [0.9, 0.5]) for n in range(1, 21)))
        f.write(metrics_format.encode("eval", time=t + 20, step=20, tau=1.9, acceptance=[0.8, 0.4], lossless=True,
                                      prompts=4, new_tokens=64, seconds=1.0))
        f.write("".join(step(n, [0.2, 0.1]) for n in range(21, 10_021)))  # ~1.7 MiB after the eval
    job = job_in(tmp_path, tmux_socket, "s")

    report = probe.run_probe(BashRunner(), job, metrics_lines=100)
    evals = [r for r in report.records if r["event"] == "eval"]
    assert [(r["step"], r["tau"]) for r in evals] == [(20, 1.9)]
    # the accuracy records just before it come along (for the expected tau), oldest first, in order
    around = [r["step"] for r in report.records if r["event"] == "step" and r["step"] <= 20]
    assert around == list(range(11, 21))
    assert [r["step"] for r in report.records if r["event"] == "step"][-1] == 10_020
    scan = report.raw["metrics"]["eval_scan"]
    assert scan["found"] and not scan["cap_hit"] and 0 < scan["bytes_read"] < scan["cap_bytes"] == 16 * 1024 * 1024

    # more than the cap after the eval: not found, and the answer says the search stopped at the cap
    line = step(10_021, [0.2, 0.1])
    with metrics.open("a") as f:
        f.write(line * (17 * 1024 * 1024 // len(line)))
    report = probe.run_probe(BashRunner(), job, metrics_lines=100)
    assert not [r for r in report.records if r["event"] == "eval"]
    scan = report.raw["metrics"]["eval_scan"]
    assert scan["cap_hit"] and not scan["found"] and scan["bytes_read"] == scan["cap_bytes"]
    st = status.build_status("bare", report, job, health.evaluate(report, job))
    assert st.eval is None and st.eval_search["cap_hit"]
    assert len(report.metrics.lines) == 100 and report.records[0]["event"] == "start"


def test_the_eval_search_stops_at_the_probes_deadline_and_says_so(tmp_path):
    from dflash_ops.remote import probe_script
    path = tmp_path / "m.metrics.jsonl"
    path.write_text(metrics_format.encode("eval", step=1, tau=2.0, acceptance=[], lossless=True, prompts=1,
                                          new_tokens=1, seconds=1.0) + "x" * 100 + "\n")
    size = path.stat().st_size
    lines, scan = probe_script.newest_eval(str(path), size, 10, 1 << 20, time.monotonic() - 1)
    assert lines == [] and scan["out_of_time"] and scan["bytes_read"] == 0 and not scan["found"]
    lines, scan = probe_script.newest_eval(str(path), size, 10, 1 << 20, time.monotonic() + 60)
    assert [metrics_format.parse_line(line)["step"] for line in lines] == [1] and scan["found"]
    # an eval appended after the tail was read is the tail's business, not the search's
    with path.open("a") as f:
        f.write(metrics_format.encode("eval", step=2, tau=3.0, acceptance=[], lossless=True, prompts=1,
                                      new_tokens=1, seconds=1.0))
    lines, scan = probe_script.newest_eval(str(path), size, 10, 1 << 20, time.monotonic() + 60)
    assert [metrics_format.parse_line(line)["step"] for line in lines] == [1]


# --------------------------------------------------------------------------- reading the answer


def test_parse_probe_output_rejects_non_json_naming_the_target():
    with pytest.raises(probe.ProbeError, match=r"^\[gpu-box\] probe: .*bash: python3: command not found"):
        probe.parse_probe_output("bash: python3: command not found\n", target="gpu-box")
    with pytest.raises(probe.ProbeError, match="no output"):
        probe.parse_probe_output("", target="gpu-box")
    with pytest.raises(probe.ProbeError, match="not the probe's JSON"):
        probe.parse_probe_output('{"some": "other json"}', target="gpu-box")


def test_parse_probe_output_skips_a_login_banner():
    answer = {"probe_version": 1, "time": 100.0, "hostname": "ct200", "errors": [],
              "gpu": {"source": "nvml", "error": "no NVIDIA driver (x)"},
              "session": {"name": "dflash", "socket": "dflash", "exists": False, "running": False},
              "processes": [], "log_dir": "/w/logs", "log": None, "metrics": None}
    report = probe.parse_probe_output("Welcome to ct200!\n" + json.dumps(answer) + "\n", target="ct200")
    assert report.hostname == "ct200" and report.gpu.error.startswith("no NVIDIA driver") and not report.session.running


# --------------------------------------------------------------------------- real transports


def test_probe_through_local_transport(tmp_path, tmux_socket, sim_gpus):
    local = pytest.importorskip("dflash_ops.transport.local")
    start_trainer_like_session(tmux_socket, "dflash", "m", tmp_path)
    write_run(tmp_path / "logs", 1, 10, 3, time.time())
    transport = counting(local.LocalTransport("local"))
    report = probe.run_probe(transport, job_in(tmp_path, tmux_socket, "dflash"))
    assert transport.calls == 1
    assert report.target == "local" and report.session.running and report.records[-1]["step"] == 3
    assert report.gpu.gpus[0].memory_used_mib == 64000


def test_probe_through_ssh_and_pct_is_one_round_trip(pct_target, gpu_state_path):
    """ONE ssh session + ONE pct exec: the probe answers from inside the simulated container."""
    factory = pytest.importorskip("dflash_ops.transport.factory")
    job = pct_target.job
    workdir = Path(job.workdir)
    write_run(workdir / "logs", 7, 20, 4, time.time())
    gpu_state_path.write_text(json.dumps(GPU_STATE))
    transport = factory.make_transport(pct_target)
    try:
        started = transport.run(f"tmux -L {job.tmux_socket} new-session -d -s {job.session} 'sleep 300'",
                                timeout=30)
        assert started.ok, started.stderr
        counting(transport)
        report = probe.run_probe(transport, job)
        assert transport.calls == 1
        assert report.hostname == "ct200"  # answered from inside the container
        assert report.session.running and report.processes[0].pid == report.session.pane_pid
        assert any("sleep 300" in p.cmdline for p in report.processes)
        assert report.log.path == str(workdir / "logs" / "train-0007.log")
        assert [r["step"] for r in report.records if r["event"] == "step"] == [1, 2, 3, 4]
        assert report.gpu.source == "nvidia-smi" and report.gpu.gpus[0].processes[0].pid == 3000001
    finally:
        transport.run(f"tmux -L {job.tmux_socket} kill-server", timeout=30)
        transport.close()
        gpu_state_path.unlink(missing_ok=True)
