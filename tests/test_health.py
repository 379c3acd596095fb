"""Health verdicts for each situation, Nagios output syntax, and one crashed job end to end
(real tmux, real python traceback, real probe)."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from dflash_ops.observe import health, probe
from dflash_ops.observe.gpu import Gpu, GpuSnapshot
from dflash_ops.job.model import Health, Job
from dflash_ops.transport.local import LocalTransport
from trainer import metrics_format

NOW = 100_000.0
JOB = Job(workdir="/srv/dflash", python="/srv/dflash/venv/bin/python", config="tiny-cpu", session="dflash",
          target_gpus=(0,), drafter_gpus=(1, 2),
          health=Health(min_tokens_per_s=5000, stall_seconds=900, min_drafter_util_pct=50))


def steps(last_step_age=12.0, count=10, tokens=40000.0, loss=2.5, start_age=None, total=1000):
    """Metrics as the trainer writes them: a start record, then a step every 10 s, the last one
    `last_step_age` seconds before NOW."""
    first = NOW - last_step_age - 10 * (count - 1)
    start = NOW - start_age if start_age is not None else first - 60
    text = metrics_format.encode("start", time=start, total_steps=total, config={}, devices=[], compile_lock="x", pid=1)
    for i in range(count):
        text += metrics_format.encode("step", time=first + 10 * i, step=i + 1, total_steps=total, loss=loss,
                                      tokens_per_s=tokens, eta_s=(total - i - 1) * 10.0, lr=1e-4, grad_norm=1.0)
    return metrics_format.parse_lines(text)


def gpus(util=(97, 80, 75), error=None):
    if error:
        return GpuSnapshot((), "nvidia-smi", error)
    return GpuSnapshot(tuple(Gpu(i, f"GPU-{i}", "NVIDIA H200", 70000, 143771, u) for i, u in enumerate(util)),
                       "nvidia-smi")


def make_report(records=(), log_text="step 1\n", running=True, exists=None, snapshot=None, exit_status=None,
                log_mtime=NOW - 5, with_log=True):
    log = probe.FileTail("/srv/dflash/logs/train-0003.log", len(log_text), log_mtime,
                         tuple(log_text.splitlines())) if with_log else None
    session = probe.SessionState("dflash", "dflash", running if exists is None else exists, running,
                                 4242 if running else None, exit_status)
    return probe.ProbeReport(target="gpu-box", time=NOW, hostname="ct200", gpu=snapshot or gpus(), session=session,
                             processes=(), log_dir="/srv/dflash/logs", log=log, metrics=None, records=tuple(records))


# --------------------------------------------------------------------------- verdicts


def test_healthy_job_is_ok():
    verdict = health.evaluate(make_report(steps()), JOB)
    assert verdict.level == "OK" and verdict.exit_code == 0
    assert verdict.reasons == ("step 10/1000, loss 2.5000, 40.0 Ktok/s, last step 12 s ago",)


def test_session_gone_is_critical():
    verdict = health.evaluate(make_report(steps(), running=False), JOB)
    assert verdict.level == "CRITICAL" and verdict.exit_code == 2
    assert verdict.reasons == ("tmux session 'dflash' is gone (socket dflash)",)


def test_dead_pane_reports_exit_status():
    verdict = health.evaluate(make_report(steps(), running=False, exists=True, exit_status=1), JOB)
    assert verdict.reasons == ("trainer in tmux session 'dflash' exited with status 1",)


def test_crashed_job_names_the_exception():
    log = ("step 10 loss 2.5\nTraceback (most recent call last):\n  File \"train.py\", line 80, in main\n"
           "    batch = next(loader)\nValueError: bad shard /data/shard-7.jsonl\n")
    verdict = health.evaluate(make_report(steps(), log_text=log, running=False), JOB)
    assert verdict.level == "CRITICAL"
    assert "Python exception: ValueError: bad shard /data/shard-7.jsonl (in train-0003.log)" in verdict.reasons


@pytest.mark.parametrize("line, title", [
    ("RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function.",
     "FX-tracing race"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "CUDA out of memory"),
])
def test_known_failures_in_the_log_are_critical_and_named(line, title):
    verdict = health.evaluate(make_report(steps(), log_text=f"step 9\n{line}\n"), JOB)
    assert verdict.level == "CRITICAL"
    assert verdict.reasons == (f"{title}: {line} (in train-0003.log)",)


def test_error_event_in_metrics_is_critical():
    records = steps() + metrics_format.parse_lines(
        metrics_format.encode("error", time=NOW - 1, kind="cuda_oom", message="CUDA out of memory on cuda:1"))
    verdict = health.evaluate(make_report(records), JOB)
    assert verdict.level == "CRITICAL" and verdict.reasons[0].startswith("CUDA out of memory: CUDA out of memory on cuda:1")


def test_stalled_job_is_critical():
    verdict = health.evaluate(make_report(steps(last_step_age=1000)), JOB)
    assert verdict.level == "CRITICAL"
    assert verdict.reasons == ("no new step for 1000 s (last step 10); stall threshold 900 s",)
    assert verdict.perfdata["age_s"].value == pytest.approx(1000)


def test_startup_grace_before_the_first_step():
    starting = steps(count=0, start_age=300)
    verdict = health.evaluate(make_report(starting), JOB)
    assert verdict.level == "OK" and verdict.reasons == ("starting: no step yet (300 s since start)",)
    stuck = steps(count=0, start_age=1000)
    verdict = health.evaluate(make_report(stuck), JOB)
    assert verdict.level == "CRITICAL"
    assert verdict.reasons == ("no first step 1000 s after start; stall threshold 900 s",)


def test_without_metrics_the_log_mtime_is_the_sign_of_life():
    assert health.evaluate(make_report((), log_mtime=NOW - 60), JOB).level == "OK"
    verdict = health.evaluate(make_report((), log_mtime=NOW - 2000), JOB)
    assert verdict.level == "CRITICAL" and "no first step 2000 s after start" in verdict.reasons[0]


def test_running_without_any_log_is_a_warning():
    verdict = health.evaluate(make_report((), with_log=False), JOB)
    assert verdict.level == "WARNING" and verdict.reasons == ("no train-NNNN.log in /srv/dflash/logs",)


def test_nan_loss_is_critical():
    verdict = health.evaluate(make_report(steps(loss=float("nan"))), JOB)
    assert verdict.level == "CRITICAL" and verdict.reasons == ("loss is nan at step 10",)
    assert verdict.perfdata["loss"].value is None


def test_slow_job_warns_with_the_eager_fallback_signature():
    verdict = health.evaluate(make_report(steps(tokens=1200.0)), JOB)
    assert verdict.level == "WARNING" and verdict.exit_code == 1
    (reason,) = verdict.reasons
    assert reason.startswith("1200 tokens/s is below the 5000 minimum") and "eager-fallback" in reason


def test_idle_drafter_gpus_warn_while_training():
    verdict = health.evaluate(make_report(steps(), snapshot=gpus(util=(97, 3, 80))), JOB)
    assert verdict.level == "WARNING"
    assert verdict.reasons == ("drafter GPU 1 at 3%: under the 50% utilization floor",)
    assert verdict.perfdata["drafter_util_pct"].value == 3
    # the target GPU (0) idling is not the drafters' business
    assert health.evaluate(make_report(steps(), snapshot=gpus(util=(0, 90, 90))), JOB).level == "OK"


def test_no_utilization_warning_when_not_training():
    idle = gpus(util=(0, 0, 0))
    stalled = health.evaluate(make_report(steps(last_step_age=1000), snapshot=idle), JOB)
    assert stalled.level == "CRITICAL" and len(stalled.reasons) == 1
    starting = health.evaluate(make_report(steps(count=0, start_age=100), snapshot=idle), JOB)
    assert starting.level == "OK"


def test_no_driver_with_a_utilization_floor_warns():
    verdict = health.evaluate(make_report(steps(), snapshot=gpus(error="no NVIDIA driver (NVIDIA-SMI has failed)")), JOB)
    assert verdict.level == "WARNING"
    assert verdict.reasons == ("GPUs 0,1,2 are assigned but the GPU query failed: no NVIDIA driver (NVIDIA-SMI has failed)",)


def test_cpu_job_without_gpus_is_fine_without_a_driver():
    cpu_job = Job(workdir="/w", python="/usr/bin/python3", config="tiny-cpu")
    verdict = health.evaluate(make_report(steps(), snapshot=gpus(error="no NVIDIA driver")), cpu_job)
    assert verdict.level == "OK" and "drafter_util_pct" not in verdict.perfdata


def test_finished_job_is_ok_even_without_its_session():
    records = steps(count=3, total=3) + metrics_format.parse_lines(
        metrics_format.encode("done", time=NOW - 5, step=3, reason="max_steps"))
    verdict = health.evaluate(make_report(records, running=False), JOB)
    assert verdict.level == "OK" and verdict.reasons == ("finished at step 3",)


def test_probe_blind_spots_are_warnings():
    report = dataclasses.replace(make_report(steps()),
                                 errors=("files: PermissionError: [Errno 13] /srv/dflash/logs",))
    verdict = health.evaluate(report, JOB)
    assert verdict.level == "WARNING"
    assert verdict.reasons == ("probe could not read part of the target: files: PermissionError: [Errno 13] "
                               "/srv/dflash/logs",)


def test_now_defaults_to_the_targets_clock():
    report = make_report(steps(last_step_age=12))
    assert health.evaluate(report, JOB).perfdata["age_s"].value == pytest.approx(12)
    assert health.evaluate(report, JOB, now=NOW + 1000).level == "CRITICAL"


def test_several_problems_are_all_listed_critical_first():
    log = "torch.OutOfMemoryError: CUDA out of memory.\n"
    verdict = health.evaluate(make_report(steps(tokens=100.0), log_text=log, running=False), JOB)
    assert verdict.level == "CRITICAL"
    assert verdict.reasons[0] == "tmux session 'dflash' is gone (socket dflash)"
    assert verdict.reasons[1].startswith("CUDA out of memory")


# --------------------------------------------------------------------------- Nagios output

# Nagios plugin guidelines: 'label'=value[UOM];[warn];[crit];[min];[max], ranges [@][start:][end]
_RANGE = r"@?(?:~|-?\d+(?:\.\d+)?)?:?(?:-?\d+(?:\.\d+)?)?"
PERF_ITEM = re.compile(r"(?:'(?:[^']|'')+'|[^'= ]+)=(?:-?\d+(?:\.\d+)?|U)(?:s|ms|us|%|B|KB|MB|GB|TB|c)?"
                       rf"(?:;{_RANGE}(?:;{_RANGE}(?:;-?\d+(?:\.\d+)?(?:;-?\d+(?:\.\d+)?)?)?)?)?")
LINE = re.compile(r"DFLASH (OK|WARNING|CRITICAL|UNKNOWN): [^|\n]+(?: \| (.+))?")


def assert_nagios(line):
    match = LINE.fullmatch(line)
    assert match, line
    for item in (match.group(2) or "").split(" "):
        if item:
            assert PERF_ITEM.fullmatch(item), item


def test_nagios_line_exact():
    verdict = health.evaluate(make_report(steps()), JOB)
    line = health.nagios_line("gpu-box", verdict)
    assert line == ("DFLASH OK: gpu-box: step 10/1000, loss 2.5000, 40.0 Ktok/s, last step 12 s ago | "
                    "step=10;; loss=2.5;; tokens_per_s=40000;5000:; age_s=12;;900 drafter_util_pct=75%;50:;")
    assert_nagios(line)


@pytest.mark.parametrize("report", [
    make_report(steps(loss=float("nan"))),
    make_report((), with_log=False),
    make_report(steps(tokens=1234.56789), running=False, log_text="x | y\nKilled\n"),
    make_report(steps(), snapshot=gpus(error="no NVIDIA driver")),
])
def test_nagios_lines_are_valid_for_every_verdict(report):
    line = health.nagios_line("gpu box|1", health.evaluate(report, JOB))
    assert_nagios(line)
    assert "\n" not in line and line.count("|") == 1


def test_unknown_and_worst_of_several_targets():
    down = health.unknown("[box-b] ssh: connection refused")
    assert down.level == "UNKNOWN" and down.exit_code == 3
    ok = health.evaluate(make_report(steps()), JOB)
    crit = health.evaluate(make_report(steps(), running=False), JOB)
    assert health.worst(["OK", "WARNING"]) == "WARNING"
    assert health.worst(["WARNING", "UNKNOWN"]) == "UNKNOWN"
    assert health.worst(["UNKNOWN", "CRITICAL", "OK"]) == "CRITICAL"
    line, code = health.nagios_line_many([("box-a", ok), ("box-b", down)])
    assert code == 3 and line.startswith("DFLASH UNKNOWN: box-a OK: step 10/1000")
    assert "box-b UNKNOWN: [box-b] ssh: connection refused" in line and "box-a_step=10;;" in line
    assert_nagios(line)
    line, code = health.nagios_line_many([("box-a", crit), ("box-b", down)])
    assert code == 2 and line.startswith("DFLASH CRITICAL: ")


# --------------------------------------------------------------------------- end to end


def test_a_real_crash_is_critical_and_named(tmp_path, monkeypatch):
    """A trainer-like process writes metrics, then raises; tmux closes the session."""
    monkeypatch.setenv("NVIDIA_SMI_SIM_STATE", str(tmp_path / "absent.json"))  # no driver here
    socket = f"dflash-health-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "train-0001.log"
    crash = tmp_path / "crash.py"
    crash.write_text(
        "import sys, time\n"
        "from trainer import metrics_format\n"
        f"with open({metrics_format.metrics_path_for_log(str(log))!r}, 'a') as m:\n"
        "    m.write(metrics_format.encode('start', total_steps=10, config={}, devices=[], compile_lock='x', pid=1))\n"
        "    m.write(metrics_format.encode('step', step=1, total_steps=10, loss=3.0, tokens_per_s=9000.0, eta_s=9.0,"
        " lr=1e-4, grad_norm=1.0))\n"
        "def load_shard(path):\n"
        "    raise ValueError(f'bad shard {path}')\n"
        "load_shard('/data/shard-7.jsonl')\n")
    command = f"cd {os.getcwd()} && {sys.executable} {crash} > {log} 2>&1"
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "dflash", command], check=True, timeout=30)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["tmux", "-L", socket, "has-session", "-t", "=dflash"],
                             capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the crashing job did not end"
            time.sleep(0.1)
        job = Job(workdir=str(tmp_path), python=sys.executable, config="tiny-cpu", tmux_socket=socket,
                  session="dflash", health=Health(stall_seconds=900))
        report = probe.run_probe(LocalTransport("local"), job)
        verdict = health.evaluate(report, job)
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
    assert verdict.level == "CRITICAL"
    assert verdict.reasons[0] == f"tmux session 'dflash' is gone (socket {socket})"
    assert "Python exception: ValueError: bad shard /data/shard-7.jsonl (in train-0001.log)" in verdict.reasons
    assert verdict.perfdata["step"].value == 1
    assert_nagios(health.nagios_line("local", verdict))
