"""Drafter training throughput at paper dims: compiled vs eager flex_attention, MFU, the lock's cost.

    python benchmarks/train_throughput.py --device cuda:0 --out benchmarks/results/throughput.md [--profile]
    python benchmarks/train_throughput.py --small            # same code, tiny dims, CPU (sdpa)

One run measures, each part in its own fresh process with fresh empty inductor/triton caches:
1. peak: a bf16 8192^3 matmul (the MFU denominator, measured on this GPU in this run);
2. compiled: training steps with the trainer's compiled flex_attention, bare (one function, the
   blocks drawn inside the step) and through the trainer's TrainingWorkers, as a run takes them;
   loss-kernel: the bare steps again with the loss chunk torch.compile makes instead of the Triton one;
3. eager: the same steps with eager flex_attention (a separate process: eager flex must never
   share a process with compiled code, it can leave the global FX flag stuck);
4. first step: N drafter threads (one replica each) starting together, compile lock "lock" vs
   "none": per-thread latency from the common start to the end of its first forward+backward;
5. checkpointing: the compiled run again with every drafter layer checkpointed
   (train.activation_checkpointing: layers): the peak memory it saves and the step time it costs.

Paper dims (DFlash, arXiv 2602.06036): hidden 4096, 32 heads / 8 KV heads, head_dim 128,
intermediate 12288, 5 layers, block 16, 512 anchors, context 3072, 5 target layers; random
target hidden states, a random frozen embedding + lm_head (vocab 151936).

Precision is the trainer's own path (trainer.precision, --precision, default bf16-mixed on GPU):
fp32 master weights and fused AdamW state, bf16 autocast compute, the frozen embedding and lm_head
in bf16. The report gives the peak memory (torch.cuda.max_memory_allocated) and the bytes of the
fp32 master weights + AdamW moments (12 bytes per parameter; fp32 gradients add 4 more).
`--precision bf16-pure` is the baseline the trainer no longer uses: bf16 parameters updated in
place by AdamW (fast, but updates round away), for a before/after comparison on the same machine.

A step = sample anchors + build the block mask + forward + fused DFlash loss + backward + AdamW,
timed with the device synchronised. Throughput is given two ways: block tokens/s (valid anchors x
block size per second, the trainer's own `tokens_per_s`) and context tokens/s (batch x context
length per second).

Model FLOPs per step (counted, not measured; norms, RoPE and elementwise ops left out):
- linear layers of each drafter layer: q/o over the N*16 block rows, k/v over context + block
  rows, gate/up/down over block rows: 2*m*n*k each; backward 2x (weight grads + input grads);
- fc (target features -> hidden): forward, backward weight grads only (its input is data);
- attention: 4*head_dim*heads per query-key pair that the mask lets through (QK^T and PV),
  counted exactly from this step's anchors (a block sees `anchor` context keys + its 16 block keys,
  a padding block only itself); backward 2x (no credit for recomputation);
- frozen lm_head on the trained rows (block positions 1..15; position 0 is never trained):
  forward + input gradient only (no weight gradient).
MFU = model FLOPs per step / median step time / measured matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.baselines import FLEX_EAGER, attention_backend  # noqa: E402
from benchmarks.common import (  # noqa: E402
    doc_parser,
    QWEN3_8B_SHAPE,
    built_on,
    fresh_compile_env,
    popen_text,
    time_cache_write,
    versions,
)

RESULT_TAG = "BENCH_RESULT "
PURE_BF16 = "bf16-pure"  # baseline only: bf16 parameters and AdamW state, no fp32 master weights
BEFORE = "before: flex compiled, layers + loss chunks eager"  # the trainer's path before, same run
# The same steps as a training run takes them: through TrainingWorkers, blocks drawn ahead, no sync mid-step
TRAINER_FLEX, TRAINER_SDPA = "compiled flex, trainer's workers", "sdpa, trainer's workers"
TRAINER_AHEAD = "compiled flex, trainer's workers, steps run ahead"
TRAINER_SDPA_AHEAD = "sdpa, trainer's workers, steps run ahead"
COMPILED_CHUNK = "compiled flex, compiled loss chunk"  # the loss chunk torch.compile makes, not Triton's

PAPER = {
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "intermediate": 12288,
    "layers": 5,
    "block": 16,
    "anchors": 512,
    "ctx": 3072,
    "vocab": 151936,
    "target_layers": 5,
    "batch": 1,
}
SMALL = {
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "intermediate": 128,
    "layers": 2,
    "block": 16,
    "anchors": 16,
    "ctx": 256,
    "vocab": 512,
    "target_layers": 3,
    "batch": 1,
}


# ---- FLOPs --------------------------------------------------------------------------------------


def visible_pairs(anchors, valid, block: int) -> int:
    """Query-key pairs the DFlash mask lets through (see trainer/masks.py for the rule)."""
    anchors = anchors.long()
    per_valid_block = block * (anchors + block)  # `anchor` context keys + the whole own block
    return int((per_valid_block * valid).sum()) + int((~valid).sum()) * block  # padding: self only


def step_flops(dims: dict, pairs: int) -> dict:
    """Model FLOPs of one training step (forward + backward), by part."""
    b, h, i = dims["batch"], dims["hidden"], dims["intermediate"]
    nh, nkv, hd = dims["heads"], dims["kv_heads"], dims["head_dim"]
    q_rows = b * dims["anchors"] * dims["block"]
    kv_rows = b * dims["ctx"] + q_rows
    lm_rows = b * dims["anchors"] * (dims["block"] - 1)
    layer_linear = (
        2 * q_rows * h * nh * hd * 2  # q_proj, o_proj
        + 2 * kv_rows * h * nkv * hd * 2  # k_proj, v_proj
        + 2 * q_rows * h * i * 3
    )  # gate, up, down
    attention = 4 * hd * nh * pairs  # summed over the batch already
    fc = 2 * b * dims["ctx"] * dims["target_layers"] * h * h
    lm_head = 2 * lm_rows * h * dims["vocab"]
    parts = {
        "layers_linear": 3 * dims["layers"] * layer_linear,
        "attention": 3 * dims["layers"] * attention,
        "fc": 2 * fc,
        "lm_head": 2 * lm_head,
    }
    parts["total"] = sum(parts.values())
    return parts


# ---- child processes ----------------------------------------------------------------------------


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def child_peak(args, dims) -> dict:
    """Dense matmul peak of this device, measured (bf16 8192^3 on GPU, fp32 1024^3 on CPU)."""
    import torch

    cuda = args.device.startswith("cuda")
    n, dtype, reps = (8192, torch.bfloat16, 50) if cuda else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(torch, args.device)
    best = float("inf")
    for _ in range(5):  # best of 5 bursts: the peak the device can actually reach
        began = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(torch, args.device)
        best = min(best, (time.perf_counter() - began) / reps)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "tflops": 2 * n**3 / best / 1e12}


def drafter_config(dims, **of_target):
    """The drafter of the benchmark's `dims`; `of_target` sets what a real target fixes instead
    (its hidden size, vocabulary, mask token and feature layers)."""
    from trainer.model import DrafterConfig

    own = {
        "hidden_size": dims["hidden"],
        "vocab_size": dims["vocab"],
        "mask_token_id": dims["vocab"] - 1,
        "target_layer_ids": list(range(1, dims["target_layers"] + 1)),
    }
    return DrafterConfig(
        **{**own, **of_target},
        intermediate_size=dims["intermediate"],
        num_heads=dims["heads"],
        num_kv_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        num_layers=dims["layers"],
        block_size=dims["block"],
    )


def _build(args, dims, torch, seed: int = 0):
    from trainer import precision
    from trainer.model import DFlashDrafter

    cuda = args.device.startswith("cuda")
    pure = args.precision == PURE_BF16
    dtype = torch.bfloat16 if pure else precision.compute_dtype(args.precision)  # frozen target, features
    cfg = drafter_config(dims)
    torch.manual_seed(seed)
    with torch.device(args.device):  # initialise on the device: 1B parameters on a CPU is slow
        embed = torch.nn.Embedding(dims["vocab"], dims["hidden"]).to(dtype).requires_grad_(False)
        lm_head = torch.nn.Linear(dims["hidden"], dims["vocab"], bias=False).to(dtype).requires_grad_(False)
        drafter = DFlashDrafter(cfg, embed, lm_head)
        model = drafter.to(dtype) if pure else precision.place(drafter, args.device, args.precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)  # as the trainer
    return cfg, model, optimizer, dtype


def _batch(args, dims, cfg, torch, dtype, gen):
    b, t = dims["batch"], dims["ctx"]
    input_ids = torch.randint(0, cfg.vocab_size - 1, (b, t), generator=gen)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[:, t // 4 :] = True  # a prompt without loss, then the response
    features = torch.randn(b, t, cfg.context_size, generator=gen, dtype=torch.float32)
    return input_ids.to(args.device), loss_mask, features.to(args.device, dtype)


def _train_step(args, dims, cfg, model, optimizer, batch, gen, attention: str, torch):
    from trainer import precision
    from trainer.loss import block_labels
    from trainer.masks import build_block_mask, dense_mask, sample_anchors

    input_ids, loss_mask, features = batch
    anchors, valid = sample_anchors(loss_mask, dims["anchors"], cfg.block_size, gen)
    pairs = visible_pairs(anchors, valid, cfg.block_size)
    anchors, valid = anchors.to(args.device), valid.to(args.device)
    t = input_ids.shape[1]
    build = dense_mask if attention == "sdpa" else build_block_mask
    mask = build(anchors, valid, t, cfg.block_size, args.device)
    pure = args.precision == PURE_BF16
    with contextlib.nullcontext() if pure else precision.autocast(args.device, args.precision):
        # what trainer.train.loop.make_loss_fn does
        hidden = model(features, input_ids, anchors, mask, attention_backend(attention))
        labels, label_mask = block_labels(
            input_ids, loss_mask.to(args.device), anchors, valid, cfg.block_size
        )
        hidden = hidden if pure else precision.loss_input(hidden, args.precision)
        loss, _ = model.loss(hidden, labels, label_mask, gamma=7.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return pairs, int(valid.sum()) * cfg.block_size, mask


def _bare_timed(args, dims, cfg, model, optimizer, batch, guard, gen):
    """(first step s, timed steps s, pairs, block tokens): bare steps, the device synchronised around each."""
    import torch

    from trainer.compile_lock import assert_fx_flag_clear

    times, pairs_seen, tokens_seen = [], [], []
    for step in range(args.warmup + args.steps):
        _sync(torch, args.device)
        began = time.perf_counter()
        with guard.step("drafter0", step, tuple(batch[0].shape)):
            pairs, tokens, mask = _train_step(
                args, dims, cfg, model, optimizer, batch, gen, args.attention, torch
            )
        _sync(torch, args.device)
        elapsed = time.perf_counter() - began
        if step == 0:
            first_step_s = elapsed
            if args.attention == "flex":
                assert_fx_flag_clear()
            if args.attention == "sdpa":  # self-check of the pair count against the real mask
                dense = int(mask.sum())
                if dense != pairs:
                    raise AssertionError(f"pair count {pairs} != dense mask {dense}")
        if step >= args.warmup:
            times.append(elapsed)
            pairs_seen.append(pairs)
            tokens_seen.append(tokens)
    profile = None
    if args.profile:

        def step() -> None:
            with guard.step("drafter0", 10_000, tuple(batch[0].shape)):
                _train_step(args, dims, cfg, model, optimizer, batch, gen, args.attention, torch)

        profile = _profiled(args, torch, step)
    return first_step_s, times, pairs_seen, tokens_seen, profile


def _back_to_back(workers, first: int, count: int) -> list[float]:
    """Seconds between the returns of run_step for steps first.., each but the last started while the
    one before it ran, as the trainer's loop does between checkpoints."""
    times, mark = [], time.perf_counter()
    for step in range(first, first + count):
        workers.run_step(step, ahead=step + 1 < first + count)
        now = time.perf_counter()
        times.append(now - mark)
        mark = now
    return times


def _workers_timed(args, dims, cfg, model, optimizer, batch, guard, gen):
    """The same through the trainer's TrainingWorkers (blocks drawn ahead on the loader thread, the
    step's numbers read by run_step): what a training run's step costs. Features stay resident."""
    import torch

    from trainer.data.dataset import BatchPlan, Dataset, make_batch
    from trainer.train.loop import make_block_drawer
    from trainer.train.workers import Replica

    input_ids, loss_mask, features = batch
    ahead = args.loop == "ahead"  # one more step: the first back-to-back interval starts from idle
    total = args.warmup + args.steps + int(ahead) + (3 if args.profile else 0)
    dataset = Dataset(input_ids.cpu(), loss_mask, torch.ones_like(loss_mask), source="random")
    dataset.features = lambda idx: features[: len(idx)]
    plan = BatchPlan(len(dataset), dims["batch"], 1, seed=0)
    run_cfg = trainer_run_config(args, dims)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    replica = Replica(0, args.device, model, optimizer, scheduler)
    stand_in = types.SimpleNamespace(device=args.device)
    with _one_replica(stand_in, replica, dataset, plan, run_cfg, guard, features.dtype) as workers:
        workers.start(0, total)
        steps = iter(range(total))
        first = _timed(torch, args.device, lambda: workers.run_step(next(steps)), 1, warmup=0)
        if ahead:
            _timed(torch, args.device, lambda: workers.run_step(next(steps)), args.warmup - 1, warmup=0)
            times = _back_to_back(workers, args.warmup, args.steps + 1)[1:]
            steps = iter(range(args.warmup + args.steps + 1, total))
        else:
            times = _timed(
                torch, args.device, lambda: workers.run_step(next(steps)), args.steps, args.warmup - 1
            )
        profile = None
        if args.profile:  # the last three steps; run ahead, each but the last starts the next
            profile = _profiled(
                args,
                torch,
                lambda: workers.run_step(i := next(steps), ahead=ahead and i + 1 < total),
                not ahead,
            )
    draw = make_block_drawer(run_cfg)  # each timed step's blocks again: they depend on seed, step, replica
    timed = range(args.warmup + int(ahead), args.warmup + args.steps + int(ahead))
    drawn = [draw(make_batch(dataset, plan, step, 0), "cpu") for step in timed]
    pairs = [visible_pairs(b.anchors, b.valid, cfg.block_size) for b in drawn]
    return first[0], times, pairs, [b.tokens for b in drawn], profile


def child_train(args, dims) -> dict:
    import torch

    from trainer.compile_lock import CompileGuard

    events: list = []
    guard = CompileGuard("lock", on_event=events.append).install()
    cfg, model, optimizer, dtype = _build(args, dims, torch)
    model.checkpoint_layers = args.checkpointing == "layers"
    model.compile_layers = {"auto": "auto", "off": False}[args.compile_layers]
    model.loss_kernel = args.loss_kernel
    gen = torch.Generator().manual_seed(1)
    batch = _batch(args, dims, cfg, torch, dtype, gen)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    timed = _bare_timed if args.loop == "bare" else _workers_timed
    first_step_s, times, pairs_seen, tokens_seen, profile = timed(
        args, dims, cfg, model, optimizer, batch, guard, gen
    )
    median = statistics.median(times)
    result = {
        "loop": args.loop,
        "attention": args.attention,
        "checkpointing": args.checkpointing,
        "compile_layers": args.compile_layers,
        "loss_kernel": args.loss_kernel,
        "first_step_s": first_step_s,
        "median_step_s": median,
        "step_times_s": [round(t, 4) for t in times],
        "pairs_per_step": statistics.mean(pairs_seen),
        "block_tokens_per_step": statistics.mean(tokens_seen),
        "context_tokens_per_step": dims["batch"] * dims["ctx"],
        "compiles": [
            {k: e[k] for k in ("thread", "step", "duration_s", "reason", "trigger")} for e in events
        ],
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.startswith("cuda") else None
        ),
        "precision": args.precision,
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
        "optimizer_state_bytes": sum(
            t.numel() * t.element_size()
            for st in optimizer.state.values()
            for t in st.values()
            if torch.is_tensor(t) and t.dim() > 0
        ),
    }
    if profile:
        result["profile"] = profile
    return result


def _profiled(args, torch, step, sync_each: bool = True) -> str:
    """The top kernels of three calls of `step()` (the device synchronised after each, or only after
    the last) and where the device waited between them."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_gaps import load, report

    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
            if sync_each:
                _sync(torch, args.device)
        _sync(torch, args.device)
    # "self_cuda_time_total" is understood by old and new torch (newer ones map cuda -> device).
    table = prof.key_averages().table(sort_by=f"self_{'cuda' if cuda else 'cpu'}_time_total", row_limit=25)
    if not cuda:
        return table
    with tempfile.TemporaryDirectory() as scratch:
        prof.export_chrome_trace(os.path.join(scratch, "trace.json"))
        return f"{table}\n\n{report(load(os.path.join(scratch, 'trace.json')), steps=3)}"


def child_first_step(args, dims) -> dict:
    """N threads, one replica each, start together; time each thread's first forward+backward."""
    import torch

    from trainer.compile_lock import CompileGuard, is_fx_tracing_error

    guard = CompileGuard(args.lock).install()
    replicas = [_build(args, dims, torch) for _ in range(args.threads)]
    start = threading.Barrier(args.threads + 1)
    latency, errors = {}, []

    def drafter(index: int) -> None:
        cfg, model, optimizer, dtype = replicas[index]
        gen = torch.Generator().manual_seed(1)
        batch = _batch(args, dims, cfg, torch, dtype, gen)
        _sync(torch, args.device)
        start.wait()
        began = time.perf_counter()
        try:
            with guard.step(f"drafter{index}", 0, tuple(batch[0].shape)):
                _train_step(args, dims, cfg, model, optimizer, batch, gen, args.attention, torch)
                _sync(torch, args.device)
            latency[f"drafter{index}"] = round(time.perf_counter() - began, 3)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: "none" may hit the race
            errors.append(
                {
                    "thread": f"drafter{index}",
                    "fx_tracing": is_fx_tracing_error(exc),
                    "message": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                }
            )

    threads = [threading.Thread(target=drafter, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return {
        "lock": args.lock,
        "latency_s": latency,
        "all_done_s": round(time.perf_counter() - began, 3),
        "errors": errors,
        "compiles": len(guard.events),
    }


def _write_synthetic_cache(args, dims, cfg, torch, cache_dir: str, sequences: int) -> dict:
    """A feature cache at these dims through the trainer's own shard stream (random target features)."""
    from trainer.data.cache_writer import ShardStream
    from trainer.data.dataset import Dataset
    from trainer.data.feature_cache import FORMAT, complete_manifest

    manifest = {
        "format": FORMAT,
        "target": {"hidden_size": dims["hidden"], "synthetic": True},
        "layer_ids": list(cfg.target_layer_ids),
        "seq_len": dims["ctx"],
        "dtype": "bf16",
        "pad_id": 0,
        "tokenizer": None,
        "data": {"source": "random"},
        "complete": False,
        "shards": [],
    }
    t = dims["ctx"]
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size - 1, (sequences, t), generator=gen)
    loss_mask = torch.zeros(sequences, t, dtype=torch.bool)
    loss_mask[:, t // 4 :] = True
    tokens = Dataset(ids, loss_mask, torch.ones_like(loss_mask), "random")
    stream = ShardStream(cache_dir, manifest, tokens, 0, args.shard_mb << 20)
    began = time.perf_counter()
    try:
        for _ in range(sequences):
            stream.add(torch.randn(1, t, cfg.context_size, device=args.device, dtype=torch.bfloat16).cpu(), 1)
    finally:
        stream.close()
    complete_manifest(cache_dir, manifest)
    return {"write_s": round(time.perf_counter() - began, 2), **manifest["counts"]}


def _drop_page_cache(path: str) -> None:
    """Evict a file's pages (no root needed) so the timed steps read from the disk."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def trainer_run_config(args, dims: dict):
    """The trainer config of a benchmark run: its block, anchors, attention and precision."""
    from trainer.config import TrainConfig

    if args.precision == PURE_BF16:
        raise SystemExit(
            "this part trains through the trainer's own loss: use --precision bf16-mixed or fp32"
        )
    run_cfg = TrainConfig()
    run_cfg.drafter.block_size, run_cfg.train.num_anchors = dims["block"], dims["anchors"]
    run_cfg.train.gamma, run_cfg.run.attention = 7.0, args.attention
    run_cfg.train.precision, run_cfg.run.drafter_devices = args.precision, [args.device]
    return run_cfg


def _one_replica(stand_in, replica, dataset, plan, run_cfg, guard, feature_dtype):
    """The trainer's TrainingWorkers for one target and one drafter replica, as a run builds them."""
    from trainer.train.loop import make_block_drawer, make_loss_fn
    from trainer.train.workers import TrainingWorkers

    return TrainingWorkers(
        targets=[stand_in],
        replicas=[replica],
        dataset=dataset,
        plan=plan,
        compute_loss=make_loss_fn(run_cfg),
        draw_blocks=make_block_drawer(run_cfg),
        guard=guard,
        grad_clip=1.0,
        feature_dtype=feature_dtype,
    )


def child_cache(args, dims) -> dict:
    """Steps through the trainer's real pipeline (TrainingWorkers: a loader thread, a queue of 2,
    pinned memory): features resident on the GPU (drafter-only) vs read from a feature cache on disk."""
    import torch

    from trainer.compile_lock import CompileGuard
    from trainer.data.dataset import BatchPlan
    from trainer.data.feature_cache import CacheReader, bytes_per_token, open_cache
    from trainer.train.workers import Replica

    cfg, model, optimizer, dtype = _build(args, dims, torch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    replica = Replica(0, args.device, model, optimizer, scheduler)
    from trainer import precision

    run_cfg = trainer_run_config(args, dims)
    feature_dtype = precision.compute_dtype(args.precision)
    guard = CompileGuard("lock").install()
    total = args.warmup + args.steps
    cache_dir = tempfile.mkdtemp(prefix="feature-cache-", dir=args.cache_dir)
    try:
        written = _write_synthetic_cache(args, dims, cfg, torch, cache_dir, total)
        expected = {
            "target": {"hidden_size": dims["hidden"], "synthetic": True},
            "layer_ids": list(cfg.target_layer_ids),
            "seq_len": dims["ctx"],
        }
        cached = open_cache(cache_dir, expected, pin_memory=args.device.startswith("cuda"))
        reader = getattr(cached.features, "__self__", None)  # the shards' reader behind the dataset
        assert isinstance(reader, CacheReader)
        reader.verify_all()  # sha256 checks now, not inside the timed steps
        for shard in reader.shards:
            _drop_page_cache(os.path.join(cache_dir, shard["file"]))
        resident_features = torch.randn(
            dims["batch"], dims["ctx"], cfg.context_size, device=args.device, dtype=dtype
        )
        resident = copy.copy(cached)
        resident.features = lambda idx: resident_features[: len(idx)]  # contiguous, like a cache batch
        stand_in = types.SimpleNamespace(device="cpu")  # the loader thread's "target": it computes nothing
        results = {}
        arms = (
            ("drafter-only (features resident on the device)", resident),
            ("feature cache (disk)", cached),
            ("feature cache (page cache)", cached),
        )  # the second pass finds the shards in RAM
        for name, dataset in arms:
            plan = BatchPlan(len(dataset), dims["batch"], 1, seed=0)
            times = []
            with _one_replica(stand_in, replica, dataset, plan, run_cfg, guard, feature_dtype) as workers:
                workers.start(0, plan.total_steps(1, total))
                for step in range(plan.total_steps(1, total)):
                    _sync(torch, args.device)
                    began = time.perf_counter()
                    workers.run_step(step)
                    _sync(torch, args.device)
                    times.append(time.perf_counter() - began)
            measured = times[args.warmup :]
            results[name] = {
                "median_step_s": statistics.median(measured),
                "first_step_s": times[0],
                "step_times_s": [round(t, 4) for t in measured],
            }
        per_1k = 1000 * bytes_per_token(len(cfg.target_layer_ids), dims["hidden"], "bf16")
        return {
            "runs": results,
            "cache": written,
            "cache_bytes_per_1k_tokens": per_1k,
            "measured_bytes_per_1k_tokens": 1000 * written["bytes"] / written["tokens"],
            "read_per_step_mib": dims["batch"] * dims["ctx"] * cfg.context_size * 2 / 2**20,
        }
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


QWEN3_8B = dict(
    QWEN3_8B_SHAPE,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SMALL_TARGET = dict(
    QWEN3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def _random_target(args, torch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.data.target import TargetModel, default_layer_ids

    config = Qwen3Config(**(SMALL_TARGET if args.small else QWEN3_8B))
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with built_on(args.device, dtype):
        model = Qwen3ForCausalLM(config)
    layer_ids = default_layer_ids(config.num_hidden_layers)
    return TargetModel(
        model=model,
        layer_ids=layer_ids,
        tokenizer=None,
        device=args.device,
        mask_token_id=config.vocab_size - 1,
    )


def _timed(torch, device: str, fn, repeats: int, warmup: int = 1) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        _sync(torch, device)
        began = time.perf_counter()
        fn()
        _sync(torch, device)
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return times


def child_e2e(args, dims) -> dict:
    """A Qwen3-8B-shaped target and the drafter on ONE device, in one process:
    1. the target's bare feature forward (3072 tokens; layers up to the last feature layer);
    2. the drafter step alone (features resident), through the trainer's TrainingWorkers;
    3. end to end: the target worker computes each batch's features, the drafter trains on them;
    4. cache-features at these dims: trainer.data.cache_writer.write_cache against the bare forward of
       the same batches (same batch size)."""
    import torch

    from trainer.compile_lock import CompileGuard
    from trainer.data.dataset import Dataset

    guard = CompileGuard("lock").install()
    target = _random_target(args, torch)
    b, t = dims["batch"], dims["ctx"]
    gen = torch.Generator().manual_seed(3)
    sequences = max(args.warmup + args.steps, args.cache_sequences)
    ids = torch.randint(0, target.vocab_size - 1, (sequences, t), generator=gen)
    loss_mask = torch.zeros(sequences, t, dtype=torch.bool)
    loss_mask[:, t // 4 :] = True
    dataset = Dataset(ids, loss_mask, torch.ones_like(loss_mask), source="random")
    result = {"target_layer_ids": target.layer_ids, "target_layers": target.num_layers}

    one = ids[:b].to(args.device)
    with torch.no_grad():
        bare = _timed(
            torch, args.device, lambda: target.features(one, attention_mask=torch.ones_like(one)), args.steps
        )
    result["target_forward_s"] = statistics.median(bare)
    result.update(_e2e_steps(args, dims, target, dataset, one, guard, torch))
    result["sum_s"] = result["target_forward_s"] + result["drafter_step_s"]
    result["e2e_vs_sum"] = result["sum_s"] / result["e2e_step_s"]
    roots = (args.cache_dir or "").split(",")  # several: the writer on each filesystem, e.g. tmpfs and disk
    result["cache"], *others = [
        _e2e_cache(args, target, ids, loss_mask, torch, root or None) for root in roots
    ]
    result["cache_on"] = dict(zip(roots[1:], others, strict=True))
    return result


def _e2e_steps(args, dims, target, dataset, one, guard, torch) -> dict:
    """The drafter step with its features resident, then with the target computing them (end to end)."""
    from trainer import precision
    from trainer.data.dataset import BatchPlan, Dataset
    from trainer.model import DFlashDrafter
    from trainer.train.workers import Replica

    cfg = drafter_config(
        dims,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        mask_token_id=target.mask_token_id,
        target_layer_ids=target.layer_ids,
    )
    torch.manual_seed(0)
    model = precision.place(
        DFlashDrafter(cfg, target.embed_tokens, target.lm_head), args.device, args.precision
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device.startswith("cuda") or None)
    replica = Replica(
        0, args.device, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    )
    run_cfg = trainer_run_config(args, dims)
    feature_dtype = precision.compute_dtype(args.precision)
    with torch.no_grad():
        resident_features = target.features(one, attention_mask=torch.ones_like(one)).to(feature_dtype)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)

    def steps(source: Dataset, stand_in, replica: Replica) -> list[float]:
        plan = BatchPlan(len(source), dims["batch"], 1, seed=0)
        total = min(plan.total_steps(1, None), args.warmup + args.steps)
        with _one_replica(stand_in, replica, source, plan, run_cfg, guard, feature_dtype) as workers:
            workers.start(0, total)
            counter = iter(range(total))
            return _timed(
                torch,
                args.device,
                lambda: workers.run_step(next(counter)),
                total - args.warmup,
                warmup=args.warmup,
            )

    resident = copy.copy(dataset)
    resident.features = lambda idx, features=resident_features: features[: len(idx)]
    drafter = steps(resident, types.SimpleNamespace(device=args.device), replica)
    both = steps(dataset, target, replica)
    peak = torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.startswith("cuda") else None
    del replica, model, optimizer, resident_features, resident
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "drafter_step_s": statistics.median(drafter),
        "e2e_step_s": statistics.median(both),
        "e2e_step_times_s": [round(x, 4) for x in both],
        "peak_memory_gib": peak,
    }


def _e2e_cache(args, target, ids, loss_mask, torch, root: str | None) -> dict:
    """cache-features: the writer against the bare forward of the same batches."""
    from trainer.config import TrainConfig
    from trainer.data.dataset import Dataset
    from trainer.data.feature_cache import cache_header

    count, t = args.cache_sequences, ids.shape[1]
    cache_set = Dataset(ids[:count], loss_mask[:count], torch.ones_like(loss_mask[:count]), source="random")
    header_cfg = TrainConfig()
    header_cfg.target.spec, header_cfg.data.seq_len = "random-qwen3-8b-shape", t
    header_cfg.data.source = "synthetic"  # the provenance fields of random data
    header = cache_header(header_cfg, target, "bf16", 0)
    cache_dir = tempfile.mkdtemp(prefix="feature-cache-e2e-", dir=root)
    try:
        timed = time_cache_write(target, cache_set, cache_dir, header, args.device)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    bare_s, cache_s, counts = timed["bare_forward_s"], timed["write_cache_s"], timed["manifest"]["counts"]
    return {
        "sequences": count,
        "batch": timed["batch"],
        "tokens": count * t,
        "bare_forward_s": bare_s,
        "write_cache_s": cache_s,
        "tokens_per_s": count * t / cache_s,
        "bare_tokens_per_s": count * t / bare_s,
        "ratio": cache_s / bare_s,
        "bytes": counts["bytes"],
        "shards": counts["shards"],
        "dir_root": os.path.dirname(cache_dir),
    }


def render_e2e(result: dict) -> list[str]:
    if "failed" in result:
        return ["", f"End to end: failed: {result['failed']}"]
    c = result["cache"]
    return [
        "",
        f"Same GPU, Qwen3-8B-shaped random target ({result['target_layers']} layers, features of layers "
        f"{result['target_layer_ids']}) and the drafter, one process, the trainer's TrainingWorkers:",
        "",
        "| part | median s |",
        "|---|---|",
        f"| target feature forward (bare) | {result['target_forward_s']:.4f} |",
        f"| drafter step (features resident) | {result['drafter_step_s']:.4f} |",
        f"| sum | {result['sum_s']:.4f} |",
        f"| end to end (target worker + drafter thread) | {result['e2e_step_s']:.4f} |",
        "",
        f"End to end vs the sum of its parts: {result['e2e_vs_sum']:.3f} (1.0 = no overhead; >1 = overlap); "
        f"peak memory {_fmt(result['peak_memory_gib'], '.1f')} GiB. Steps: {result['e2e_step_times_s']}.",
        "",
        f"cache-features at these dims: {c['sequences']} sequences x {c['tokens'] // c['sequences']} tokens "
        "in "
        f"batches of {c['batch']}: {c['write_cache_s']:.2f} s = {c['tokens_per_s']:.0f} tokens/s, against "
        f"{c['bare_forward_s']:.2f} s ({c['bare_tokens_per_s']:.0f} tokens/s) for the bare forward of the "
        "same "
        f"batches: {c['ratio']:.3f}x the bare forward time ({c['bytes'] / 2**30:.2f} GiB in {c['shards']} "
        f"shard(s), fsynced) in {c['dir_root']}.",
        *[
            f"The same on {root}: {o['write_cache_s']:.2f} s = {o['tokens_per_s']:.0f} tokens/s, "
            f"{o['ratio']:.3f}x the bare forward."
            for root, o in result.get("cache_on", {}).items()
        ],
    ]


def render_cache(result: dict) -> list[str]:
    if "failed" in result:
        return ["", f"Feature cache: failed: {result['failed']}"]
    runs = result["runs"]
    lines = _table_head(
        "Training steps through the trainer's pipeline (loader thread, queue depth 2, pinned memory). "
        "`disk`: the shards' page cache dropped (posix_fadvise) before the pass, so every batch is read from "
        "the disk; `page cache`: a second pass over the same shards:",
        ["features", "median step s", "first step s", "steps s"],
    )
    for name, r in runs.items():
        lines.append(f"| {name} | {r['median_step_s']:.4f} | {r['first_step_s']:.2f} | {r['step_times_s']} |")
    base = runs["drafter-only (features resident on the device)"]["median_step_s"]
    c = result["cache"]
    lines.append("")
    for name in ("feature cache (disk)", "feature cache (page cache)"):
        cache = runs[name]["median_step_s"]
        lines.append(
            f"Cache-backed step ({name}) vs drafter-only step: {cache / base:.3f}x "
            f"({100 * (cache / base - 1):+.1f} %)."
        )
    lines += [
        f"Each step reads {result['read_per_step_mib']:.1f} MiB of features.",
        f"Cache size: {result['cache_bytes_per_1k_tokens'] / 2**20:.2f} MiB per 1k tokens at these dims "
        f"(measured {result['measured_bytes_per_1k_tokens'] / 2**20:.2f} MiB incl. headers); "
        f"{c['sequences']} sequences, {c['tokens']} tokens, {c['bytes'] / 2**30:.2f} GiB in "
        f"{c['shards']} shard(s), written in {c['write_s']} s.",
    ]
    return lines


# ---- parent -------------------------------------------------------------------------------------


def run_child(args, what: str, extra: list[str], timeout: float) -> dict:
    scratch = tempfile.mkdtemp(prefix=f"throughput-{what}-")
    env = fresh_compile_env(scratch)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        what,
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--batch",
        str(args.batch),
        "--precision",
        args.precision,
        *(["--small"] if args.small else []),
        *extra,
    ]
    began = time.monotonic()
    proc = popen_text(cmd, env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {
            "failed": f"no result within {timeout:.0f} s (hang?)",
            "wall_s": round(time.monotonic() - began, 1),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
            result["wall_s"] = round(time.monotonic() - began, 1)
            return result
    tail = err.strip().splitlines()[-1] if err.strip() else f"rc {proc.returncode}"
    return {"failed": tail[:300], "stderr_tail": err[-3000:], "wall_s": round(time.monotonic() - began, 1)}


def summarise(run: dict, dims: dict, peak_tflops: float | None) -> dict:
    if "failed" in run:
        return {"failed": run["failed"]}
    flops = step_flops(dims, int(run["pairs_per_step"]))
    step = run["median_step_s"]
    achieved = flops["total"] / step / 1e12
    return {
        "median_step_s": step,
        "first_step_s": run["first_step_s"],
        "block_tokens_per_s": run["block_tokens_per_step"] / step,
        "context_tokens_per_s": run["context_tokens_per_step"] / step,
        "achieved_tflops": achieved,
        "mfu": achieved / peak_tflops if peak_tflops else None,
        "peak_memory_gib": run["peak_memory_gib"],
        "flops_per_step": flops,
        "compiles": len(run["compiles"]),
        "precision": run["precision"],
        "params": run["params"],
        "param_dtypes": run["param_dtypes"],
        # weights + AdamW exp_avg and exp_avg_sq: 12 B per parameter with fp32 masters (4 + 8)
        "master_and_adam_gib": (run["param_bytes"] + run["optimizer_state_bytes"]) / 2**30,
        "param_bytes": run["param_bytes"],
    }


def _table_head(caption: str, columns: list[str]) -> list[str]:
    """A blank line, `caption`, and the header and rule of a markdown table of `columns`."""
    return ["", caption, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render(report: dict) -> str:
    lines = [
        f"# Drafter training throughput — {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        "",
        "Dims: " + ", ".join(f"{k} {v}" for k, v in report["dims"].items()),
        "",
        f"Matmul peak (measured): {_fmt(report['peak'].get('tflops'), '.1f')} TFLOP/s "
        f"({report['peak'].get('dtype', '?')} {report['peak'].get('n', '?')}^3)",
        "",
        "| run | precision | median step s | first step s | block tok/s | context tok/s | TFLOP/s | MFU "
        "| peak mem GiB | weights+Adam GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["runs"].items():
        if "failed" in s:
            lines.append(f"| {name} | failed: {s['failed']} | | | | | | | | |")
            continue
        lines.append(
            f"| {name} | {s['precision']} | {s['median_step_s']:.4f} | {s['first_step_s']:.2f} "
            f"| {s['block_tokens_per_s']:.0f} | {s['context_tokens_per_s']:.0f} "
            f"| {s['achieved_tflops']:.2f} | "
            f"{_fmt(s['mfu'] and 100 * s['mfu'], '.1f')}% | {_fmt(s['peak_memory_gib'], '.1f')} "
            f"| {s['master_and_adam_gib']:.1f} |"
        )
    lines += _render_notes(report) + _render_first_step(report) + _render_checkpointing(report)
    for name, text in report.get("profiles", {}).items():
        lines += ["", f"Profile, {name} (top kernels, 3 steps):", "", "```", text, "```"]
    return "\n".join(lines) + "\n"


PARTS = ("compiled", "loss-kernel", "before", "eager", "first-step", "cache", "checkpointing", "e2e")
CHILDREN = {
    "peak": child_peak,
    "train": child_train,
    "first_step": child_first_step,
    "cache": child_cache,
    "e2e": child_e2e,
}


def _render_notes(report: dict) -> list[str]:
    """The speed-ups measured in this run, the drafter's size and its FLOPs per step."""
    lines: list[str] = []
    after, prior = report["runs"].get("compiled flex", {}), report["runs"].get(BEFORE, {})
    if "median_step_s" in after and "median_step_s" in prior:
        lines += [
            "",
            f"Compiled layers + compiled loss kernel vs before (same run): "
            f"{prior['median_step_s'] / after['median_step_s']:.3f}x faster per step "
            f"({prior['median_step_s']:.4f} -> {after['median_step_s']:.4f} s), peak memory "
            f"{_fmt(prior['peak_memory_gib'], '.1f')} -> {_fmt(after['peak_memory_gib'], '.1f')} GiB.",
        ]
    if report.get("speedup") is not None:
        note = f" ({report['speedup_note']})" if report.get("speedup_note") else ""
        lines += ["", f"Compiled vs eager flex_attention: {report['speedup']:.2f}x faster per step{note}."]
    some = next((s for s in report["runs"].values() if "flops_per_step" in s), None)
    if some:
        dtypes = ", ".join(some["param_dtypes"])
        lines += [
            "",
            f"Drafter parameters: {some['params']:,} ({dtypes}); {dtypes} weights + AdamW moments "
            f"= {some['master_and_adam_gib']:.2f} GiB "
            f"({(some['master_and_adam_gib'] * 2**30) / some['params']:.1f} bytes/parameter; "
            f"gradients add {some['param_bytes'] / 2**30:.2f} GiB).",
        ]
        parts = some["flops_per_step"]
        lines += [
            "",
            "Model FLOPs per step (fwd+bwd, GFLOP): "
            + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in parts.items()),
        ]
    return lines


def _render_first_step(report: dict) -> list[str]:
    """First-step latency per compile lock."""
    lines: list[str] = []
    if report.get("first_step"):
        lines += _table_head(
            "First-step latency per thread (from a common start; includes waiting for the lock):",
            ["compile lock", "per thread s", "all done s", "errors"],
        )
        for lock, r in report["first_step"].items():
            if "failed" in r:
                lines.append(f"| {lock} | failed: {r['failed']} | | |")
                continue
            errors = "; ".join(e["message"] for e in r["errors"]) or "none"
            lines.append(f"| {lock} | {json.dumps(r['latency_s'])} | {r['all_done_s']} | {errors} |")
    return lines


def _render_checkpointing(report: dict) -> list[str]:
    """Activation checkpointing against none, same settings."""
    lines: list[str] = []
    ckpt = report.get("checkpointing")
    if ckpt:
        lines += _table_head(
            "Activation checkpointing (every drafter layer recomputed in backward), same run settings:",
            ["train.activation_checkpointing", "median step s", "peak mem GiB"],
        )
        for name, s in ckpt["runs"].items():
            if "failed" in s:
                lines.append(f"| {name} | failed: {s['failed']} | |")
            else:
                lines.append(f"| {name} | {s['median_step_s']:.4f} | {_fmt(s['peak_memory_gib'], '.2f')} |")
        if ckpt.get("memory_saved_gib") is not None:
            lines += [
                "",
                f"Checkpointing saves {ckpt['memory_saved_gib']:.2f} GiB of peak memory "
                f"({ckpt['memory_saved_pct']:.0f}%) and costs {ckpt['step_time_cost_pct']:+.1f}% step time.",
            ]
        elif ckpt.get("step_time_cost_pct") is not None:
            lines += [
                "",
                f"Checkpointing costs {ckpt['step_time_cost_pct']:+.1f}% step time "
                "(no memory figure on CPU).",
            ]
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = doc_parser(__doc__)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", help="markdown results file (a .json copy is written next to it)")
    parser.add_argument("--small", action="store_true", help="tiny dims on CPU with sdpa (a smoke run)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (incl. the compile)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=3, help="drafter threads for the first-step timing")
    parser.add_argument("--profile", action="store_true", help="torch profiler table of the top kernels")
    parser.add_argument(
        "--parts",
        default="compiled,eager,first-step",
        help=f"comma list of {', '.join(PARTS)} (the matmul peak always runs)",
    )
    parser.add_argument(
        "--cache-dir",
        help="where the cache part writes its feature cache (default: $TMPDIR); e2e takes a comma list",
    )
    parser.add_argument("--shard-mb", type=int, default=1024, help="feature cache shard size cap, MiB")
    parser.add_argument("--anchors", type=int, help="override the anchors per sequence (paper: 512)")
    parser.add_argument("--ctx", type=int, help="override the context length (paper: 3072)")
    parser.add_argument("--child-timeout", type=float, default=420.0, help="seconds per training part")
    parser.add_argument(
        "--first-step-timeout",
        type=float,
        default=300.0,
        help="seconds per first-step part (lock 'none' may hang: that is the race)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-mixed", PURE_BF16),
        help="the trainer's train.precision (default: bf16-mixed on CUDA, fp32 on CPU); "
        f"{PURE_BF16}: the old bf16-weights baseline",
    )
    parser.add_argument(
        "--cache-sequences",
        type=int,
        default=30,
        help="sequences the e2e part writes with cache-features (paper dims: ~126 MB each)",
    )
    parser.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="flex", help=argparse.SUPPRESS)
    parser.add_argument(
        "--loop", choices=("bare", "workers", "ahead"), default="bare", help=argparse.SUPPRESS
    )
    parser.add_argument("--lock", default="lock", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--compile-layers", choices=("auto", "off"), default="auto", help=argparse.SUPPRESS)
    parser.add_argument(
        "--loss-kernel",
        choices=("auto", "eager", "compiled", "triton"),
        default="auto",
        help=argparse.SUPPRESS,
    )
    return parser


def _settings(parser: argparse.ArgumentParser, argv: list[str] | None):
    """(args, dims, parts) with the defaults that depend on the device filled in."""
    args = parser.parse_args(argv)
    if args.small:
        args.device = "cpu"
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device.startswith("cuda") else "fp32"
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step compiles)")
    dims = dict(SMALL if args.small else PAPER, batch=args.batch)
    for key in ("anchors", "ctx"):
        if getattr(args, key):
            dims[key] = getattr(args, key)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; use {', '.join(sorted(PARTS))}")
    return args, dims, parts


def say(text: str) -> None:
    print(text, flush=True)


class Trainings:
    """The training parts' runs, each in its own child process, with their profiles and raw results."""

    # "before": only flex_attention compiled, layers and the loss's chunks eager (the trainer's path
    # before its layers and loss kernel were compiled)
    BEFORE_OPTIONS = ["--compile-layers", "off", "--loss-kernel", "eager"]
    WANTED = {
        "sdpa": "compiled",
        TRAINER_SDPA: "compiled",
        "compiled flex": "compiled",
        TRAINER_FLEX: "compiled",
        TRAINER_AHEAD: "compiled",
        TRAINER_SDPA_AHEAD: "compiled",
        "eager flex": "eager",
        BEFORE: "before",
        COMPILED_CHUNK: "loss-kernel",
    }

    def __init__(self, args, dims: dict, peak: dict):
        self.args, self.dims, self.peak = args, dims, peak
        self.runs: dict = {}
        self.profiles: dict = {}
        self.raw: dict = {}
        # CPU refuses flex_attention backward: the smoke run trains through the dense-mask sdpa path.
        # name -> (attention, child options)
        self.variants = (
            {
                "sdpa": ("sdpa", []),
                TRAINER_SDPA: ("sdpa", ["--loop", "workers"]),
                TRAINER_SDPA_AHEAD: ("sdpa", ["--loop", "ahead"]),
            }
            if args.small
            else {
                "compiled flex": ("flex", []),
                TRAINER_FLEX: ("flex", ["--loop", "workers"]),
                TRAINER_AHEAD: ("flex", ["--loop", "ahead"]),
                BEFORE: ("flex", self.BEFORE_OPTIONS),
                COMPILED_CHUNK: ("flex", ["--loss-kernel", "compiled"]),
                "eager flex": (FLEX_EAGER, self.BEFORE_OPTIONS),
            }
        )

    def measure(
        self, name: str, attention: str, anchors: int, checkpointing: str = "none", options=()
    ) -> dict:
        extra = ["--attention", attention, "--anchors", str(anchors), "--ctx", str(self.dims["ctx"])]
        extra += ["--checkpointing", checkpointing, *options] + (["--profile"] if self.args.profile else [])
        result = run_child(self.args, "train", extra, self.args.child_timeout)
        summary = summarise(result, dict(self.dims, anchors=anchors), self.peak.get("tflops"))
        shown = {k: v for k, v in summary.items() if k != "flops_per_step"}
        say(f"  {name} ({anchors} anchors): {json.dumps(shown)}")
        if result.get("profile"):
            self.profiles[f"{name}, {anchors} anchors"] = result["profile"]
        self.raw[f"{name}, {anchors} anchors"] = result
        return summary

    def variants_wanted(self, parts: set) -> None:
        for name, (attention, options) in self.variants.items():
            if self.WANTED[name] in parts:
                self.runs[name] = self.measure(name, attention, self.dims["anchors"], options=options)

    def flex_speedup(self) -> tuple[float | None, str | None]:
        """Eager over compiled flex_attention step time. Eager flex materialises every score: at paper
        size it may not fit; then both are compared at the largest anchor count where eager fits."""
        if "compiled flex" not in self.runs or "eager flex" not in self.runs:
            return None, None
        anchors = self.dims["anchors"]
        compiled, eager = self.runs["compiled flex"], self.runs["eager flex"]
        while "failed" in eager and "OutOfMemory" in eager["failed"] and anchors > 64:
            anchors //= 2
            eager = self.runs[f"eager flex @{anchors} anchors"] = self.measure(
                "eager flex", FLEX_EAGER, anchors, options=self.BEFORE_OPTIONS
            )
            if "failed" not in eager:
                compiled = self.runs[f"compiled flex @{anchors} anchors"] = self.measure(
                    "compiled flex", "flex", anchors
                )
        if "median_step_s" not in compiled or "median_step_s" not in eager:
            return None, None
        note = None
        if anchors != self.dims["anchors"]:
            note = f"measured at {anchors} anchors: eager flex runs out of memory at {self.dims['anchors']}"
        return eager["median_step_s"] / compiled["median_step_s"], note

    def checkpointing(self) -> dict:
        """Step time and peak memory with the drafter's layers checkpointed, against without."""
        name, (attention, _) = next(iter(self.variants.items()))
        runs = {
            "none": self.runs.get(name) or self.measure(name, attention, self.dims["anchors"]),
            "layers": self.measure(f"{name}, checkpointed layers", attention, self.dims["anchors"], "layers"),
        }
        result: dict = {"runs": runs}
        off, on = runs["none"], runs["layers"]
        if "median_step_s" in off and "median_step_s" in on:
            result["step_time_cost_pct"] = 100 * (on["median_step_s"] / off["median_step_s"] - 1)
            if off["peak_memory_gib"] and on["peak_memory_gib"] is not None:
                saved = off["peak_memory_gib"] - on["peak_memory_gib"]
                result["memory_saved_gib"] = saved
                result["memory_saved_pct"] = 100 * saved / off["peak_memory_gib"]
        return result

    def one_setup(self) -> list[str]:
        """The first variant's attention and the block shape, for the children that measure one setup."""
        attention = next(iter(self.variants.values()))[0]
        return [
            "--attention",
            attention,
            "--anchors",
            str(self.dims["anchors"]),
            "--ctx",
            str(self.dims["ctx"]),
        ]


def _other_parts(args, parts: set, one_setup: list[str]) -> tuple[dict, dict | None, dict | None]:
    """(first step per lock, feature cache, end to end) for the parts asked for."""
    first_step = {}
    if "first-step" in parts:
        for lock in ("lock", "none"):
            first_step[lock] = run_child(
                args, "first_step", ["--lock", lock, *one_setup], args.first_step_timeout
            )
            say(f"  first step, lock {lock}: {first_step[lock]}")
    cache_dir = ["--cache-dir", args.cache_dir] if args.cache_dir else []
    results: dict = {"cache": None, "e2e": None}
    for part, extra in (
        ("cache", ["--shard-mb", str(args.shard_mb)]),
        ("e2e", ["--cache-sequences", str(args.cache_sequences)]),
    ):
        if part in parts:
            results[part] = run_child(args, part, [*one_setup, *extra, *cache_dir], args.child_timeout)
            shown = {k: v for k, v in results[part].items() if k != "stderr_tail"}
            say(f"  {'feature cache' if part == 'cache' else part}: {json.dumps(shown)}")
    return first_step, results["cache"], results["e2e"]


def _write(report: dict, out: str | None) -> None:
    text = render(report)
    if report["cache"] is not None:
        text += "\n".join(render_cache(report["cache"])) + "\n"
    if report["e2e"] is not None:
        text += "\n".join(render_e2e(report["e2e"])) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text)
        with open(os.path.splitext(out)[0] + ".json", "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        say(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args, dims, parts = _settings(_parser(), argv)
    if args.child:
        import torch

        torch.manual_seed(0)
        print(RESULT_TAG + json.dumps(CHILDREN[args.child](args, dims)), flush=True)
        return 0

    command = shlex.join(["benchmarks/train_throughput.py", *(sys.argv[1:] if argv is None else argv)])
    say(f"throughput: dims {dims} on {args.device}, parts {sorted(parts)}")
    peak = run_child(args, "peak", [], args.child_timeout)
    say(f"  peak matmul: {peak}")
    trainings = Trainings(args, dims, peak)
    trainings.variants_wanted(parts)
    speedup, speedup_note = trainings.flex_speedup()
    checkpointing = trainings.checkpointing() if "checkpointing" in parts else {}
    first_step, cache, e2e = _other_parts(args, parts, trainings.one_setup())
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "versions": versions(args.device),
        "dims": dims,
        "peak": peak,
        "runs": trainings.runs,
        "speedup": speedup,
        "speedup_note": speedup_note,
        "first_step": first_step,
        "checkpointing": checkpointing,
        "profiles": trainings.profiles,
        "raw": trainings.raw,
        "cache": cache,
        "e2e": e2e,
    }
    _write(report, args.out)
    # The eager run may legitimately not fit (reported above); the compiled run and the peak must work.
    failed = [n for n in ("compiled flex", "sdpa") if "failed" in trainings.runs.get(n, {})]
    failed += [f"checkpointing {k}" for k, r in checkpointing.get("runs", {}).items() if "failed" in r]
    failed += [part for part, r in (("cache", cache), ("e2e", e2e)) if r is not None and "failed" in r]
    return 1 if failed or "failed" in peak else 0


if __name__ == "__main__":
    sys.exit(main())
