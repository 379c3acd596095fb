"""The seeds' job at its real size on ONE GPU: a Qwen3.6-27B-shaped hybrid target and, to tell hybrid
effects from size effects, a Qwen3-32B-shaped dense one. Random weights, no downloads.

    python benchmarks/seed_scale.py --device cuda:0 --out $OUT/seed-scale.md       # one H200, ~5 min
    python benchmarks/seed_scale.py --tiny --out /tmp/seed-scale.md                # CPU, tiny dims, ~1 min

The targets are the trainer's own tiny specs (`tiny-random-hybrid` / `tiny-random`) with the published
dims as `target.tiny` overrides: built directly on the GPU in bf16 (trainer.data.target.tiny_target),
never a host fp32 copy nor weights on disk. Dims used (Qwen3.6-27B model card + config.json:
`Qwen3_5ForConditionalGeneration`, text_config `qwen3_5_text`): hidden 5120, 64 layers as 16 x (3
Gated DeltaNet + 1 gated full attention), attention 24 heads / 4 KV heads, head_dim 256, partial
rotary 0.25 (64 rotary dims), rope_theta 1e7; Gated DeltaNet 16 QK heads, 48 V heads, head dim 128,
conv kernel 4; intermediate 17408; vocab 248320, untied lm_head. Qwen3-32B: hidden 5120, 64 layers,
64 heads / 8 KV heads, head_dim 128, intermediate 25600, vocab 151936, rope_theta 1e6, untied.

Per shape, two child processes, each under `timeout -k` (results kept part by part):
1. `target` (one process, the target loaded once): build (load time, parameters, memory, a forward
   checked for NaN/inf at every layer, the Gated DeltaNet path, the feature forward time), the bf16
   matmul peak (MFU denominator), cache-features (trainer.data.cache_writer.write_cache), decode
   (trainer.infer.static_decode.StaticDecoder: target-only ms/token, speculative round time; when it
   raises Unsupported, trainer.infer.speculative's reference loop, marked), then `data regenerate`
   (trainer.data.regenerate.regenerate, its batch sized from the free memory; it loads its own copy).
2. `train`: the real trainer (`python -m trainer`), the target and one drafter on the same GPU, a
   drafter of the dims DrafterConfig.for_target gives (5 layers), bf16-mixed (fp32 masters + AdamW),
   compiled flex attention; first and steady step time from its metrics file.

FLOPs per training step (counted, not measured; elementwise work left out):
- target forward, tokens T = batch x seq_len, over the layers the feature forward runs (up to the
  last feature layer): 2 x (their parameters) x T for the linear layers; each full-attention layer
  + 2 x 2 x heads x head_dim x T^2 / 2 (causal QK^T and PV); each Gated DeltaNet layer
  + 6 x v_heads x key_dim x value_dim x T (state decay/update, delta correction, readout);
- drafter: benchmarks/train_throughput.py step_flops (linear layers, masked attention pairs counted
  from the trainer's own anchor sampler, fc, frozen lm_head; backward 2x / 1x as written there).
MFU = (target + drafter FLOPs) / steady step time / measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.common import doc_parser, popen_text, sync, time_cache_write, under_timeout, versions  # noqa: E402
from benchmarks.seed_scale_report import render  # noqa: E402

RESULT_TAG = "SEED_RESULT "
STACKS_EVERY_S = 45  # a stuck part shows where it is
QWEN36_27B = {
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
QWEN3_32B = {
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SHAPES = {
    "qwen3.6-27b": {"spec": "tiny-random-hybrid", "tiny": QWEN36_27B},
    "qwen3-32b": {"spec": "tiny-random", "tiny": QWEN3_32B},
}
TINY_SHAPES = {
    "qwen3.6-27b": {"spec": "tiny-random-hybrid", "tiny": {}},
    "qwen3-32b": {"spec": "tiny-random", "tiny": {}},
}
# What each run measures at: the real job's sequence and anchors on the GPU, toy numbers on the CPU.
SIZES = {
    "gpu": {
        "seq_len": 3072,
        "anchors": 512,
        "steps": 14,
        "warmup": 6,  # past the loader's queue of features computed while step 1 compiled
        "cache_sequences": 16,
        "regen_records": 256,
        "regen_small_batch": 16,
        "regen_prompt": 256,
        "regen_new": 64,
        "decode_prompt": 512,
        "decode_new": 64,
        "drafter_layers": 5,
        "block": 16,
    },
    "tiny": {
        "seq_len": 64,
        "anchors": 8,
        "steps": 4,
        "warmup": 1,
        "cache_sequences": 4,
        "regen_records": 4,
        "regen_small_batch": 2,
        "regen_prompt": 16,
        "regen_new": 8,
        "decode_prompt": 16,
        "decode_new": 16,
        "drafter_layers": 1,
        "block": 8,
    },
}
PARTS = ("build", "cache", "decode", "regenerate", "train", "offline")
# seconds each child may take (timeout -k): first load + compile dominate on the GPU
TIMEOUTS = {
    "gpu": {"target": 330, "train": 240, "regenerate": 180},
    "tiny": {"target": 150, "train": 150, "regenerate": 150},
}


def shape_of(args) -> dict:
    return (TINY_SHAPES if args.tiny else SHAPES)[args.shape]


def sizes(args) -> dict:
    return SIZES["tiny" if args.tiny else "gpu"]


def say(text: str) -> None:
    print(f"[seed-scale {time.strftime('%H:%M:%S')}] {text}", flush=True)


def emit(part: str, result: dict) -> None:
    print(RESULT_TAG + json.dumps({"part": part, **result}, default=float), flush=True)


# ---- the training config and data, shared by the train child and cache-features ----------------------


def write_job(args, work: str, features: str | None = None) -> str:
    """A pre-tokenized JSONL of random sequences and the training config over it (or, given
    `features`, over that feature cache: offline training); the config's path."""
    import random

    import yaml

    size, shape = sizes(args), shape_of(args)
    vocab = (shape["tiny"] or {}).get("vocab_size", 512)
    rng = random.Random(0)
    data = os.path.join(work, "train.jsonl")
    length = size["seq_len"]
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(max(size["steps"] + 2, size["cache_sequences"])):
            ids = [rng.randrange(vocab - 1) for _ in range(length)]
            f.write(
                json.dumps(
                    {"input_ids": ids, "loss_mask": [0] * (length // 4) + [1] * (length - length // 4)}
                )
            )
            f.write("\n")
    cuda = args.device.startswith("cuda")
    config = {
        "target": {"spec": shape["spec"], "tiny": shape["tiny"]},
        "drafter": {"num_layers": size["drafter_layers"], "block_size": size["block"]},
        "data": {"source": "jsonl", "path": data, "seq_len": length, "eval_fraction": 0.0}
        if features is None
        else {"source": "features", "path": features, "seq_len": length, "eval_fraction": 0.0},
        "train": {
            "batch_size": 1,
            "num_anchors": size["anchors"],
            "max_steps": size["steps"],
            "activation_checkpointing": args.checkpointing,
            "precision": "bf16-mixed" if cuda else "fp32",
        },
        "run": {
            "target_devices": [args.device],
            "drafter_devices": [args.device],
            "log_every": 1,
            "attention": "flex" if cuda else "sdpa",
            "checkpoint_every": 10**6,
            "torch_threads": 0 if cuda else 1,
        },
        "eval": {"every": 0},
    }
    path = os.path.join(work, "seed-scale.yaml" if features is None else "seed-scale-offline.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path


# ---- the target child: build, peak, cache-features, decode, regenerate ----------------------------


def part_build(args, cfg) -> tuple[dict, object]:
    """Load the target as the trainer does; its size, memory, NaN/inf check and feature forward time."""
    import torch

    from trainer import gdn_kernels
    from trainer.data.target import load_target
    from trainer.train.loop import drafter_config, param_dtype

    began = time.perf_counter()
    target = load_target(cfg.target.spec, args.device, param_dtype(args.device), tiny=cfg.target.tiny or None)
    sync(args.device)
    load_s = time.perf_counter() - began
    model: Any = target.model  # the HF causal LM (its accessors are not in nn.Module's type)
    length = sizes(args)["seq_len"]
    ids = torch.randint(0, target.vocab_size - 1, (1, length), device=args.device)
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
    bad = [i for i, h in enumerate(hidden) if not torch.isfinite(h).all()]
    forward = _timed(args.device, lambda: target.features(ids, attention_mask=torch.ones_like(ids)), 3)
    last = max(target.layer_ids)
    layers = model.get_decoder().layers
    result = {
        "load_s": load_s,
        "params": sum(p.numel() for p in model.parameters()),
        "params_run": sum(p.numel() for layer in layers[: last + 1] for p in layer.parameters()),
        "layers_run": last + 1,
        "layer_ids": list(target.layer_ids),
        "memory_gib": _memory_gib(args.device),
        "nonfinite_layers": bad,
        "max_abs_hidden": float(max(h.float().abs().max() for h in hidden)),
        "gated_deltanet": gdn_kernels.gated_deltanet_path(model),
        "feature_forward_s": forward,
        "feature_tokens_per_s": length / forward,
        "config": _flop_dims(target.config, last + 1),
        "drafter": drafter_config(cfg, target).to_dict(),  # what the trainer builds for this target
    }
    return result, target


def _flop_dims(config, layers_run: int) -> dict:
    """What the FLOP formulas read from the target's config, for the layers the feature forward runs."""
    types = (getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)[
        :layers_run
    ]
    linear = sum(1 for t in types if t == "linear_attention")
    return {
        "full_layers": layers_run - linear,
        "linear_layers": linear,
        "heads": config.num_attention_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "gdn_state": getattr(config, "linear_num_value_heads", 0)
        * getattr(config, "linear_key_head_dim", 0)
        * getattr(config, "linear_value_head_dim", 0),
    }


def _timed(device: str, fn, repeats: int) -> float:
    """Median seconds of `fn` after one warm-up call."""
    import statistics

    import torch

    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            sync(device)
            began = time.perf_counter()
            fn()
            sync(device)
            if i:
                times.append(time.perf_counter() - began)
    return statistics.median(times)


def _memory_gib(device: str) -> dict | None:
    import torch

    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return {
        "allocated": torch.cuda.memory_allocated(device) / 2**30,
        "peak": torch.cuda.max_memory_allocated(device) / 2**30,
        "free": free / 2**30,
        "total": total / 2**30,
    }


def part_cache(args, cfg, target) -> dict:
    """cache-features over the config's data (the trainer's writer, fsynced shards) against the bare
    feature forward of the same batches, after a warm-up forward at that batch shape. The cache is
    kept in `cache_dir(args)` for the offline part."""
    from trainer.data.feature_cache import cache_header
    from trainer.train.loop import build_dataset

    dataset = build_dataset(cfg, target)
    work = cache_dir(args)
    timed = time_cache_write(target, dataset, work, cache_header(cfg, target, "bf16", 0), args.device)
    seconds, bare = timed["write_cache_s"], timed["bare_forward_s"]
    tokens = int(dataset.attention_mask.sum())
    return {
        "sequences": len(dataset),
        "batch": timed["batch"],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "bare_forward_s": bare,
        "vs_bare_forward": seconds / bare,
        "bytes": timed["manifest"]["counts"]["bytes"],
        "dir": work,
    }


def cache_dir(args) -> str:
    return os.path.join(args.work, "features")


def part_decode(args, cfg, target) -> dict:
    """Target-only ms/token and the speculative round time, a random drafter of the trainer's dims."""
    import torch

    from trainer.infer import speculative, static_decode
    from trainer.model import DFlashDrafter
    from trainer.train.loop import drafter_config

    size = sizes(args)
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(cfg, target), target.embed_tokens, target.lm_head)
    drafter = drafter.to(device=args.device, dtype=target.dtype).eval()
    prompt = torch.randint(0, target.vocab_size - 1, (size["decode_prompt"],)).tolist()
    new = size["decode_new"]
    try:
        decoder = static_decode.StaticDecoder(
            target.model, target.layer_ids, drafter, rows=1, max_prompt=len(prompt), max_new_tokens=new,
            compile=str(args.device).startswith("cuda"),  # as `dflash-train eval` decodes on a GPU
        )  # fmt: skip
        decoder.prepare([prompt])
        plain = decoder.decode([prompt], new, speculative=False)
        spec = decoder.decode([prompt], new, speculative=True)
        loop = "static (StaticDecoder" + (", compiled)" if decoder.kernels.compiled else ")")
        same = referee(decoder, prompt, plain.results[0].tokens, spec.results[0].tokens)
        plain_s, plain_tokens = plain.seconds, len(plain.results[0].tokens)
        spec_s, rounds, spec_tokens = spec.seconds, len(spec.results[0].accepted), len(spec.results[0].tokens)
    except (static_decode.Unsupported, AttributeError) as why:  # AttributeError: a loop not yet hybrid-aware
        loop = f"reference (trainer.infer.speculative; StaticDecoder: {type(why).__name__}: {why})"
        speculative.target_generate(target.model, prompt, 4)  # warm-up
        one = speculative.target_generate(target.model, prompt, new)
        two = speculative.speculative_generate(target.model, target.layer_ids, drafter, prompt, new)
        plain_s, plain_tokens = one.seconds, len(one.tokens)
        spec_s, rounds, spec_tokens = two.seconds, len(two.accepted), len(two.tokens)
        same = "equal" if two.tokens == one.tokens else "differ (reference loop: not refereed)"
    step_ms = 1000 * plain_s / max(plain_tokens, 1)
    round_ms = 1000 * spec_s / max(rounds, 1)
    return {
        "loop": loop,
        "target_ms_per_token": step_ms,
        "round_ms": round_ms,
        "round_vs_step": round_ms / step_ms,
        "rounds": rounds,
        "speculative_tokens": spec_tokens,
        "same_tokens": same,  # speculative vs target-only: equal, or the first difference refereed
        "block": drafter.cfg.block_size,
        "prompt": len(prompt),
        "new_tokens": new,
    }


def referee(decoder, prompt: list[int], own: list[int], drafted: list[int]) -> str:
    """ "equal", or the first difference judged by the lossless referee (the target in fp32 at that
    position: a tie of the working dtype, or a bug)."""
    from trainer.infer.lossless import judge

    if own == drafted:
        return "equal"
    ended = [-1]  # an output that ended where the other did not
    at = next(i for i, (a, b) in enumerate(zip(own + ended, drafted + ended, strict=False)) if a != b)
    expected, got = (own + ended)[at], (drafted + ended)[at]
    verdict = judge(decoder.target, prompt + own[:at], expected, got)
    kind = "a bf16 tie" if verdict.tie else "NOT a tie (a bug)"
    return (
        f"differ at new token {at}: {kind} (fp32 logits {verdict.expected_logit:.4f} vs "
        f"{verdict.got_logit:.4f}, fp32 top {verdict.top} at {verdict.top_logit:.4f}, "
        f"bound {verdict.bound:.4f})"
    )


def part_regenerate(args, cfg) -> dict:
    """`data regenerate` (its own target copy): first a fixed small batch, then its batch from the free
    memory; new tokens/s of each. Where the stacks go every STACKS_EVERY_S (env SEED_STACKS): a file."""
    stacks = os.environ.get("SEED_STACKS")
    with open(stacks or os.devnull, "a", encoding="utf-8") as dump:
        if stacks:
            import faulthandler

            faulthandler.dump_traceback_later(STACKS_EVERY_S, repeat=True, file=dump)
        try:
            size = sizes(args)
            small = _regenerate(
                args, cfg, records=2 * size["regen_small_batch"], batch_size=size["regen_small_batch"]
            )
            say(
                f"{args.shape}: regenerate at batch {small['batch']}: "
                f"{small['new_tokens_per_s']:,.0f} new tokens/s"
            )
            return {
                "small_batch": small,
                **_regenerate(args, cfg, records=size["regen_records"], batch_size=None),
            }
        finally:
            if stacks:
                faulthandler.cancel_dump_traceback_later()


def _regenerate(args, cfg, records: int, batch_size: int | None) -> dict:
    from trainer.data.regenerate import RegenerateOptions, regenerate

    size = sizes(args)
    work = tempfile.mkdtemp(prefix="seed-regen-", dir=args.work)
    src = os.path.join(work, "chats.jsonl")
    words = " ".join(["word"] * (size["regen_prompt"] // 5))  # the byte tokenizer: ~1 token per byte
    with open(src, "w", encoding="utf-8") as f:
        for i in range(records):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i} {words}"}]}) + "\n")
    opts = RegenerateOptions(
        target=cfg.target.spec,
        input=src,
        output=os.path.join(work, "out.jsonl"),
        max_new_tokens=size["regen_new"],
        devices=[args.device],
        tiny=dict(cfg.target.tiny or {}),
        batch_size=batch_size,
        progress_every_s=15.0,
    )
    try:
        summary = regenerate(opts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("records", "new_tokens", "truncated", "seconds", "new_tokens_per_s", "batch", "batch_rule")
    return {k: summary[k] for k in keys}


def child_target(args) -> None:
    """The target child: each part's result is printed as soon as it is done."""
    import gc

    import torch

    from benchmarks.train_throughput import child_peak
    from trainer.config import load_config

    cfg = load_config(write_job(args, args.work))
    wanted = set(args.parts.split(","))
    if "build" in wanted:
        say(f"{args.shape}: building the target on {args.device}")
        built, target = part_build(args, cfg)
        emit("build", built)
        say(f"{args.shape}: built in {built['load_s']:.1f} s, non-finite layers {built['nonfinite_layers']}")
        emit("peak", child_peak(args, {}))
        for name, part in (("cache", part_cache), ("decode", part_decode)):
            if name in wanted:
                say(f"{args.shape}: {name}")
                emit(name, _guarded(lambda part=part, target=target: part(args, cfg, target)))
        del target
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "regenerate" in wanted:
        say(f"{args.shape}: regenerate")
        emit("regenerate", _guarded(lambda: part_regenerate(args, cfg)))


def _guarded(fn) -> dict:
    """A part's result, or what it failed with (one line): one part's failure leaves the others."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}


# ---- the train child: the real trainer ---------------------------------------------------------------


def run_train(args, work: str, features: str | None = None) -> dict:
    """`python -m trainer` on the shape's config under timeout -k; step times from its metrics file.
    Given `features` (a feature cache dir), the drafter trains from it alone (offline)."""
    config = write_job(args, work, features)
    run_dir = os.path.join(work, "run" if features is None else "run-offline")
    cmd = [sys.executable, "-m", "trainer", "--config", config, "--output-dir", run_dir]
    launched = time.time()
    code, tail, _ = _run_under_timeout(cmd, TIMEOUTS["tiny" if args.tiny else "gpu"]["train"], "train")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    from trainer import metrics_format

    records = (
        metrics_format.parse_lines(open(metrics, encoding="utf-8").read()) if os.path.exists(metrics) else []
    )
    result = train_numbers(records, launched, sizes(args))
    result.update(rc=code, activation_checkpointing=args.checkpointing)
    if code != 0:
        error = metrics_format.last_of(records, "error")
        result["failed"] = (error or {}).get("message", "").splitlines()[0][:300] if error else tail[-300:]
    return result


def train_numbers(records: list[dict], launched: float, size: dict) -> dict:
    """First and steady step time, tokens/s and memory from the trainer's metrics records."""
    import statistics

    start = next((r for r in records if r["event"] == "start"), None)
    steps = [r for r in records if r["event"] == "step"]
    if start is None or len(steps) < 2:
        return {"steps": len(steps)}
    times = [start["time"]] + [r["time"] for r in steps]
    intervals = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    steady = statistics.median(intervals[size["warmup"] - 1 :] or intervals)
    later = steps[size["warmup"] :] or steps
    return {
        "steps": len(steps),
        "startup_s": start["time"] - launched,  # process start to the start record: target + data + drafter
        "first_step_s": steps[0]["time"] - start["time"],
        "steady_step_s": steady,
        "context_tokens_per_s": size["seq_len"] / steady,
        "block_tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
        "peak_memory_gib": max((r.get("gpu_memory_gib") or 0.0) for r in steps) or None,
        "gated_deltanet": start.get("gated_deltanet"),
    }


def _run_under_timeout(cmd: list[str], seconds: int, label: str) -> tuple[int, str, list[dict]]:
    """Run under `timeout -k 10`, its output passed through with a prefix; (exit code, output tail,
    the results it printed)."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([p for p in [os.environ.get("PYTHONPATH"), REPO] if p]),
    )
    proc = popen_text(under_timeout(cmd, seconds), env, stderr=subprocess.STDOUT)
    tail: list[str] = []
    results = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(RESULT_TAG):
            results.append(json.loads(line[len(RESULT_TAG) :]))
            continue
        tail = (tail + [line])[-40:]
        if not line.startswith("  "):
            print(f"  {label}| {line.rstrip()[:240]}", flush=True)
    code = proc.wait()
    if code in (124, 137):
        tail.append(f"no result within {seconds} s (timeout)")
    return code, "".join(tail), results


# ---- the parent: one shape after another, the report rewritten after each ---------------------------


def run_target(args, work: str, parts: list[str], seconds: int) -> dict:
    """The target child for `parts` under timeout -k: {part: result}; a part it did not reach says why."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "target",
        "--shape",
        args.shape,
        "--device",
        args.device,
        "--work",
        work,
        "--parts",
        ",".join(parts),
        "--checkpointing",
        args.checkpointing,
        *(["--tiny"] if args.tiny else []),
    ]
    code, tail, results = _run_under_timeout(cmd, seconds, "target")
    found = {r.pop("part"): r for r in results}
    last_line = tail.strip().splitlines()[-1][:300] if tail.strip() else f"rc {code}"
    for part in parts:
        if part not in found:
            found[part] = {"failed": f"not reached (rc {code}): {last_line}"}
    return found


def step_flops(build: dict, train: dict, size: dict) -> dict:
    """Model FLOPs of one training step: the target's feature forward + the drafter (see the docstring)."""
    import torch

    from benchmarks.train_throughput import step_flops as drafter_flops
    from benchmarks.train_throughput import visible_pairs
    from trainer.masks import sample_anchors

    t, c = size["seq_len"], build["config"]
    target = (
        2 * build["params_run"] * t
        + c["full_layers"] * 2 * 2 * c["heads"] * c["head_dim"] * t * t // 2
        + c["linear_layers"] * 6 * c["gdn_state"] * t
    )
    d = build["drafter"]
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[:, t // 4 :] = True  # write_job's loss mask
    anchors, valid = sample_anchors(mask, size["anchors"], d["block_size"], torch.Generator().manual_seed(0))
    dims = {
        "batch": 1,
        "hidden": build["hidden"],
        "intermediate": d["intermediate_size"],
        "heads": d["num_heads"],
        "kv_heads": d["num_kv_heads"],
        "head_dim": d["head_dim"],
        "layers": d["num_layers"],
        "block": d["block_size"],
        "anchors": int(valid.sum()),
        "ctx": t,
        "vocab": build["vocab"],
        "target_layers": len(build["layer_ids"]),
    }
    drafter = drafter_flops(dims, visible_pairs(anchors, valid, d["block_size"]))["total"]
    return {"target": target, "drafter": drafter, "total": target + drafter}


def measure_shape(args, report: dict) -> None:
    """Both children of one shape; the shape's results go into `report`."""
    work = tempfile.mkdtemp(prefix=f"seed-scale-{args.shape}-", dir=args.work)
    wanted, limits = args.parts.split(","), TIMEOUTS["tiny" if args.tiny else "gpu"]
    shape = report["shapes"][args.shape] = {}  # the report is rewritten after each child
    try:
        say(f"{args.shape}: target child ({args.parts})")
        parts = ["build"] + [p for p in ("cache", "decode") if p in wanted]
        shape.update(run_target(args, work, parts, limits["target"]))
        write_report(args, report)
        if "train" in wanted:
            say(f"{args.shape}: train child (python -m trainer)")
            shape["train"] = run_train(args, work)
        if "offline" in args.parts.split(","):
            say(f"{args.shape}: offline train child (python -m trainer, data.source features)")
            cache = shape.get("cache", {}).get("dir")
            shape["offline"] = run_train(args, work, cache) if cache else {"failed": "no feature cache"}
            write_report(args, report)
        if "regenerate" in wanted:  # last: it loads its own target copy and may take longest
            say(f"{args.shape}: regenerate child")
            shape.update(run_target(args, work, ["regenerate"], limits["regenerate"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    add_flops(args, shape)


def add_flops(args, shape: dict) -> None:
    """Model FLOPs, TFLOP/s and MFU of each training run of `shape`; offline runs count only the drafter
    (the target's forward was paid once, by cache-features)."""
    build, peak = shape.get("build", {}), shape.get("peak", {})
    for name in ("train", "offline"):
        train = shape.get(name, {})
        if "params_run" not in build or "steady_step_s" not in train:
            continue
        flops = step_flops(dict(build, **_vocab_hidden(args)), train, sizes(args))
        if name == "offline":
            flops = dict(flops, target=0, total=flops["drafter"])
        train["flops"] = flops
        train["tflops"] = flops["total"] / train["steady_step_s"] / 1e12
        if peak.get("tflops"):
            train["mfu"] = train["tflops"] / peak["tflops"]


def _vocab_hidden(args) -> dict:
    from trainer.data.target import TINY_DEFAULTS

    tiny = shape_of(args)["tiny"] or {}
    return {
        "vocab": tiny.get("vocab_size", TINY_DEFAULTS["vocab_size"]),
        "hidden": tiny.get("hidden_size", TINY_DEFAULTS["hidden_size"]),
    }


def write_report(args, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(render(report))
    with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=float)


def parse_args(argv: list[str] | None):
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (the whole script, ~1 min)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument(
        "--checkpointing",
        default="none",
        choices=("none", "layers"),
        help="train.activation_checkpointing of the train part",
    )
    p.add_argument("--label", default="", help="a word for the report's title, e.g. no-fla")
    p.add_argument("--out", default="seed-scale.md", help="markdown report; a .json copy beside it")
    p.add_argument("--work", default=None, help="scratch directory (default: the system temp dir)")
    p.add_argument("--child", choices=("target",), help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny and args.device.startswith("cuda"):
        args.device = "cpu"
    bad = [s for s in args.shapes.split(",") if s not in SHAPES] + [
        x for x in args.parts.split(",") if x not in PARTS
    ]
    if bad:
        p.error(
            f"--shapes/--parts: unknown {', '.join(bad)}. Fix: shapes of {', '.join(SHAPES)}, "
            f"parts of {', '.join(PARTS)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "target":
        child_target(args)
        return 0
    report = {
        "args": vars(args),
        "versions": versions(args.device),
        "sizes": sizes(args),
        "shapes": {},
        "dims": {name: shape["tiny"] for name, shape in (TINY_SHAPES if args.tiny else SHAPES).items()},
    }
    report["versions"]["transformers"] = _version("transformers")
    report["versions"]["flash-linear-attention"] = _version("flash-linear-attention")
    began = time.monotonic()
    for name in args.shapes.split(","):
        args.shape = name
        measure_shape(args, report)
        report["wall_s"] = time.monotonic() - began
        write_report(args, report)
        say(f"{name}: done, report -> {args.out}")
    print(render(report), flush=True)
    return 0


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
