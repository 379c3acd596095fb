"""`launcher: torchrun` jobs: inventory checks, the launch line, and reading which rank died."""
from __future__ import annotations

import subprocess
import textwrap

import pytest

from dflash_ops.inventory import target as inventory_target
from dflash_ops.act import launch
from dflash_ops.job import torchrun
from dflash_ops.observe import logs
from dflash_ops.remote import launch_job
from dflash_ops.errors import InputError
from dflash_ops.inventory.load import load_inventory_text
from dflash_ops.job.model import Job

FILE = "inv.yaml"
BASE = "transport: ssh, host: h, job: {workdir: /w, python: /w/py, config: tiny-cpu"

# What torchrun 2.13 printed when rank 1 of a 2-rank trainer was killed with SIGKILL (captured).
KILLED_RANK_LOG = """\
step    30/40000  loss 6.0075  acc@1 0.000  acc_avg 0.007  18,914 tok/s  lr 4.50e-05  gnorm 3.449  eta 29m31s
W1201 04:39:00.291000 28197 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 28304 closing signal SIGTERM
E1201 04:39:00.363000 28197 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 28305) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
trainer FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_04:39:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 28304)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 28304
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_04:39:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 28305)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 28305
=======================================================
"""


@pytest.fixture(autouse=True)
def bundled(monkeypatch):
    monkeypatch.setattr(inventory_target, "bundled_config_names", lambda: ("gpu-paper", "tiny-cpu"))


def job_of(extra: str) -> Job:
    text = f"targets:\n  box: {{{BASE}, {extra}}}}}\n"
    return load_inventory_text(text, FILE).targets["box"].job


def error_of(extra: str) -> str:
    with pytest.raises(InputError) as caught:
        job_of(extra)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(FILE), message
    return message


@pytest.mark.parametrize("extra,field,fix", [
    ("launcher: torchrun", "job.nproc_per_node", "e.g. nproc_per_node: 2"),
    ("nproc_per_node: 2", "job.nproc_per_node", "only applies with 'launcher: torchrun'"),
    ("launcher: mpi", "job.launcher", "must be one of threads, torchrun"),
    ("launcher: torchrun, nproc_per_node: 0", "job.nproc_per_node", "between 1 and 64"),
    ("launcher: torchrun, nproc_per_node: 2, nnodes: 2", "job.rdzv_endpoint", "10.0.0.7:29400"),
    ("launcher: torchrun, nproc_per_node: 2, rdzv_endpoint: 'a:1'", "job.rdzv_endpoint", "only used when nnodes > 1"),
    ("launcher: torchrun, nproc_per_node: 1, nnodes: 2, rdzv_endpoint: 'h; rm -rf /:1'", "job.rdzv_endpoint",
     "expected HOST:PORT"),
    ("launcher: torchrun, nproc_per_node: 1, nnodes: 2, rdzv_endpoint: 'h:99999'", "job.rdzv_endpoint",
     "expected HOST:PORT"),
    ("launcher: torchrun, nproc_per_node: 2, drafter_gpus: [0]", "job.drafter_gpus", "one GPU per rank"),
    ("launcher: torchrun, nproc_per_node: 1, target_gpus: [0]", "job.target_gpus", "set target_gpus: []"),
])
def test_bad_torchrun_fields_get_one_line_naming_the_field(extra, field, fix):
    message = error_of(extra)
    assert f"field '{field}'" in message and fix in message, message


def test_one_host_gets_a_private_rendezvous_and_one_gpu_per_rank():
    job = job_of("launcher: torchrun, nproc_per_node: 2, drafter_gpus: [3, 5], "
                 "train_args: [--max-steps, '9', --drafter-devices, cuda]")
    assert launch.trainer_argv(job, "/w/runs/0001") == [
        "/w/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainer",
        "--config", "tiny-cpu", "--output-dir", "/w/runs/0001", "--launcher", "torchrun",
        "--target-devices", "cuda", "--drafter-devices", "cuda", "--max-steps", "9", "--drafter-devices", "cuda"]
    assert launch.trainer_env(job)["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert job.gpus == (3, 5)  # what stop/gpu-clean wait for


def test_several_hosts_meet_at_the_rendezvous_endpoint():
    job = job_of("launcher: torchrun, nproc_per_node: 1, nnodes: 3, rdzv_endpoint: '10.0.0.7:29400'")
    argv = launch.trainer_argv(job)
    assert argv[1:11] == ["-m", "torch.distributed.run", "--nnodes", "3", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "10.0.0.7:29400", "--nproc-per-node", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in launch.trainer_env(job)  # CPU ranks


def test_a_torchrun_target_clears_the_target_gpus_its_defaults_give():
    text = textwrap.dedent("""\
        defaults: {job: {target_gpus: [0], drafter_gpus: [1, 2, 3]}}
        targets:
          box: {transport: ssh, host: h, job: {workdir: /w, python: /w/py, config: tiny-cpu,
                launcher: torchrun, nproc_per_node: 2, drafter_gpus: [0, 1], target_gpus: []}}
        """)
    job = load_inventory_text(text, FILE).targets["box"].job
    assert (job.target_gpus, job.drafter_gpus, job.nproc_per_node) == ((), (0, 1), 2)


@pytest.mark.parametrize("b_fields,field,fix", [
    ("nnodes: 3", "job.nnodes", "is 3 but target 'a' meets at the same rdzv_endpoint 10.0.0.7:29400 with nnodes 2"),
    ("nnodes: 2", None, None),
])
def test_hosts_of_one_rendezvous_agree_on_nnodes(b_fields, field, fix):
    job = "workdir: /w, python: /w/py, config: tiny-cpu, launcher: torchrun, nproc_per_node: 1"
    text = textwrap.dedent(f"""\
        targets:
          a: {{transport: ssh, host: a, job: {{{job}, nnodes: 2, rdzv_endpoint: '10.0.0.7:29400'}}}}
          b: {{transport: ssh, host: b, job: {{{job}, {b_fields}, rdzv_endpoint: '10.0.0.7:29400'}}}}
        groups: {{both: [a, b]}}
        """)
    if field is None:
        assert [t.job.nnodes for t in load_inventory_text(text, FILE).resolve("both")] == [2, 2]
        return
    with pytest.raises(InputError) as caught:
        load_inventory_text(text, FILE)
    assert f"target 'b': field '{field}'" in str(caught.value) and fix in str(caught.value), caught.value


def test_more_hosts_than_nnodes_at_one_rendezvous_is_refused():
    job = ("workdir: /w, python: /w/py, config: tiny-cpu, launcher: torchrun, nproc_per_node: 1, nnodes: 2, "
           "rdzv_endpoint: '10.0.0.7:29400'")
    text = "targets:\n" + "".join(f"  {n}: {{transport: ssh, host: {n}, job: {{{job}}}}}\n" for n in "abc")
    with pytest.raises(InputError) as caught:
        load_inventory_text(text, FILE)
    message = str(caught.value)
    assert "target 'c': field 'job.rdzv_endpoint': 3 targets (a, b, c) meet at 10.0.0.7:29400 but nnodes is 2" \
        in message and message.startswith(f"{FILE}:4:"), message


def test_threads_stays_the_default_launch():
    job = job_of("target_gpus: [0], drafter_gpus: [1]")
    assert job.launcher == "threads"
    assert launch.trainer_argv(job)[:3] == ["/w/py", "-m", "trainer"]


def test_the_pane_script_runs_a_hostile_python_path_as_data(tmp_path):
    hostile = str(tmp_path / "py $(touch pwned); 'x'")
    job = Job(workdir=str(tmp_path), python=hostile, config="tiny-cpu", launcher="torchrun", nproc_per_node=2)
    args = launch.launch_args(job)
    words = args["argv"]
    assert words[0] == hostile and words[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    log, out = tmp_path / "train-0001.log", tmp_path / "runs" / "0001"
    pane = launch_job.pane_command(args, str(log), "0001", False, str(out), {"state": "finished"})
    ran = subprocess.run(pane, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 127, ran  # the path is one word naming no program
    first = log.read_text().splitlines()[0]
    assert f"launching run 0001: {hostile} -m torch.distributed.run --standalone" in first
    assert f"--output-dir {out} " in first  # the run dir stands in for launch.RUN_DIR
    assert not (tmp_path / "pwned").exists()


def test_a_killed_rank_is_named_with_its_signal_and_torchruns_traceback_is_not_news():
    failures = logs.find_failures(KILLED_RANK_LOG)
    assert [f.name for f in failures] == ["rank_died"]
    assert failures[0].describe() == (
        "rank died: rank 1 (local rank 1, pid 28305) exited with code -9 (SIGKILL), the first failure "
        "torchrun saw; it ended the other ranks")


def test_a_rank_that_raised_adds_its_own_reason():
    text = ("dflash-train: rank 1 of 2 failed: RuntimeError: boom\n" + KILLED_RANK_LOG.replace("exitcode  : -9 (pid: 28305)  (SIGKILL)", "exitcode  : 1 (pid: 28305)"))
    died = logs.find_failures(text)[0]
    assert died.name == "rank_died"
    assert died.line == ("rank 1 (local rank 1, pid 28305) exited with code 1, the first failure torchrun saw; "
                         "it ended the other ranks; it reported: RuntimeError: boom")


def test_while_torchrun_shuts_down_the_agent_line_names_the_local_rank():
    text = KILLED_RANK_LOG.split("Traceback")[0]
    died = logs.find_failures(text)[0]
    assert died.line == "local rank 1 (pid 28305) exited with code -9; torchrun is ending the other ranks"


def test_an_operators_stop_passed_on_by_torchrun_is_not_a_failure():
    text = textwrap.dedent("""\
        SIGTERM: stopped after step 31
        done     step 31 (interrupted)
        Traceback (most recent call last):
          File "/usr/lib/python3/site-packages/torch/distributed/elastic/agent/server/api.py", line 753, in run
        torch.distributed.elastic.multiprocessing.api.SignalException: Process 2901 got signal: 15
        """)
    assert logs.find_failures(text) == []
    assert torchrun.rank_failure(text.splitlines())[0] is None
