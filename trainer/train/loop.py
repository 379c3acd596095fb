"""Train a DFlash drafter. The loop reads top to bottom; the pieces live in their own modules.

    config -> world -> target(s) -> data -> drafter replicas (+ AdamW, warmup+cosine) -> [resume]
    for each step: every replica trains one batch, gradients averaged  (trainer.train.workers; DDP)
                   log a metrics record, checkpoint every N steps or when asked to stop

Both launchers share it; what differs lives in the world (trainer.train.world).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import sys
from typing import TextIO, cast

import torch
import yaml

from trainer.train import checkpoint as ckpt
from trainer import gdn_kernels, precision
from trainer.compile_lock import CompileGuard, compile_reason
from trainer.config import ConfigError, TrainConfig, check_devices
from trainer.train.distributed import TorchrunWorld, check_launcher
from trainer.data.feature_cache import training_source
from trainer.data.dataset import Batch, BatchPlan, Dataset, derive_seed, load_jsonl, synthetic_dataset
from trainer.data.heldout import split_heldout
from trainer.launchers import TORCHRUN
from trainer.masks import build_block_mask, dense_mask, sample_anchors
from trainer.loss import block_labels
from trainer.train.metrics import MetricsWriter, Throughput
from trainer.compile_modes import set_compile_mode
from trainer.model import EXPORT_METADATA, DFlashDrafter, DrafterConfig
from trainer.train.shutdown import StopRequest
from trainer.data.target import load_target
from trainer.train.training_eval import TrainingEval
from trainer.train.workers import Failure, LossOutput, Replica, StepSummary, TrainingWorkers
from trainer.train.world import ThreadsWorld, World


@dataclasses.dataclass
class RunResult:
    steps_done: int
    total_steps: int
    reason: str  # "max_steps" | "interrupted"
    last: StepSummary | None
    checkpoint: str | None
    replicas: list[Replica]


@dataclasses.dataclass
class LoopParts:
    """What the step loop trains with (built by prepare(); under torchrun: this rank's replica)."""

    cfg: TrainConfig
    targets: list
    replicas: list[Replica]
    dataset: Dataset
    plan: BatchPlan
    dcfg: DrafterConfig
    guard: CompileGuard
    start: int  # steps already done
    total: int
    evaluator: TrainingEval | None = None


def param_dtype(device: str) -> torch.dtype:
    """The frozen target's dtype: bf16 on GPU, fp32 on CPU (the drafter's is train.precision's)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def configured_target(cfg: TrainConfig, device: str):
    return load_target(
        cfg.target.spec,
        device,
        param_dtype(device),
        layer_ids=cfg.target.layer_ids,
        seed=cfg.train.seed,
        tiny=cfg.target.tiny or None,
    )


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine down to min_ratio at total_steps (a class, not
    a lambda, so LambdaLR's state_dict carries its numbers into checkpoints)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float):
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_dataset(cfg: TrainConfig, target) -> Dataset:
    if cfg.data.source == "synthetic":
        syn = cfg.data.synthetic
        return synthetic_dataset(target, syn.num_samples, syn.prompt_len, cfg.data.seq_len, cfg.train.seed)
    pad_id = getattr(target.tokenizer, "pad_token_id", None)  # None without a tokenizer too
    assert cfg.data.path is not None  # validate(): a jsonl source names its path
    return load_jsonl(
        cfg.data.path,
        cfg.data.seq_len,
        target.vocab_size,
        target.tokenizer,
        pad_id if pad_id is not None else 0,
        cfg.data.chat_template_kwargs,
    )


def drafter_config(cfg: TrainConfig, target) -> DrafterConfig:
    try:
        return DrafterConfig.for_target(target, **cfg.drafter.overrides())
    except ValueError as exc:  # names the offending drafter field
        raise ConfigError(f"{cfg.source}: drafter section: {exc}") from None


def build_replicas(cfg: TrainConfig, dcfg: DrafterConfig, target, total_steps: int) -> list[Replica]:
    """One drafter per drafter device, all with the same initial weights (seeded)."""
    torch.manual_seed(cfg.train.seed)
    base = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
    initial = {k: v.detach().clone() for k, v in base.state_dict().items()}
    t = cfg.train
    replicas = []
    for index, device in enumerate(cfg.run.drafter_devices):
        model = base if index == 0 else DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
        model.load_state_dict(initial)
        precision.place(model, device, precision.resolve(cfg))
        model.train()
        model.checkpoint_layers = t.activation_checkpointing == "layers"
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=t.lr,
            betas=(t.betas[0], t.betas[1]),  # validate(): exactly two
            weight_decay=t.weight_decay,
            fused=device.startswith("cuda") or None,
        )
        schedule = WarmupCosine(round(t.warmup_frac * total_steps), total_steps, t.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        replicas.append(Replica(index, device, model, optimizer, scheduler))
    return replicas


def restore(replicas: list[Replica], state: ckpt.Checkpoint, dcfg: DrafterConfig) -> None:
    """Continue exactly where the checkpoint stopped: weights, optimizer, schedule, RNG."""
    saved = state.drafter_config
    fix = "Fix: resume from an earlier step-NNNNNNN dir, or start a new --output-dir."
    if not isinstance(saved, dict):
        raise ckpt.CheckpointError(
            f"--resume {state.path}: {ckpt.DRAFTER_CONFIG} is not a JSON object. {fix}"
        )
    differ = sorted(
        k for k, v in dcfg.to_dict().items() if saved.get(k) != v and (k in saved or k not in EXPORT_METADATA)
    )
    if differ:
        raise ConfigError(
            f"--resume {state.path}: the checkpoint's drafter differs in {', '.join(differ)} "
            f"(checkpoint: {', '.join(f'{k}={saved.get(k)!r}' for k in differ)}). "
            f"Fix: resume with the config it was trained with, or start a new --output-dir."
        )
    for replica in replicas:  # copies into the replica's own parameters
        ckpt.load_weights(replica.model, state.weights, f"--resume {state.path}: its", fix)
        # load_state_dict keeps tensors that need no cast: without a copy, replicas on one device
        # would share (and each advance) the same Adam moments and step counts
        replica.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        replica.scheduler = resumed_scheduler(replica.scheduler, state.scheduler["last_epoch"])
    ckpt.set_rng_state(state.rng)


def resumed_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, steps_done: int):
    """`scheduler`'s schedule (THIS run's config: a longer --max-steps stretches the cosine) standing
    after `steps_done` steps; LambdaLR steps once as it is built, hence steps_done - 1."""
    return torch.optim.lr_scheduler.LambdaLR(
        scheduler.optimizer, scheduler.lr_lambdas, last_epoch=steps_done - 1
    )


def peak_gpu_memory_gib(devices: list[str]) -> float | None:
    """Peak GiB allocated on any of these CUDA devices since the last call (None: no CUDA); reads
    allocator counters, so no device sync."""
    cuda = sorted({dev for dev in devices if dev.startswith("cuda")})
    if not cuda:
        return None
    peak = max(torch.cuda.max_memory_allocated(dev) for dev in cuda)
    for dev in cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    return peak / 2**30


@dataclasses.dataclass
class Blocks:
    """One batch's drafted blocks: where they start, which are real, who sees what, how many tokens."""

    anchors: torch.Tensor  # [B, anchors] on the drafter's device
    valid: torch.Tensor
    mask: object  # a flex BlockMask or a dense SDPA mask
    tokens: int  # block tokens trained (valid anchors x block size), counted on the host


def make_block_drawer(cfg: TrainConfig):
    """draw(batch, device) -> Blocks. The target worker draws each batch's blocks while the drafter
    still runs the step before, so a step starts with its first kernel and never waits on the host."""
    block, num_anchors, seed = cfg.drafter.block_size, cfg.train.num_anchors, cfg.train.seed
    build = build_block_mask if cfg.run.attention == "flex" else dense_mask

    def draw(batch: Batch, device: str) -> Blocks:
        # Anchors depend on (seed, step, replica) only: a resumed run draws the same ones.
        gen = torch.Generator().manual_seed(derive_seed(seed, batch.step, batch.replica))
        anchors, valid = sample_anchors(batch.loss_mask.cpu(), num_anchors, block, gen)
        tokens = int(valid.sum()) * block
        anchors, valid = anchors.to(device), valid.to(device)
        return Blocks(anchors, valid, build(anchors, valid, batch.input_ids.shape[1], block, device), tokens)

    return draw


def make_loss_fn(cfg: TrainConfig):
    """The DFlash objective for one replica and one batch (runs inside the compile guard)."""
    block, gamma, backend = cfg.drafter.block_size, cfg.train.gamma, cfg.run.attention
    mode = precision.resolve(cfg)
    draw = make_block_drawer(cfg)

    def compute(replica: Replica, batch: Batch) -> LossOutput:
        blocks = batch.blocks if batch.blocks is not None else draw(batch, replica.device)
        model = cast(DFlashDrafter, replica.model)  # or the DrafterDDP around one: loss() passes through
        with precision.autocast(replica.device, mode):  # thread-local: entered in the drafter thread
            hidden = model(batch.features, batch.input_ids, blocks.anchors, blocks.mask, backend)
            labels, label_mask = block_labels(
                batch.input_ids, batch.loss_mask, blocks.anchors, blocks.valid, block
            )
            loss, acc = model.loss(precision.loss_input(hidden, mode), labels, label_mask, gamma)
        return LossOutput(loss=loss, acc=acc, tokens=blocks.tokens)

    return compute


def save(parts: LoopParts, model: torch.nn.Module, step: int) -> str:
    """One checkpoint of the run: `model` is the lead replica's drafter (all replicas are identical)."""
    cfg, lead, plan = parts.cfg, parts.replicas[0], parts.plan
    return ckpt.save_checkpoint(
        cfg.run.output_dir,
        step,
        weights=model.state_dict(),
        optimizer=lead.optimizer.state_dict(),
        scheduler=lead.scheduler.state_dict(),
        data_position={**plan.position(step), "replicas": plan.num_replicas},
        rng=ckpt.rng_state(cfg.run.target_devices + cfg.run.drafter_devices),
        config=cfg.to_dict(),
        drafter_config=parts.dcfg.to_dict(),
        keep_last=cfg.run.keep_last,
    )


def startup_summary(parts: LoopParts) -> list[str]:
    cfg, replicas, dataset, plan = parts.cfg, parts.replicas, parts.dataset, parts.plan
    params = sum(p.numel() for p in replicas[0].trainable())
    config = yaml.safe_dump(cfg.to_dict(), sort_keys=False).splitlines()
    return ["dflash-train: resolved config (" + cfg.source + "):", *("  " + line for line in config)] + [
        f"devices: target {', '.join(cfg.run.target_devices)} "
        f"| drafters {', '.join(cfg.run.drafter_devices)} ({len(replicas)} replica thread(s))",
        parts.guard.describe(),
        f"attention: {cfg.run.attention} (compile mode {cfg.run.compile_mode}) "
        f"| precision {precision.resolve(cfg)} "
        f"| activation checkpointing: {cfg.train.activation_checkpointing} "
        f"| torch {torch.__version__} | drafter params {params:,}",
        f"data: {len(dataset)} sequences x {cfg.data.seq_len} tokens from {dataset.source}; "
        f"{plan.steps_per_epoch} steps/epoch; {parts.total} steps total"
        + (f"; resuming after step {parts.start}" if parts.start else ""),
        f"metrics: {cfg.metrics_path} | checkpoints: {ckpt.checkpoints_root(cfg.run.output_dir)}",
    ]


def train(cfg: TrainConfig, out: TextIO | None = None, tty: bool | None = None) -> RunResult:
    """Run (or resume) training as configured; raises on failure after writing an `error` record."""
    check_launcher(cfg)
    world: World = TorchrunWorld.from_env(cfg) if cfg.run.launcher == TORCHRUN else ThreadsWorld(cfg)
    cfg = world.cfg
    check_devices(cfg)
    if not world.speaks:  # a torchrun rank that does not speak writes to /dev/null
        sys.stdout = out = open(os.devnull, "w")
    metrics = MetricsWriter(
        cfg.metrics_path if world.speaks else os.devnull,
        out=out,
        tty=tty,
        log_every=cfg.run.log_every,
        report_to=world.trackers,
        report_dir=cfg.run.output_dir,
    )
    guard = CompileGuard(
        cfg.run.compile_lock,
        on_event=lambda e: metrics.compile(
            world.thread(e.get("thread", "?")),
            e.get("duration_s") or 0.0,
            e.get("step", -1),
            compile_reason(e),
        ),
    )
    stop = world.stop_request()
    world.join()
    try:
        parts = prepare(world, guard, metrics)
        world.listen(stop)
        return _loop(parts, world, metrics, stop)
    except BaseException as exc:
        failure = Failure.of(exc)
        if (label := world.failed(failure)) is not None:
            metrics.failed(failure, stop.last_step, label=label)
        raise
    finally:
        stop.uninstall()
        guard.uninstall()
        metrics.close()
        world.close()


def prepare(world: World, guard: CompileGuard, metrics: MetricsWriter) -> LoopParts:
    """Everything the loop trains with, resumed if asked; the `start` record written."""
    cfg = world.cfg
    guard.install()  # before anything is compiled (patch mode must precede torch.compile)
    set_compile_mode(cfg.run.compile_mode)
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    heldout = None
    if cfg.data.source == "features":  # a feature cache gives embedding+lm_head stand-ins
        targets, dataset = training_source(cfg, param_dtype(cfg.run.drafter_devices[0]))
    else:
        targets = [configured_target(cfg, dev) for dev in cfg.run.target_devices]
        dataset, heldout = split_heldout(
            build_dataset(cfg, targets[0]), cfg.data.eval_fraction, cfg.train.seed
        )
    world.agree_data(dataset)
    plan = BatchPlan(len(dataset), cfg.train.batch_size, world.size, cfg.train.seed, dataset.source)
    total = plan.total_steps(cfg.train.epochs, cfg.train.max_steps)
    dcfg = drafter_config(cfg, targets[0])
    replicas = build_replicas(cfg, dcfg, targets[0], total)
    # the lead evaluates tau between steps; other ranks wait for it at the next step's all-reduce
    evaluator = (
        TrainingEval.create(cfg, targets[0], dcfg, heldout, param_dtype(targets[0].device), metrics.say)
        if world.is_lead
        else None
    )
    start, upcast = 0, None
    if cfg.run.resume:
        state = ckpt.load_checkpoint(ckpt.resolve_resume(cfg.run.resume, cfg.run.output_dir))
        world.agree_resume(state)
        restore(replicas, state, dcfg)
        start, upcast = state.step, precision.upcast_note(state.weights, state.path)
    world.ready(replicas, start)
    parts = LoopParts(cfg, targets, replicas, dataset, plan, dcfg, guard, start, total, evaluator)
    kernels = gdn_kernels.gated_deltanet_path(targets[0].model) if hasattr(targets[0], "model") else None
    summary = startup_summary(parts) + world.describe()
    summary += [line for line in [gdn_kernels.describe(kernels)] if line]
    metrics.start(cfg.to_dict(), world.devices, cfg.run.compile_lock, total, summary, gated_deltanet=kernels)
    if upcast:
        metrics.say(upcast)
    return parts


def make_workers(parts: LoopParts) -> TrainingWorkers:
    """The threads that train `parts.replicas` (all of them here; one per process under torchrun)."""
    cfg = parts.cfg
    return TrainingWorkers(
        **{name: getattr(parts, name) for name in ("targets", "replicas", "dataset", "plan", "guard")},
        compute_loss=make_loss_fn(cfg),
        draw_blocks=make_block_drawer(cfg),
        grad_clip=cfg.train.grad_clip,
        # target features reach the drafter devices in the compute dtype
        feature_dtype=precision.compute_dtype(precision.resolve(cfg)),
    )


def _loop(parts: LoopParts, world: World, metrics: MetricsWriter, stop: StopRequest) -> RunResult:
    cfg, replicas, start, total = parts.cfg, parts.replicas, parts.start, parts.total
    last, path, step = None, None, start
    throughput = Throughput(start, total)
    devices = cfg.run.target_devices + cfg.run.drafter_devices
    with make_workers(parts) as workers:
        workers.start(start, total)
        for step_index in range(start, total):
            ahead = world.pipelines and not stop.requested
            ahead = ahead and _may_run_ahead(parts, step_index + 1, throughput.step_s)
            last = world.step(workers, step_index, stop, ahead)
            step = stop.last_step = last.step
            tokens_per_s, eta_s = throughput.update(step, last.tokens)
            metrics.step(
                step=step,
                total_steps=total,
                tokens_per_s=tokens_per_s,
                eta_s=eta_s,
                epoch=step / parts.plan.steps_per_epoch,
                gpu_memory_gib=peak_gpu_memory_gib(devices),
                **{name: getattr(last, name) for name in ("loss", "acc", "lr", "grad_norm")},
            )
            if parts.evaluator is not None and parts.evaluator.due(step, total):
                parts.evaluator.run(world.model(replicas), step, metrics)
                throughput.last = throughput.clock()  # the next step's tok/s counts training only
            stopping = world.stopping(stop)
            if stopping and ahead:
                continue  # the step already running ends the run
            if world.is_lead and (step % cfg.run.checkpoint_every == 0 or step == total or stopping):
                path = save(parts, world.model(replicas), step)
                metrics.checkpoint(step, path)
            if stopping and step < total:  # a stop during the last step leaves a complete run
                metrics.say(f"{stop.signal_name or 'another rank'}: stopped after step {step}")
                metrics.done(step, "interrupted")
                return RunResult(step, total, "interrupted", last, path, replicas)
    if world.speaks:  # under torchrun every host's launcher reads its own run directory
        ckpt.mark_finished(cfg.run.output_dir, step)
    metrics.done(step, "max_steps")
    return RunResult(step, total, "max_steps", last, path, replicas)


def _may_run_ahead(parts: LoopParts, step: int, step_s: float) -> bool:
    """Whether the step after `step` (1-based) may start before `step` is read: only logging comes
    between them (no checkpoint, no evaluation, not the last step), and a stop, which then waits
    for both, still ends well within run.stop_grace_s (steps of `step_s` take a quarter at most)."""
    evaluates = parts.evaluator is not None and parts.evaluator.due(step, parts.total)
    quick = 2 * step_s <= parts.cfg.run.stop_grace_s / 2
    return quick and step < parts.total and step % parts.cfg.run.checkpoint_every != 0 and not evaluates
