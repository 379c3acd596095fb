"""The torchrun launcher: this process is one rank; it holds one drafter replica and its own target.

    torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        -m trainer --config ... --launcher torchrun

Each rank runs the same per-replica step as the threaded mode (trainer.workers: a target worker
thread feeding one drafter thread under the compile guard), with the drafter wrapped in
DistributedDataParallel (NCCL on CUDA, gloo on CPU) so backward all-reduces the gradients.

Equivalence with the threaded mode: rank r is replica r. The batch plan is built for WORLD_SIZE
replicas, so rank r reads exactly the sequences and anchors replica r reads in a threaded run with
WORLD_SIZE drafter devices. DDP divides each gradient by the world size and sums; for two ranks
a/2 + b/2 equals the threaded mode's (a + b)/2 exactly in binary floating point. Clipping and
AdamW then run on identical gradients in every rank, so replicas stay identical without any
weight broadcast after the start.

Only rank 0 writes checkpoints. Rank 0 writes the metrics file and readable lines; so does local
rank 0 of every other host when given its own --metrics-file (what dflash-ops does), so status
and health work on each host of a multi-host job. Every step the ranks exchange one small vector
(loss, tokens, accuracy, "stop requested"): every rank knows the summary the threaded mode logs,
and all ranks agree on stopping after the same step.

Devices: a rank uses `cuda:LOCAL_RANK` for its target and drafter when the configured drafter
devices are CUDA, else the CPU (set CUDA_VISIBLE_DEVICES to choose the GPUs).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
import sys
import time
from typing import TextIO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint as ckpt
from . import precision
from .compile_lock import CompileGuard
from .config import ConfigError, TrainConfig, check_devices
from .data import BatchPlan, Dataset
from .feature_cache import training_source
from .heldout import split_heldout
from .metrics import MetricsWriter, Throughput
from .shutdown import StopRequest
from .target import load_target
from .training_eval import TrainingEval
from .workers import Failure, Replica, StepSummary

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

    def trackers(self, cfg: TrainConfig) -> list[str]:
        """The experiment trackers this rank reports to: rank 0's only, so a run is one tracker run
        (the other hosts' metrics files are for their own status)."""
        return list(cfg.run.report_to) if self.is_lead else []

    def speaks(self, cfg: TrainConfig) -> bool:
        """Writes metrics and readable lines: rank 0; on other hosts their local rank 0 too, when
        given its own --metrics-file (dflash-ops does), so each host's status sees the run."""
        return self.is_lead or (self.local_rank == 0 and cfg.run.metrics_file is not None)


def rank_from_env(env=os.environ) -> Rank | None:
    """The rank torchrun gave this process, or None when it was not started by torchrun."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return Rank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def check_launcher(cfg: TrainConfig, env=os.environ) -> None:
    """run.launcher must match how the process was started (raises ConfigError, exit 2)."""
    rank = rank_from_env(env)
    if cfg.run.launcher == "torchrun" and rank is None:
        raise ConfigError(
            f"{cfg.source}: `run.launcher` is torchrun, but this process was not started by torchrun "
            f"(no RANK/WORLD_SIZE in its environment). Fix: torchrun --nproc-per-node N -m trainer ..., "
            f"or --launcher threads.")
    if cfg.run.launcher == "threads" and rank is not None and rank.world_size > 1:
        raise ConfigError(
            f"{cfg.source}: started by torchrun with WORLD_SIZE {rank.world_size}, but `run.launcher` is "
            f"threads, so every rank would train the whole job. Fix: add --launcher torchrun.")


def rank_device(cfg: TrainConfig, rank: Rank) -> str:
    return f"cuda:{rank.local_rank}" if cfg.run.drafter_devices[0].startswith("cuda") else "cpu"


class RankStopRequest:
    """Like train.StopRequest, but signals within SAME_REQUEST_S of the first are one request."""

    def __init__(self, base):
        self.base = base
        self.first_at = None

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


# ---- exchanges between ranks -----------------------------------------------------------------

def _gather(vector: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(vector) for _ in range(world_size)]
    dist.all_gather(parts, vector)
    return [p.cpu() for p in parts]


def dataset_digest(dataset: Dataset) -> int:
    h = hashlib.sha256()
    for t in (dataset.input_ids, dataset.loss_mask, dataset.attention_mask):
        h.update(t.contiguous().cpu().numpy())  # the buffer itself, no copy of a large dataset
    return int.from_bytes(h.digest()[:7], "little")


def check_same_data(dataset: Dataset, rank: Rank, device: str) -> None:
    """Every rank built the data itself (a file, or seeded generation): they must agree exactly."""
    digests = _gather(torch.tensor([dataset_digest(dataset)], dtype=torch.int64, device=device),
                      rank.world_size)
    values = [int(d.item()) for d in digests]
    if len(set(values)) != 1:
        differ = [r for r, v in enumerate(values) if v != values[0]]
        raise RuntimeError(f"ranks {differ} built different training data than rank 0 "
                           f"(same config and seed must give the same data on every rank)")


def global_summary(local: StepSummary, stop: bool, rank: Rank, device: str) -> tuple[StepSummary, bool]:
    """Combine every rank's step the way the threaded mode combines its replicas' reports."""
    vector = torch.tensor([local.loss, float(local.tokens), float(stop), *local.acc],
                          dtype=torch.float64, device=device)
    parts = _gather(vector, rank.world_size)
    acc = torch.stack([p[3:].to(torch.float32) for p in parts]).mean(0)
    summary = StepSummary(step=local.step, loss=sum(float(p[0]) for p in parts) / len(parts),
                          acc=[float(a) for a in acc], tokens=sum(int(p[1]) for p in parts),
                          grad_norm=local.grad_norm, lr=local.lr)
    return summary, any(bool(p[2]) for p in parts)


# ---- resume ----------------------------------------------------------------------------------

def check_same_start(start: int, rank: Rank, device: str) -> None:
    """Ranks that resume from different steps would wait on each other forever: refuse instead."""
    starts = [int(s.item()) for s in _gather(torch.tensor([start], dtype=torch.int64, device=device),
                                              rank.world_size)]
    if len(set(starts)) != 1:
        where = ", ".join(f"rank {r}: {'step ' + str(s) if s else 'fresh start'}" for r, s in enumerate(starts))
        raise ckpt.CheckpointError(
            f"the ranks would start from different steps ({where}): every host must see the same "
            f"checkpoints. Fix: put run.output_dir on storage all hosts share, or start every rank fresh.")


def saved_replicas(state: ckpt.Checkpoint) -> int:
    """How many replicas (ranks, or drafter threads) the checkpoint was trained with."""
    if "replicas" in state.data_position:
        return int(state.data_position["replicas"])
    return len(state.config.get("run", {}).get("drafter_devices", [])) or 1


def check_world_size(state: ckpt.Checkpoint, world_size: int) -> None:
    """The optimizer state is replicated under DDP and would load on any world size, but the global
    batch (world size x train.batch_size) fixes the data order and the schedule's length: step s
    of another world size reads other data. So a resume keeps the world size."""
    saved = saved_replicas(state)
    if saved != world_size:
        raise ckpt.CheckpointError(
            f"--resume {state.path}: trained with {saved} replicas, this run has world size {world_size}; "
            f"the global batch sets the data order and schedule, so step {state.step} would mean other data. "
            f"Fix: relaunch with {saved} ranks in total (--nproc-per-node x --nnodes), or start a new --output-dir.")


# ---- the run ---------------------------------------------------------------------------------

def train_rank(cfg: TrainConfig, out: TextIO | None = None, tty: bool | None = None):
    """Run this rank of a torchrun job. Rank 0 returns the RunResult the threaded mode returns."""
    from . import train as threaded  # the building blocks both launchers share

    rank = rank_from_env()
    device = rank_device(cfg, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    devices = dataclasses.replace(cfg.run, target_devices=[device], drafter_devices=[device])
    cfg = dataclasses.replace(cfg, run=devices)
    check_devices(cfg)
    speaks = rank.speaks(cfg)
    if not speaks:
        sys.stdout = open(os.devnull, "w")  # the other ranks speak only when they fail
    out = out if out is not None else sys.stdout
    metrics = MetricsWriter(cfg.metrics_path if speaks else os.devnull,
                            out=out if speaks else open(os.devnull, "w"), tty=tty, log_every=cfg.run.log_every,
                            report_to=rank.trackers(cfg), report_dir=cfg.run.output_dir)
    guard = CompileGuard(cfg.run.compile_lock, on_event=lambda e: metrics.compile(
        f"rank{rank.rank}/{e.get('thread', '?')}", e.get("duration_s") or 0.0, e.get("step", -1),
        e.get("reason", "")))
    stop = StopRequest()
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        guard.install()
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        random.seed(cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        if cfg.data.source == "features":  # no target forward: features come from disk
            heads, dataset = training_source(cfg, threaded.param_dtype(device))
            target, heldout = heads[0], None
        else:
            target = load_target(cfg.target.spec, device, threaded.param_dtype(device),
                                 layer_ids=cfg.target.layer_ids, seed=cfg.train.seed, tiny=cfg.target.tiny or None)
            dataset, heldout = split_heldout(threaded.build_dataset(cfg, target), cfg.data.eval_fraction,
                                             cfg.train.seed)
        check_same_data(dataset, rank, device)
        plan = BatchPlan(len(dataset), cfg.train.batch_size, rank.world_size, cfg.train.seed, dataset.source)
        total = plan.total_steps(cfg.train.epochs, cfg.train.max_steps)
        dcfg = threaded.drafter_config(cfg, target)
        replica = threaded.build_replicas(cfg, dcfg, target, total)[0]
        replica.index = rank.rank
        # rank 0 evaluates tau between steps; the other ranks wait for it at the next step's all-reduce
        evaluator = TrainingEval.create(cfg, target, dcfg, heldout, threaded.param_dtype(device), metrics.say) \
            if rank.is_lead else None
        start, upcast = 0, None
        if cfg.run.resume:
            state = ckpt.load_checkpoint(ckpt.resolve_resume(cfg.run.resume, cfg.run.output_dir))
            check_world_size(state, rank.world_size)
            threaded.restore([replica], state, dcfg)
            start, upcast = state.step, precision.upcast_note(state.weights, state.path)
        check_same_start(start, rank, device)
        replica.model = DrafterDDP(replica.model, device_ids=[torch.device(device)] if device.startswith("cuda") else None)
        summary = threaded.startup_summary(cfg, guard, dataset, plan, total, start, [replica])
        summary.append(f"launcher: torchrun, {rank.world_size} ranks ({dist.get_backend()}), one replica each; "
                       f"this log is rank 0's, on {device}")
        metrics.start(cfg.to_dict(), [device], cfg.run.compile_lock, total, summary)
        if upcast:
            metrics.say(upcast)
        RankStopRequest(stop).install()
        parts = threaded.LoopParts(cfg, [target], [replica], dataset, plan, dcfg, guard, start, total, evaluator)
        return _loop(parts, rank, device, metrics, stop)
    except BaseException as exc:
        failure = Failure.of(exc)
        if getattr(failure.original, "exit_code", None) == 2:  # bad input: the CLI's one line says it
            if not speaks:
                sys.stderr = open(os.devnull, "w")
            raise
        # one line naming the rank on stderr (the log), whichever rank it is
        what = "aborted" if failure.interrupted else "failed"
        print(f"dflash-train: rank {rank.rank} of {rank.world_size} {what}{failure.where}: "
              f"{type(failure.original).__name__}: {failure.original}", file=sys.stderr, flush=True)
        if not failure.interrupted and not rank.is_lead:
            print(failure.traceback_text.rstrip(), file=sys.stderr, flush=True)
        metrics.failed(failure, stop.last_step, label=f"rank {rank.rank}: ")
        raise
    finally:
        stop.uninstall()
        guard.uninstall()
        metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _loop(parts, rank: Rank, device: str, metrics: MetricsWriter, stop: StopRequest):
    from . import train as threaded

    cfg, replica, plan, start, total, evaluator = (parts.cfg, parts.replicas[0], parts.plan, parts.start,
                                                   parts.total, parts.evaluator)
    last, path, step = None, None, start
    throughput = Throughput(start, total)
    with threaded.make_workers(parts) as workers:
        workers.start(start, total)
        for step_index in range(start, total):
            last, stopping = global_summary(workers.run_step(step_index), stop.requested, rank, device)
            step = stop.last_step = last.step
            tokens_per_s, eta_s = throughput.update(step, last.tokens)
            metrics.step(step=step, total_steps=total, loss=last.loss, acc=last.acc, tokens_per_s=tokens_per_s,
                         eta_s=eta_s, lr=last.lr, grad_norm=last.grad_norm, epoch=step / plan.steps_per_epoch,
                         gpu_memory_gib=threaded.peak_gpu_memory_gib([device]))
            if evaluator is not None and evaluator.due(step, total):
                evaluator.run(replica.model.module, step, metrics)
                throughput.last = throughput.clock()
            if rank.is_lead and (step % cfg.run.checkpoint_every == 0 or step == total or stopping):
                path = save(cfg, replica, parts.dcfg, plan, step, rank.world_size)
                metrics.checkpoint(step, path)
            if stopping and step < total:  # a stop during the last step leaves a complete run
                metrics.say(f"{stop.signal_name or 'another rank'}: stopped after step {step}")
                metrics.done(step, "interrupted")
                return threaded.RunResult(step, total, "interrupted", last, path, [replica])
    if rank.speaks(cfg):  # every host's launcher reads its own run directory
        ckpt.mark_finished(cfg.run.output_dir, step)
    metrics.done(step, "max_steps")
    return threaded.RunResult(step, total, "max_steps", last, path, [replica])


def save(cfg: TrainConfig, replica: Replica, dcfg, plan: BatchPlan, step: int, world_size: int) -> str:
    return ckpt.save_checkpoint(
        cfg.run.output_dir, step, weights=replica.model.module.state_dict(),
        optimizer=replica.optimizer.state_dict(), scheduler=replica.scheduler.state_dict(),
        data_position={**plan.position(step), "replicas": world_size},
        rng=ckpt.rng_state(cfg.run.drafter_devices), config=cfg.to_dict(), drafter_config=dcfg.to_dict(),
        keep_last=cfg.run.keep_last)
