"""The torchrun launcher: this process is one rank, holding one drafter replica and its own target.

    torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        -m trainer --config ... --launcher torchrun

Rank r is replica r of the threaded mode: the batch plan is built for WORLD_SIZE replicas, and the
drafter is wrapped in DDP, whose mean of two ranks' gradients equals the threaded mode's exactly,
so replicas stay identical without weight broadcasts. Every step the ranks exchange one small
vector (loss, tokens, accuracy, "stop requested"): all log the same summary and stop after the same
step. Rank 0 checkpoints; who writes metrics: Rank.speaks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.train import checkpoint as ckpt
from trainer.config import ConfigError, TrainConfig
from trainer.data.dataset import Dataset
from trainer.launchers import THREADS, TORCHRUN
from trainer.train.shutdown import StopRequest
from trainer.train.workers import Failure, Replica, StepSummary, TrainingWorkers

# A signal this soon after the first is the same request: torchrun forwards the operator's SIGTERM
# to every rank that already got it from the operator, and Ctrl-C reaches torchrun and ranks alike.
SAME_REQUEST_S = 3.0


@dataclasses.dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def speaks(self, cfg: TrainConfig) -> bool:
        """Writes metrics and readable lines: rank 0, and another host's local rank 0 given its own
        --metrics-file (dflash-ops does), so each host's status sees the run."""
        return self.is_lead or (self.local_rank == 0 and cfg.run.metrics_file is not None)

    def trackers(self, cfg: TrainConfig) -> list[str]:
        """Rank 0's trackers only: a run is one tracker run."""
        return list(cfg.run.report_to) if self.is_lead else []


def rank_from_env(env=os.environ) -> Rank | None:
    """The rank torchrun gave this process, or None when it was not started by torchrun."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return Rank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def check_launcher(cfg: TrainConfig, env=os.environ) -> None:
    """run.launcher must match how the process was started (raises ConfigError, exit 2)."""
    rank = rank_from_env(env)
    if cfg.run.launcher == TORCHRUN and rank is None:
        raise ConfigError(
            f"{cfg.source}: `run.launcher` is torchrun, but this process was not started by torchrun "
            f"(no RANK/WORLD_SIZE in its environment). Fix: torchrun --nproc-per-node N -m trainer ..., "
            f"or --launcher threads."
        )
    if cfg.run.launcher == THREADS and rank is not None and rank.world_size > 1:
        raise ConfigError(
            f"{cfg.source}: started by torchrun with WORLD_SIZE {rank.world_size}, but `run.launcher` is "
            f"threads, so every rank would train the whole job. Fix: add --launcher torchrun."
        )


class RankStopRequest:
    """Like train.StopRequest, but signals within SAME_REQUEST_S of the first are one request."""

    def __init__(self, base):
        self.base, self.first_at = base, None

    def install(self):
        self.base.install()
        for sig in list(self.base._previous):
            signal.signal(sig, self._handle)
        return self.base

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.first_at is not None and now - self.first_at < SAME_REQUEST_S:
            return
        self.first_at = self.first_at if self.first_at is not None else now
        self.base._handle(signum, frame)


class DrafterDDP(DistributedDataParallel):
    """DDP over the drafter; the loss head (frozen target lm_head, no parameters) passes through."""

    def loss(self, *args, **kwargs):
        return self.module.loss(*args, **kwargs)


def _gather(vector: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(vector) for _ in range(world_size)]
    dist.all_gather(parts, vector)
    return [p.cpu() for p in parts]


def _gather_int(value: int, rank: Rank, device: str) -> list[int]:
    """Every rank's `value`, in rank order."""
    parts = _gather(torch.tensor([value], dtype=torch.int64, device=device), rank.world_size)
    return [int(p.item()) for p in parts]


def dataset_digest(dataset: Dataset) -> int:
    h = hashlib.sha256()
    for t in (dataset.input_ids, dataset.loss_mask, dataset.attention_mask):
        h.update(t.contiguous().cpu().numpy().data)  # the buffer itself, no copy of a large dataset
    return int.from_bytes(h.digest()[:7], "little")


def check_same_data(dataset: Dataset, rank: Rank, device: str) -> None:
    """Every rank built the data itself (a file, or seeded generation): they must agree exactly."""
    values = _gather_int(dataset_digest(dataset), rank, device)
    if len(set(values)) != 1:
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise RuntimeError(
            f"ranks {differ} built different training data than rank 0 "
            f"(same config and seed must give the same data on every rank)"
        )


def global_summary(local: StepSummary, stop: bool, rank: Rank, device: str) -> tuple[StepSummary, bool]:
    """Combine every rank's step the way the threaded mode combines its replicas' reports."""
    vector = torch.tensor(
        [local.loss, float(local.tokens), float(stop), *local.acc], dtype=torch.float64, device=device
    )
    parts = _gather(vector, rank.world_size)
    acc = torch.stack([p[3:].to(torch.float32) for p in parts]).mean(0)
    summary = dataclasses.replace(
        local,
        loss=sum(float(p[0]) for p in parts) / len(parts),
        acc=[float(a) for a in acc],
        tokens=sum(int(p[1]) for p in parts),
    )
    return summary, any(bool(p[2]) for p in parts)


def check_same_start(start: int, rank: Rank, device: str) -> None:
    """Ranks that resume from different steps would wait on each other forever: refuse instead."""
    starts = _gather_int(start, rank, device)
    if len(set(starts)) != 1:
        where = ", ".join(
            f"rank {r}: {'step ' + str(s) if s else 'fresh start'}" for r, s in enumerate(starts)
        )
        raise ckpt.CheckpointError(
            f"the ranks would start from different steps ({where}): every host must see the same "
            f"checkpoints. Fix: put run.output_dir on storage all hosts share, or start every rank fresh."
        )


def check_world_size(state: ckpt.Checkpoint, world_size: int) -> None:
    """A resume keeps the world size: the global batch fixes the data order and the schedule."""
    run_devices = state.config.get("run", {}).get("drafter_devices", [])
    saved = int(state.data_position.get("replicas", len(run_devices) or 1))  # ranks, or drafter threads
    if saved != world_size:
        raise ckpt.CheckpointError(
            f"--resume {state.path}: trained with {saved} replicas, this run has world size {world_size}; "
            f"the global batch sets the data order and schedule, so step {state.step} would mean other data. "
            f"Fix: relaunch with {saved} ranks in total (--nproc-per-node x --nnodes), "
            f"or start a new --output-dir."
        )


class TorchrunWorld:
    """This process is one rank: one replica (DDP), rank 0 writes, the ranks agree every step."""

    def __init__(self, cfg: TrainConfig, rank: Rank):
        self.rank = rank
        self.device = f"cuda:{rank.local_rank}" if cfg.run.drafter_devices[0].startswith("cuda") else "cpu"
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        devices = dataclasses.replace(cfg.run, target_devices=[self.device], drafter_devices=[self.device])
        self.cfg = dataclasses.replace(cfg, run=devices)
        self.size, self.is_lead = rank.world_size, rank.is_lead
        # never: a rank that started a step its peers did not would wait in the all-reduce forever
        self.pipelines = False
        self.speaks = rank.speaks(self.cfg)  # every host's launcher reads its own run directory
        self.devices = [self.device]
        self.trackers = rank.trackers(self.cfg)
        self._agreed_stop = False

    @classmethod
    def from_env(cls, cfg: TrainConfig) -> TorchrunWorld:
        rank = rank_from_env()
        assert rank is not None  # check_launcher refused a torchrun config without torchrun
        return cls(cfg, rank)

    def thread(self, name: str) -> str:
        return f"rank{self.rank.rank}/{name}"

    def join(self) -> None:
        dist.init_process_group("nccl" if self.device.startswith("cuda") else "gloo")

    def agree_data(self, dataset: Dataset) -> None:
        check_same_data(dataset, self.rank, self.device)

    def agree_resume(self, state: ckpt.Checkpoint) -> None:
        check_world_size(state, self.rank.world_size)

    def ready(self, replicas: list[Replica], start: int) -> None:
        check_same_start(start, self.rank, self.device)
        (replica,) = replicas
        replica.index = self.rank.rank  # rank r is replica r: it reads replica r's batches
        cuda = self.device.startswith("cuda")
        replica.model = DrafterDDP(replica.model, device_ids=[torch.device(self.device)] if cuda else None)

    def describe(self) -> list[str]:
        return [
            f"launcher: torchrun, {self.rank.world_size} ranks ({dist.get_backend()}), one replica each; "
            f"this log is rank 0's, on {self.device}"
        ]

    def stop_request(self) -> StopRequest:
        return StopRequest()  # no watchdog, no giving up on a step: the other ranks wait in it too

    def listen(self, stop: StopRequest) -> None:
        RankStopRequest(stop).install()

    def step(
        self, workers: TrainingWorkers, index: int, stop: StopRequest, ahead: bool = False
    ) -> StepSummary:
        summary, self._agreed_stop = global_summary(
            workers.run_step(index), stop.requested, self.rank, self.device
        )
        return summary

    def stopping(self, stop: StopRequest) -> bool:
        return self._agreed_stop  # never this rank's own flag alone: all ranks stop after the same step

    def model(self, replicas: list[Replica]) -> torch.nn.Module:
        ddp = replicas[0].model
        assert isinstance(ddp, DrafterDDP)
        return ddp.module

    def failed(self, failure: Failure) -> str | None:
        if getattr(failure.original, "exit_code", None) == 2:  # bad input: the CLI's one line says it
            if not self.speaks:
                sys.stderr = open(os.devnull, "w")
            return None
        # one line naming the rank on stderr (the log), whichever rank it is
        rank = self.rank
        what = "aborted" if failure.interrupted else "failed"
        print(
            f"dflash-train: rank {rank.rank} of {rank.world_size} {what}{failure.where}: "
            f"{type(failure.original).__name__}: {failure.original}",
            file=sys.stderr,
            flush=True,
        )
        if not failure.interrupted and not failure.bad_input and not rank.is_lead:
            print(failure.traceback_text.rstrip(), file=sys.stderr, flush=True)
        return f"rank {rank.rank}: "

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
