"""The torchrun launcher: 2 gloo ranks over loopback follow the threaded mode's 2 replicas exactly.

Tolerance: none is needed on CPU. Rank r reads replica r's batch and anchors, runs the same
fp32 kernels with the same thread count, and DDP's mean a/2 + b/2 equals the threaded (a + b)/2
exactly for two replicas (halving is exact in binary floating point). The test still compares
with 1e-6 relative slack, so a change of reduction order in a future torch (a legitimate
last-bit difference) reads as what it is and not as a broken data split, which shows up at 1e-2.
"""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.train import checkpoint as ckpt
from trainer import metrics_format
from trainer.config import ConfigError, load_config
from trainer.train.distributed import RankStopRequest, check_launcher, check_world_size
from trainer.train.loop import StopRequest, train

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--set", "data.seq_len=32", "--set", "data.synthetic.num_samples=16", "--set", "train.epochs=30", "--set", "train.batch_size=2",
         "--set", "train.num_anchors=6", "--set", "run.torch_threads=1", "--set", "run.log_every=1000"]
OVERRIDES = {"data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 30, "train.batch_size": 2,
             "train.num_anchors": 6, "run.torch_threads": 1, "run.log_every": 1000}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, out_dir: Path, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m trainer ...` on loopback, under a hard time limit."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = ["timeout", "-k", "10", str(timeout), sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "trainer", "--config", "tiny-cpu", "--launcher", "torchrun", "--output-dir", str(out_dir),
           *SMALL, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout + 30)


def steps(metrics_path: Path) -> list[dict]:
    records = metrics_format.parse_lines(metrics_path.read_text(encoding="utf-8"))
    return [r for r in records if r["event"] == "step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Threaded 2 replicas for 4 steps; torchrun 2 ranks for 4 steps; torchrun resumed from step 2."""
    root = tmp_path_factory.mktemp("ddp")
    threaded = load_config("tiny-cpu", dict(OVERRIDES, output_dir=str(root / "threads"), max_steps=4))
    train(threaded, out=io.StringIO())
    first = torchrun(2, root / "ranks", "--max-steps", "4", "--set", "run.checkpoint_every=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    mid = root / "ranks" / "checkpoints" / "step-0000002"
    second = torchrun(2, root / "resumed", "--max-steps", "4", "--resume", str(mid))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return root, first, second


@pytest.mark.slow
@pytest.mark.parametrize("run,expected_steps", [("ranks", [1, 2, 3, 4]), ("resumed", [3, 4])])
def test_two_gloo_ranks_follow_the_threaded_trajectory(runs, run, expected_steps):
    root, _, _ = runs
    reference = {r["step"]: r for r in steps(root / "threads" / "metrics.jsonl")}
    ranked = steps(root / run / "metrics.jsonl")
    assert [r["step"] for r in ranked] == expected_steps
    for ours in ranked:
        theirs = reference[ours["step"]]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6), (ours, theirs)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)
        assert ours["acc"] == pytest.approx(theirs["acc"], rel=1e-6, abs=1e-7)
        assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
    a = load_file(str(root / "threads" / "checkpoints" / "step-0000004" / ckpt.WEIGHTS))
    b = load_file(str(root / run / "checkpoints" / "step-0000004" / ckpt.WEIGHTS))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_two_hosts_meet_at_the_rendezvous_and_each_host_logs_the_same_run(runs, tmp_path):
    from dflash_ops.job.model import Job
    from dflash_ops.job.torchrun import launcher_argv

    root, _, _ = runs
    job = Job(workdir=str(tmp_path), python=sys.executable, config="tiny-cpu", launcher="torchrun",
              nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    hosts = [subprocess.Popen(
        ["timeout", "-k", "10", "150", *launcher_argv(job), "-m", "trainer", "--config", "tiny-cpu", "--launcher",
         "torchrun", "--output-dir", str(tmp_path / "shared"), "--metrics-file", str(tmp_path / f"host{h}.jsonl"),
         "--max-steps", "4", *SMALL], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for h in (0, 1)]
    outputs = [host.communicate(timeout=180)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    reference = [r["loss"] for r in steps(root / "threads" / "metrics.jsonl")]
    for h in (0, 1):
        assert [r["loss"] for r in steps(tmp_path / f"host{h}.jsonl")] == pytest.approx(reference, rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "shared" / "checkpoints").iterdir()) == ["step-0000004"]


@pytest.mark.slow
def test_only_rank_0_writes_and_the_checkpoint_records_the_world_size(runs):
    root, first, _ = runs
    metrics = root / "ranks" / "metrics.jsonl"
    starts = [r for r in metrics_format.parse_lines(metrics.read_text()) if r["event"] == "start"]
    assert len(starts) == 1  # one per launch, not one per rank
    assert sum(line.startswith("step 4/4") for line in first.stdout.splitlines()) == 1  # rank 1 prints nothing...
    assert first.stdout.count("dflash-train: finished at step 4/4") == 1  # ...not even its result
    assert "2 ranks (gloo)" in first.stdout
    state = ckpt.load_checkpoint(str(root / "ranks" / "checkpoints" / "step-0000004"))
    assert state.data_position["replicas"] == 2
    assert sorted(p.name for p in (root / "ranks" / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]


@pytest.mark.slow
def test_resume_on_another_world_size_is_refused_in_one_line(runs):
    root, _, _ = runs
    before = sorted((root / "ranks" / "checkpoints").iterdir())
    proc = torchrun(1, root / "ranks", "--max-steps", "6", "--resume")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dflash-train: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "trained with 2 replicas, this run has world size 1" in lines[0]
    assert "Fix: relaunch with 2 ranks" in lines[0]
    assert sorted((root / "ranks" / "checkpoints").iterdir()) == before  # nothing destroyed


def test_launcher_must_match_how_the_process_was_started():
    cfg = load_config("tiny-cpu", {"launcher": "torchrun"})
    with pytest.raises(ConfigError, match="not started by torchrun"):
        check_launcher(cfg, env={})
    threads = load_config("tiny-cpu", {})
    with pytest.raises(ConfigError, match="add --launcher torchrun"):
        check_launcher(threads, env={"RANK": "1", "WORLD_SIZE": "2"})
    check_launcher(threads, env={"RANK": "0", "WORLD_SIZE": "1"})  # a single rank may run threaded
    with pytest.raises(ConfigError, match="run.launcher"):
        load_config("tiny-cpu", {"launcher": "mpi"})


def test_a_threaded_checkpoint_resumes_on_the_same_number_of_ranks(tmp_path):
    state = ckpt.Checkpoint(path="x", step=3, weights={}, optimizer={}, scheduler={},
                            data_position={"step": 3}, rng={}, config={"run": {"drafter_devices": ["cpu", "cpu"]}},
                            drafter_config={})
    check_world_size(state, 2)
    with pytest.raises(ckpt.CheckpointError, match="trained with 2 replicas, this run has world size 4"):
        check_world_size(state, 4)


def test_a_forwarded_signal_is_the_same_stop_request_not_an_abort():
    stop = StopRequest()
    ranked = RankStopRequest(stop)
    ranked.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the operator's
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwarding it a moment later
        assert stop.requested and stop.signal_name == "SIGTERM"
        ranked.first_at -= 60  # much later: a deliberate second signal aborts, as in threaded mode
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.uninstall()


PROBE = """
import sys
import torch.distributed as dist


def say(*words):  # one write per line: both ranks share the pipe
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    sys.stdout.flush()


from trainer.train.checkpoint import CheckpointError
from trainer.train.distributed import check_same_data, check_same_start, rank_from_env
dist.init_process_group("gloo")
rank = rank_from_env()
try:
    check_same_start(31 if rank.rank == 0 else 0, rank, "cpu")  # rank 1's host has no checkpoint
    say("rank", rank.rank, "started")
except CheckpointError as exc:
    say("rank", rank.rank, "refused:", exc)
import torch
from trainer.data.dataset import Dataset
ids = torch.arange(12).view(3, 4) + rank.rank  # as if rank 1 had generated other data
try:
    check_same_data(Dataset(ids, ids > 0, ids >= 0, "probe"), rank, "cpu")
except RuntimeError as exc:
    say("rank", rank.rank, "data:", exc)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_that_would_start_from_different_steps_or_data_refuse_instead_of_hanging(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(["timeout", "-k", "10", "120", sys.executable, "-m", "torch.distributed.run",
                           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = sorted(line for line in proc.stdout.splitlines() if "refused:" in line)
    assert len(refused) == 2, proc.stdout
    assert "(rank 0: step 31, rank 1: fresh start)" in refused[0] and "all hosts share" in refused[0]
    data = [line for line in proc.stdout.splitlines() if " data: " in line]
    assert len(data) == 2 and all("ranks [1] built different training data than rank 0" in line for line in data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_cuda_rank_trains_with_compiled_flex_over_nccl(tmp_path):
    proc = torchrun(1, tmp_path / "out", "--max-steps", "5", "--attention", "flex", "--target-devices", "cuda",
                    "--drafter-devices", "cuda", "--set", "run.log_every=1", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 ranks (nccl)" in proc.stdout
    records = metrics_format.parse_lines((tmp_path / "out" / "metrics.jsonl").read_text())
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3, 4, 5]
    assert any(r["event"] == "compile" for r in records), "flex_attention was not compiled"


# --------------------------------------------------------------------------- the exchanges, in process


def ranks_exchange(monkeypatch, vectors_of_other_ranks):
    """all_gather as if the other ranks had sent these vectors (this rank is rank 0)."""
    from trainer.train import distributed

    def gather(vector, world_size):
        assert world_size == 1 + len(vectors_of_other_ranks)
        return [vector.cpu()] + [torch.tensor(v, dtype=vector.dtype) for v in vectors_of_other_ranks]

    monkeypatch.setattr(distributed, "_gather", gather)


def test_the_job_summary_combines_the_ranks_as_the_threaded_mode_combines_its_replicas(monkeypatch):
    from trainer.train.distributed import Rank, global_summary
    from trainer.train.workers import StepSummary

    # rank 0's own step, then ranks 1 and 2: (loss, tokens, stop requested, acc...)
    ranks_exchange(monkeypatch, [[3.0, 50.0, 0.0, 0.5, 0.25], [2.0, 70.0, 1.0, 0.25, 0.0]])
    local = StepSummary(step=5, loss=1.0, acc=[0.75, 0.5], tokens=60, grad_norm=0.3, lr=1e-4)
    summary, stop = global_summary(local, False, Rank(0, 3, 0), "cpu")
    assert summary == StepSummary(step=5, loss=2.0, acc=[0.5, 0.25], tokens=180, grad_norm=0.3, lr=1e-4)
    assert stop, "one rank asked to stop: every rank stops after this step"
    ranks_exchange(monkeypatch, [[3.0, 50.0, 0.0, 0.5, 0.25]])
    assert global_summary(local, False, Rank(0, 2, 0), "cpu")[1] is False


def test_ranks_that_differ_are_named(monkeypatch):
    from trainer.data.dataset import Dataset
    from trainer.train.distributed import Rank, check_same_data, check_same_start, dataset_digest

    ranks_exchange(monkeypatch, [[31], [0]])
    with pytest.raises(ckpt.CheckpointError, match=r"\(rank 0: step 31, rank 1: step 31, rank 2: fresh start\)"):
        check_same_start(31, Rank(0, 3, 0), "cpu")
    ids = torch.arange(12).view(3, 4)
    data = Dataset(ids, ids > 2, ids >= 0, "probe")
    ranks_exchange(monkeypatch, [[dataset_digest(data)], [dataset_digest(data) ^ 1]])
    with pytest.raises(RuntimeError, match=r"^ranks \[2\] built different training data than rank 0"):
        check_same_data(data, Rank(0, 3, 0), "cpu")
    ranks_exchange(monkeypatch, [[dataset_digest(data)]])
    check_same_data(data, Rank(0, 2, 0), "cpu")


def test_the_data_digest_sees_every_tensor_of_the_dataset():
    from trainer.data.dataset import Dataset
    from trainer.train.distributed import dataset_digest

    ids = torch.arange(24).view(4, 6)

    def digest(input_ids=ids, loss_mask=ids > 3, attention_mask=ids >= 0):
        return dataset_digest(Dataset(input_ids, loss_mask, attention_mask, "d"))

    same = digest()
    assert digest(ids.clone()) == same and 0 <= same < 2**56, "an int64 all ranks can exchange"
    assert digest(ids.flip(0)) != same
    assert digest(loss_mask=ids > 4) != same and digest(attention_mask=ids >= 1) != same
    assert digest(input_ids=ids.t().contiguous().t()) == same, "the values, not the memory layout"


def test_who_speaks_and_reports_and_how_a_rank_is_read_from_torchrun():
    from trainer.train.distributed import Rank, rank_from_env

    assert rank_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Rank(3, 4, 1)
    assert rank_from_env({"RANK": "2", "WORLD_SIZE": "4"}) == Rank(2, 4, 2)
    assert rank_from_env({"RANK": "0"}) is None and rank_from_env({}) is None
    own_file = load_config("tiny-cpu", {"run.metrics_file": "host2.jsonl", "run.report_to": ["mlflow"]})
    shared = load_config("tiny-cpu", {"run.report_to": ["mlflow"]})
    assert Rank(0, 4, 0).speaks(shared) and Rank(0, 4, 0).trackers(shared) == ["mlflow"]
    assert not Rank(2, 4, 0).speaks(shared), "another host's lead writes only into a file of its own"
    assert Rank(2, 4, 0).speaks(own_file) and not Rank(3, 4, 1).speaks(own_file)


def test_a_rank_says_its_failure_in_one_line_naming_itself(monkeypatch, capsys):
    from trainer.train.distributed import Rank, TorchrunWorld
    from trainer.train.workers import Failure, WorkerFailure

    world = TorchrunWorld(load_config("tiny-cpu", {"launcher": "torchrun"}), Rank(1, 2, 1))
    assert world.device == "cpu" and world.cfg.run.drafter_devices == ["cpu"] and world.thread("d") == "rank1/d"
    failure = Failure.of(WorkerFailure("drafter0", ValueError("bad shard"), "Traceback ...\n  here\n"))
    assert world.failed(failure) == "rank 1: "
    err = capsys.readouterr().err.splitlines()
    assert err == ["dflash-train: rank 1 of 2 failed in thread drafter0: ValueError: bad shard", "Traceback ...", "  here"]
    lead = TorchrunWorld(load_config("tiny-cpu", {"launcher": "torchrun"}), Rank(0, 2, 0))
    assert lead.failed(failure) == "rank 0: "
    assert capsys.readouterr().err.splitlines() == ["dflash-train: rank 0 of 2 failed in thread drafter0: ValueError: bad shard"]
