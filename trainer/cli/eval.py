"""`dflash-train eval`: acceptance length tau of a trained drafter, by real speculative decoding.

Exit codes: 0 done; 1 the speculative output differed from the target's greedy output (a bug:
the first differing prompt and position are printed); 2 bad input (checkpoint, target, prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from trainer.config import DEVICE_RE, ConfigError, in_one_line
from trainer.cli.errors import run_command
from trainer.cli import options

EVAL_HELP = """\
Measure a drafter by real DFlash speculative decoding against its target: tau (tokens accepted
per target forward, bonus included; pooled over all rounds and as the mean of per-prompt means,
with the per-prompt min/median/max), acceptance per block position, tokens/s of target-only vs
speculative decoding on the same static, graph-captured loop, and the lossless check
(temperature 0: both outputs equal; a difference is a tie only if the target's fp32 logits there
are within the working dtype's rounding).

  dflash-train eval --checkpoint runs/tiny                  (latest checkpoint, held-out prompts)
  dflash-train eval --checkpoint drafter/ --target /models/Qwen3-8B --prompts prompts.jsonl --json
"""


def eval_parser() -> argparse.ArgumentParser:
    p = options.command_parser("dflash-train eval", EVAL_HELP, argparse.ArgumentParser)
    options.add_checkpoint(
        p, "a run's output dir (its latest checkpoint), a checkpoints/step-NNNNNNN dir, or an export dir"
    )
    options.add_target(p, "tiny-random or a local HF model dir (default: the run's own)")
    p.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='{"messages": [...]} or {"input_ids": [...]} per line (default: the run\'s held-out data)',
    )
    p.add_argument("--num-prompts", type=int, default=8, metavar="N")
    options.add_max_new_tokens(p, 64)
    options.add_temperature(p)
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:0 if present, else cpu)")
    options.add_sampling_seed(p)
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="N",
        help="prompts decoded together (tokens/s then counts all of them; default 1)",
    )
    p.add_argument(
        "--loop",
        choices=("static", "reference"),
        default="static",
        help="static: pre-allocated caches + CUDA graphs (default); reference: the HF-eager loop",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the static loop's per-layer math (default: on with CUDA)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="apply_chat_template arguments for --prompts messages (default: what the drafter's "
        "training data was rendered with; another value is used, with a warning)",
    )
    p.add_argument(
        "--why",
        action="store_true",
        help="tau on the run's held-in records, on --prompts (held out) and the tau training accuracy "
        "predicts, and the likely cause of a gap (needs a run dir or checkpoint)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return p


def _is_export(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("architectures") == ["DFlashDraftModel"]


def load_drafter_source(checkpoint: str):
    """(DrafterConfig, weights, run config dict or None, description) from any of the three dirs."""
    from safetensors.torch import load_file

    from trainer.train.checkpoint import drafter_config_of, load_checkpoint, resolve_export_source
    from trainer.infer.export import WEIGHTS_FILE, drafter_config_from_export

    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(
            f"--checkpoint {checkpoint}: no such directory. Fix: pass a run dir, a "
            f"checkpoints/step-NNNNNNN dir or an export dir."
        )
    if _is_export(path):
        try:
            dcfg, weights = drafter_config_from_export(path), load_file(str(path / WEIGHTS_FILE))
        except Exception as exc:  # a key missing or mistyped, the weights damaged: one line, not a traceback
            raise ConfigError(
                f"--checkpoint {path}: a damaged export ({in_one_line(exc)}). "
                f"Fix: export it again (dflash-train export --checkpoint RUN_DIR --out {path})"
            ) from exc
        return dcfg, weights, None, f"export {path}"
    state = load_checkpoint(resolve_export_source(checkpoint))  # its messages name --checkpoint
    return drafter_config_of(state), state.weights, state.config, f"checkpoint {state.path}"


def target_mismatch(dcfg, target, run_config: dict | None) -> str | None:
    """One line naming what the drafter expects and the target lacks, or None."""
    problems = []
    if dcfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} vs the target's {target.hidden_size}")
    if dcfg.vocab_size != target.vocab_size:
        problems.append(f"vocab {dcfg.vocab_size} vs the target's {target.vocab_size}")
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != target.num_layers:
        problems.append(
            f"trained on a {dcfg.num_target_layers}-layer target, this one has {target.num_layers}"
        )
    elif any(not 0 <= i < target.num_layers for i in dcfg.target_layer_ids):
        problems.append(
            f"layer ids {dcfg.target_layer_ids} do not exist in a {target.num_layers}-layer target"
        )
    run_drafter = (run_config or {}).get("drafter") or {}
    mask_was_default = run_config is not None and run_drafter.get("mask_token_id") is None
    if mask_was_default and dcfg.mask_token_id != target.mask_token_id:
        problems.append(f"mask token {dcfg.mask_token_id} vs the target's {target.mask_token_id}")
    return "the drafter does not match the target: " + "; ".join(problems) if problems else None


def load_models(dcfg, weights, run_config: dict | None, target_spec: str | None, device: str):
    """(TargetModel, drafter) on `device`; a mismatch raises ConfigError (the target) or CheckpointError
    (the weights)."""
    from trainer.model import DFlashDrafter
    from trainer.data.target import load_target
    from trainer.train.checkpoint import load_weights
    from trainer.train.loop import param_dtype

    run_target = (run_config or {}).get("target") or {}
    spec = _spec_of(target_spec, run_config)
    tiny = (run_target.get("tiny") or None) if spec == run_target.get("spec") else None
    seed = int(((run_config or {}).get("train") or {}).get("seed", 0))
    target = load_target(spec, device, param_dtype(device), layer_ids=[0], seed=seed, tiny=tiny)
    problem = target_mismatch(dcfg, target, run_config)
    if problem:
        raise ConfigError(f"{spec}: {problem}. Fix: pass the --target the drafter was trained for.")
    target.layer_ids = list(dcfg.target_layer_ids)
    drafter = DFlashDrafter(dcfg, target.embed_tokens, target.lm_head)
    fix = "Fix: export the checkpoint again, or pass another --checkpoint."
    load_weights(drafter, dict(weights), "--checkpoint's", fix)  # a mismatch is bad input, not a failed run
    drafter.to(device=device, dtype=param_dtype(device)).eval()
    return target, drafter


def _spec_of(target_spec: str | None, run_config: dict | None) -> str:
    """The target to evaluate against: --target, else the one the run trained for."""
    spec = target_spec or ((run_config or {}).get("target") or {}).get("spec")
    if not spec:
        raise ConfigError(
            "--target is required with an export dir (it does not name its target). "
            "Fix: --target /path/to/hf-model (or tiny-random)."
        )
    return spec


def run_prompts(run_config: dict, target, source: str, count: int) -> list[list[int]]:
    """The prompts the run evaluated itself with (its held-out rows, eval.path or fresh synthetic ones)."""
    from trainer.config import config_from_dict
    from trainer.data.heldout import eval_prompts, split_heldout
    from trainer.train.loop import build_dataset

    cfg = config_from_dict(run_config, source)
    heldout = None
    if not cfg.eval.path and cfg.data.eval_fraction > 0:
        _, heldout = split_heldout(build_dataset(cfg, target), cfg.data.eval_fraction, cfg.train.seed)
    return eval_prompts(cfg, target, heldout, count)


def _progress(stream):
    start = time.monotonic()

    def show(done: int, total: int):
        from trainer.progress import bar_line, format_duration

        eta = (time.monotonic() - start) / done * (total - done)
        stream.write(bar_line(done, total, f"{done}/{total} prompts  eta {format_duration(eta)}"))
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def report_lines(result, block_size: int) -> list[str]:
    spread = result.tau_per_prompt
    lines = [
        f"tau {result.tau:.3f} pooled over {result.rounds} rounds, {result.prompts} prompts, "
        f"{result.new_tokens} new tokens (block {block_size})",
        f"tau {result.tau_per_prompt_mean:.3f} as the mean of per-prompt means; per prompt min "
        f"{spread['min']:.3f} median {spread['median']:.3f} max {spread['max']:.3f}",
        "acceptance by block position: "
        + " ".join(f"{k}:{a:.2f}" for k, a in enumerate(result.acceptance, 1)),
    ]
    if result.target_tokens_per_s:
        lines.append(
            f"tokens/s: target-only {result.target_tokens_per_s:,.1f}, speculative "
            f"{result.speculative_tokens_per_s:,.1f}, speedup {result.speedup:.2f}x "
            f"({result.loop} loop, batch {result.batch})"
        )
    if result.skipped_too_long:
        lines.append(f"skipped {result.skipped_too_long} prompt(s) longer than the target's context allows")
    if result.lossless is None:
        lines.append("lossless check: not applicable (sampling, temperature > 0)")
    elif result.lossless:
        ties = f" ({result.ties} floating-point tie(s): fp32 logits within rounding)" if result.ties else ""
        lines.append(f"lossless check: ok, speculative output equals the target's greedy output{ties}")
    return lines


def _finite(value):
    """JSON has no NaN (tau of zero rounds) or Infinity: such numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def run_eval(args: argparse.Namespace, out=None, err=None) -> int:
    """`dflash-train eval`: 0 done, 1 failed (or not lossless), 2 bad input (trainer.cli.errors)."""
    err = err or sys.stderr
    return run_command("dflash-train eval", lambda: _run_eval(args, out or sys.stdout, err), err)


def _run_eval(args: argparse.Namespace, out, err) -> int:
    try:
        device = _checked_device(args)
        dcfg, weights, run_config, described = load_drafter_source(args.checkpoint)
        if args.why and run_config is None:
            raise ConfigError(
                "--why needs the run (its held-in records and training accuracy), not an export dir. "
                "Fix: --checkpoint RUN_DIR or a checkpoints/step-NNNNNNN dir."
            )
        target, drafter = load_models(dcfg, weights, run_config, args.target, device)
        args.template_kwargs = _template_kwargs(args, run_config, err)
        if args.why:
            return _run_why(args, target, drafter, run_config, described, device, out, err)
        prompts = _prompts(args, target, run_config, described)
        result = _evaluate(args, target, drafter, prompts, device, err)
    except RuntimeError as exc:  # e.g. CUDA out of memory: one line, not a traceback
        print(f"dflash-train eval: failed: {in_one_line(exc)}", file=err)
        return 1
    if args.json:
        payload = dict(
            result.to_dict(),
            checkpoint=described,
            device=device,
            block_size=dcfg.block_size,
            temperature=args.temperature,
        )
        out.write(json.dumps(_finite(payload), allow_nan=False) + "\n")
    else:
        out.write(f"dflash-train eval: {described} on {device}\n")
        out.write("".join(line + "\n" for line in report_lines(result, dcfg.block_size)))
    return _exit_code(result.mismatch, err)


def _checked_device(args: argparse.Namespace) -> str:
    """The device to evaluate on, once the numeric arguments are known good."""
    import torch

    options.check_at_least_one(
        ("--num-prompts", args.num_prompts),
        ("--max-new-tokens", args.max_new_tokens),
        ("--batch", args.batch),
    )
    options.check_temperature(args.temperature)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not DEVICE_RE.match(device):
        raise ConfigError(f"--device {device!r} is not a device. Fix: cpu, cuda or cuda:N.")
    options.check_cuda_devices("--device", [device])
    return device


def _prompts(args: argparse.Namespace, target, run_config: dict | None, described: str) -> list[list[int]]:
    """--prompts, else the run's own evaluation prompts (an export dir has none)."""
    if args.prompts:
        from trainer.data.chat_tokenizer import chat_tokenizer_of
        from trainer.data.prompts import load_prompts

        tokenizer = chat_tokenizer_of(target, _spec_of(args.target, run_config))
        prompts = load_prompts(args.prompts, tokenizer, target.vocab_size, args.template_kwargs)
    elif run_config is not None:
        prompts = run_prompts(run_config, target, described, args.num_prompts)
    else:
        raise ConfigError("--prompts is required with an export dir. Fix: --prompts FILE.jsonl.")
    return prompts[: args.num_prompts]


def _template_kwargs(args: argparse.Namespace, run_config: dict | None, err) -> dict | None:
    """--chat-template-kwargs, else what the training data was rendered with (the run's config, or an
    export's serve.json); a warning when the two differ."""
    from trainer.infer.serve_recipe import SERVE_JSON
    from trainer.template_args import differs_warning, recorded_in, run_chat_template_kwargs

    trained = run_chat_template_kwargs(run_config)
    if run_config is None:
        trained = recorded_in(str(Path(args.checkpoint) / SERVE_JSON))
    if args.chat_template_kwargs is None:
        return trained
    asked = options.chat_template_kwargs(args.chat_template_kwargs)
    warning = differs_warning(trained, asked)
    if warning:
        print(f"dflash-train eval: {warning}", file=err)
    return asked


def _run_why(args, target, drafter, run_config, described: str, device: str, out, err) -> int:
    """--why: tau held-in, held-out and expected, and the likely cause (trainer.tau_diagnosis)."""
    from trainer import metrics_format
    from trainer.tau_diagnosis import expected_tau_of, likely_cause

    held_in = _evaluate(
        args, target, drafter, run_prompts(run_config, target, described, args.num_prompts), device, err
    )
    held_out = None
    if args.prompts:
        prompts = _prompts(args, target, run_config, described)
        held_out = _evaluate(args, target, drafter, prompts, device, err)
    run = run_config.get("run") or {}
    metrics = run.get("metrics_file") or str(Path(run.get("output_dir", ".")) / "metrics.jsonl")
    try:
        records = metrics_format.parse_lines(Path(metrics).read_text(encoding="utf-8"))
    except OSError:
        records = []
    expected = expected_tau_of([r for r in metrics_format.current_run(records) if r.get("event") == "step"])
    numbers = {
        "tau_held_in": held_in.tau,
        "tau_held_out": held_out.tau if held_out else None,
        "tau_expected": expected,
        "likely_cause": likely_cause(expected, held_in.tau, held_out.tau if held_out else None),
    }
    if args.json:
        out.write(json.dumps(_finite(dict(numbers, checkpoint=described)), allow_nan=False) + "\n")
    else:
        out.write(f"dflash-train eval --why: {described} on {device} (tau pooled over rounds)\n")
        out.write(
            f"tau held-in  {held_in.tau:.3f}  ({held_in.prompts} unseen records of the training data)\n"
        )
        if held_out:
            out.write(f"tau held-out {held_out.tau:.3f}  ({held_out.prompts} prompts of {args.prompts})\n")
        shown = f"{expected:.3f}" if expected is not None else "unknown (no step records in " + metrics + ")"
        out.write(f"tau expected {shown}  (from training accuracy, last steps of {metrics})\n")
        out.write(numbers["likely_cause"] + "\n")
    return _exit_code(held_in.mismatch or (held_out.mismatch if held_out else None), err)


def _evaluate(args: argparse.Namespace, target, drafter, prompts, device: str, err):
    from trainer.infer.evaluate import evaluate, stop_token_ids

    show = _progress(err) if err.isatty() and not args.json else None
    return evaluate(
        target.model,
        target.layer_ids,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_ids=stop_token_ids(target.model, target.tokenizer),
        seed=args.seed,
        progress=show,
        warmup=True,
        batch=args.batch,
        loop=args.loop,
        compile=device.startswith("cuda") if args.compile is None else args.compile,
    )


def _exit_code(m, err) -> int:
    """1 (the lossless check failed, said on `err`) for a mismatch `m`, else 0."""
    if m is None:
        return 0
    print(
        f"dflash-train eval: LOSSLESS CHECK FAILED: prompt {m.prompt_index} (first tokens "
        f"{m.prompt[:12]}), new token {m.position}: target {m.expected}, speculative {m.got}; "
        f"the target's fp32 logits there {m.expected_logit:.4f} vs {m.got_logit:.4f}, top token {m.top} "
        f"at {m.top_logit:.4f}: a gap to the top beyond the {m.tie_bound:.2e} a rounding tie allows",
        file=err,
    )
    return 1
