"""`dflash-train data ...`: prepare training data (regenerate answers with the target, cache its features).

Exit codes: 0 done; 2 bad arguments, config, data or output directory (one line naming it and the
fix); 130 interrupted, 143 SIGTERM (regenerate: a rerun with --resume continues; cache-features: a
rerun with the same arguments continues). regenerate prints a summary line on every exit.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

from trainer.config import DEVICE_RE, ConfigError, in_one_line
from trainer.cli.errors import input_error, run_command
from trainer.cli import options

DATA_HELP = """\
Prepare training data for a DFlash drafter.

  dflash-train data regenerate --target /models/Qwen3-8B --in chats.jsonl --out regen.jsonl \\
      --chat-template-kwargs '{"enable_thinking": false}' --devices cuda:0,cuda:1
  dflash-train data cache-features --config my.yaml --out /data/features
      then train with  data: {source: features, path: /data/features}

The drafter learns the target's continuations: regenerate the assistant turns with the target
before training. The feature cache runs the target once; every epoch then reads from disk.
"""

REGEN_HELP = """\
Keep each record's system/user turns and regenerate every assistant turn with the target
(batched, left padding, KV cache, the tokenizer's chat template). Writes {"messages": [...]}
lines in input order; records that cannot be done (too long, bad roles, ...) go to
<out>.rejects.jsonl with the reason. --resume continues a stopped run exactly where it stopped.
"""

CACHE_HELP = """\
Run the target once over the config's training data and write, per sequence, the fused features
of target.layer_ids, input_ids and loss_mask in size-capped safetensors shards plus manifest.json.
Prints the disk estimate first and refuses when the filesystem lacks the space. Rerunning with the
same arguments resumes after the last whole shard.
"""


def _parser() -> argparse.ArgumentParser:
    p = options.command_parser("dflash-train data", DATA_HELP, argparse.ArgumentParser)
    sub = p.add_subparsers(dest="command", required=True, metavar="{regenerate,cache-features}")
    _add_regenerate_parser(sub)
    _add_cache_features_parser(sub)
    return p


def _subcommand(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def _add_regenerate_parser(sub) -> None:
    r = _subcommand(sub, "regenerate", "regenerate assistant turns with the target", REGEN_HELP)
    options.add_target(r, "a local HF model directory, or tiny-random", required=True)
    r.add_argument("--in", dest="input", required=True, metavar="FILE", help='JSONL of {"messages": [...]}')
    options.add_out(r, "FILE", "output JSONL (rejects go to FILE.rejects.jsonl)")
    options.add_max_new_tokens(r, 2048)
    r.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="reject turns whose prompt is longer (default: the model's context minus --max-new-tokens)",
    )
    options.add_temperature(r, "0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=1.0, metavar="P")
    r.add_argument(
        "--batch-size",
        default="auto",
        metavar="B|auto",
        help="records generated together per device (default auto: as many as the GPU's free memory "
        "holds, from the target's cache per sequence; 8 on the CPU)",
    )
    r.add_argument("--devices", default="cpu", metavar="LIST", help="comma-separated, e.g. cuda:0,cuda:1")
    r.add_argument(
        "--chat-template-kwargs",
        default="{}",
        metavar="JSON",
        help="passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    options.add_sampling_seed(r)
    r.add_argument("--resume", action="store_true", help="continue a stopped run of the same command")


def _add_cache_features_parser(sub) -> None:
    c = _subcommand(sub, "cache-features", "cache the target's features on disk", CACHE_HELP)
    options.add_config(c, "the training config (target + data sections)")
    options.add_out(c, "DIR", "cache directory (created; resumed if it exists)")
    options.add_dtype(c, "feature dtype on disk (default bf16)")
    c.add_argument(
        "--shard-size-mb", type=int, default=2048, metavar="MB", help="shard size cap (default 2048)"
    )
    options.add_batch_size(c, "sequences per target forward (default: about 16384 tokens' worth)")
    c.add_argument(
        "--device", metavar="DEV", help="target device (default: the config's first target device)"
    )
    options.add_overrides(c, "override a config key")


def main(argv: list[str]) -> int:
    """`dflash-train data`: bad input is one line and exit 2 (trainer.cli.errors), failures exit 1."""
    args = _parser().parse_args(argv)
    return run_command("dflash-train data", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    again = "rerun the same command to continue" + (" with --resume" if args.command == "regenerate" else "")
    try:
        return _regenerate(args) if args.command == "regenerate" else _cache_features(args)
    except KeyboardInterrupt as exc:
        print(f"dflash-train data: interrupted; {again}", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except OSError as exc:  # disk full, unwritable output: what was committed stays valid
        print(f"dflash-train data: failed: {exc}; {again}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, no traceback
        if input_error(exc) is not None:
            raise  # bad input: run_command says it
        print(f"dflash-train data: failed: {in_one_line(exc)}", file=sys.stderr)
        return 1


def _regenerate(args) -> int:
    from trainer.data.regenerate import RegenerateOptions, regenerate

    batch_size = _batch_size(args.batch_size)
    options.check_at_least_one(
        ("--max-new-tokens", args.max_new_tokens), ("--batch-size", 1 if batch_size is None else batch_size)
    )
    options.check_temperature(args.temperature)
    template_kwargs = options.chat_template_kwargs(args.chat_template_kwargs)
    flags_as_given = "target input max_new_tokens max_prompt_tokens temperature top_p seed resume".split()
    job = RegenerateOptions(
        output=args.out,
        batch_size=batch_size,
        devices=_regenerate_devices(args.devices),
        chat_template_kwargs=template_kwargs,
        **{name: getattr(args, name) for name in flags_as_given},  # each flag's dest is the field's name
    )
    report: dict = {}
    try:
        with _sigterm_as_interrupt():
            summary = regenerate(job, report=report)
    except BaseException as exc:  # the summary of what is committed, on every way out
        if report:
            print(
                f"dflash-train data: regenerate stopped ({_why(exc)}): {_regen_summary(report)}; "
                f"rerun with --resume to continue",
                file=sys.stderr,
                flush=True,
            )
        raise
    print(f"dflash-train data: regenerated {_regen_summary(summary)}")
    return 0


def _batch_size(text: str) -> int | None:
    """--batch-size: a count, or auto (None)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"--batch-size {text!r} is not a number. Fix: e.g. --batch-size 64, or auto"
        ) from None


def _regenerate_devices(text: str) -> list[str]:
    """The --devices list, each a device name and, for CUDA, one that is visible."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in devices if not DEVICE_RE.match(d)]
    if not devices or bad:
        raise ConfigError(
            f"--devices {text!r}: {', '.join(bad) or 'empty'} is not a device. "
            f"Fix: e.g. cpu, cuda:0 or cuda:0,cuda:1"
        )
    options.check_cuda_devices("--devices", devices)
    return devices


def _regen_summary(s: dict) -> str:
    """One line: the committed totals, this run's share and its new tokens/s."""
    run = s["this_run"]
    rejects = f" -> {s['rejects_path']}" if s["rejects"] else ""
    return (
        f"{s['records']} records ({s['turns']} turns, {s['new_tokens']} new tokens, "
        f"{s['truncated']} cut at --max-new-tokens), {s['rejects']} rejected{rejects}"
        + (f"; batches up to {s['batch']} ({s['batch_rule']})" if s.get("batch") else "")
        + f"; this run {run['seen']} records, {run['new_tokens']} new tokens in {s['seconds']:.1f} s = "
        f"{run['new_tokens'] / max(s['seconds'], 1e-9):.1f} new tokens/s -> {s['output']}"
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the committed state is reported before exiting."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    def on_term(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (a library caller): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _why(exc: BaseException) -> str:
    if isinstance(exc, Terminated):
        return "SIGTERM"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return in_one_line(exc)


def _cache_features(args) -> int:
    from trainer.data.cache_writer import write_cache
    from trainer.data.feature_cache import cache_header, human_bytes
    from trainer.progress import ProgressLine
    from trainer.train.loop import build_dataset, configured_target

    options.check_out_dir(args.out)  # before the target loads
    cfg = _cache_config(args)
    began = time.monotonic()
    say = lambda text: print(f"dflash-train data: {text}", flush=True)  # noqa: E731
    device = cfg.run.target_devices[0]
    slow = (
        " (the target's greedy continuations: this takes a while)" if cfg.data.source == "synthetic" else ""
    )
    say(f"loading the target ({cfg.target.spec}) on {device} and the {cfg.data.source} data{slow}")
    target = configured_target(cfg, device)
    dataset = build_dataset(cfg, target)
    pad = getattr(target.tokenizer, "pad_token_id", None)  # None without a tokenizer too
    header = cache_header(cfg, target, args.dtype, pad if pad is not None else 0)
    progress = ProgressLine("sequences", len(dataset))
    writing = time.monotonic()
    manifest = write_cache(  # no_grad: write_cache is decorated with it
        target,
        dataset,
        args.out,
        header,
        batch_size=args.batch_size,
        shard_bytes=args.shard_size_mb << 20,
        say=say,
        progress=progress,
    )
    progress.finish()
    seconds = time.monotonic() - writing
    counts = manifest["counts"]
    computed = len(dataset) - progress.first  # a resumed run skips what is cached
    tokens = int(dataset.attention_mask[progress.first :].sum())
    say(
        f"feature cache complete: {counts['sequences']} sequences, {counts['tokens']} tokens, "
        f"{counts['shards']} shard(s), {human_bytes(counts['bytes'])}, {time.monotonic() - began:.1f} s "
        f"-> {args.out}; this run computed {computed} sequences at {computed / max(seconds, 1e-9):.1f} "
        f"sequences/s, {tokens / max(seconds, 1e-9):.0f} tokens/s"
    )
    return 0


def _cache_config(args):
    """The training config the cache is made from, its target device checked."""
    import torch

    from trainer.config import check_devices, load_config

    if args.shard_size_mb < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise ConfigError("--shard-size-mb and --batch-size must be at least 1")
    cfg = load_config(args.config, options.overrides_from_args(args))
    if cfg.data.source == "features":
        raise ConfigError(
            f"{cfg.source}: data.source is features; cache-features needs the text data "
            f"(jsonl or synthetic) to run the target over"
        )
    if args.device:
        cfg.run.target_devices = [args.device]
    check_devices(cfg)
    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    return cfg
