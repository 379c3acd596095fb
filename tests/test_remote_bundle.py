"""The remote scripts travel as one self-contained program on python's stdin: they run where
nothing of dflash_ops or the trainer is importable, and use the shared facts."""
from __future__ import annotations

import json
import subprocess
import sys

from dflash_ops import remote
from dflash_ops.observe import probe
from dflash_ops.remote import facts
from trainer import metrics_format


def run_isolated(filename: str, args: dict, cwd) -> dict:
    # -I: no PYTHONPATH, no user site, no script dir; -S: no site-packages (an editable install of
    # dflash_ops would be one): only the standard library is importable
    proc = subprocess.run([sys.executable, "-I", "-S", "-", json.dumps(args)], input=remote.bundle(filename),
                          capture_output=True, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_the_probe_runs_alone_and_reads_the_newest_log_and_its_metrics(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for n in (9, 10):
        (logs / f"{facts.LOG_PREFIX}{n:04d}{facts.LOG_SUFFIX}").write_text(f"log {n}\n")
    newest = logs / f"{facts.LOG_PREFIX}0010{facts.LOG_SUFFIX}"
    metrics = metrics_format.metrics_path_for_log(str(newest))
    with open(metrics, "w") as f:
        f.write(metrics_format.encode("step", time=1.0, step=3, total_steps=9, loss=1.0, tokens_per_s=1.0,
                                      eta_s=1.0, lr=1e-4, grad_norm=1.0))
    out = run_isolated("probe_script.py", {"log_dir": str(logs), "session": "none", "socket": "dflash-test-none",
                                           "log_lines": 5, "metrics_lines": 5, "gpu_source": "none"}, tmp_path)
    assert out["log"]["path"] == str(newest) and out["metrics"]["path"] == metrics


def test_jobprocs_runs_alone(tmp_path):
    out = run_isolated("jobprocs.py", {"marker": "DFLASH_OPS_JOB=none/none", "socket": "none",
                                       "session": "none", "gpus": [], "action": "list", "grace_s": 1,
                                       "include_session": False}, tmp_path)
    assert out["job"] == [] and out["killed"] == []


def test_facts_newest_log_name_goes_by_number_not_by_text():
    names = ["train-0009.log", "train-10000.log", "train-0010.metrics.jsonl", "other.log", "train-x.log"]
    assert facts.newest_log_name(names) == "train-10000.log" and facts.newest_log_name([]) is None


def test_the_probe_reports_a_missing_pynvml_and_still_answers(tmp_path):
    # pynvml is an optional extra of the job's environment: without it the probe says so and goes on
    args = {"log_dir": str(tmp_path), "session": "none", "socket": "dflash-test-none", "gpu_source": "nvml",
            "log_lines": probe.DEFAULT_LOG_LINES, "metrics_lines": probe.DEFAULT_METRICS_LINES}
    no_pynvml = b"import sys; sys.modules['pynvml'] = None\n"  # `import pynvml` raises ImportError
    proc = subprocess.run([sys.executable, "-I", "-S", "-", json.dumps(args)],
                          input=no_pynvml + remote.bundle("probe_script.py"), capture_output=True, cwd=tmp_path,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert out["gpu"] == {"source": "nvml", "error": "pynvml is not installed"}
    assert out["log_dir_exists"] and out["session"]["exists"] is False
