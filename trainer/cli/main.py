"""`dflash-train`: the command line over trainer.train.loop and trainer.infer.export (argparse: stdlib only).

Exit codes: 0 done (also after a graceful SIGTERM/SIGINT stop, which checkpoints first);
1 training failed (an `error` record is in the metrics file, the traceback in the log);
2 bad config, data, checkpoint or arguments (one message naming the key or file:line, and the fix);
130 aborted without a new checkpoint: a second SIGINT/SIGTERM, or the step running at the first one
did not finish within run.stop_grace_s (a stuck thread; see trainer.train.shutdown).
"""

from __future__ import annotations

import argparse
import sys

from trainer.config import COMPILE_LOCK_MODES, ATTENTION_BACKENDS, LAUNCHERS
from trainer.typed_yaml import closest_match
from trainer.cli.errors import input_error, run_command
from trainer.cli import options

# torch is imported only once the config, the arguments and the paths are known good: every input
# error is reported in well under a second.

TRAIN_HELP = """\
Train a DFlash drafter for a frozen target model.

Start with the bundled tiny run (CPU, about a minute, no downloads):
  dflash-train --config tiny-cpu --output-dir runs/tiny
Continue it after a stop (SIGTERM/Ctrl-C finish the step and write a checkpoint first):
  dflash-train --config tiny-cpu --output-dir runs/tiny --resume
Export the result for an inference engine:
  dflash-train export --checkpoint runs/tiny --out runs/tiny/export

For your own target, copy trainer/configs/gpu-paper.yaml, set target.spec and data.path, then:
  dflash-train --config my.yaml --target-devices cuda:0 --drafter-devices cuda:1,cuda:2,cuda:3

Outputs: <output-dir>/checkpoints/step-NNNNNNN/ (last few kept) and the metrics file
(JSON lines; default <output-dir>/metrics.jsonl). Any config key can be overridden with
--set section.key=value (e.g. --set train.lr=3e-4). On GPUs training runs in bf16-mixed
precision (fp32 master weights); --set train.precision=fp32 for full fp32.
"""

EXPORT_HELP = """\
Write a checkpoint's drafter in the format inference engines load: config.json
(architectures ["DFlashDraftModel"], block_size, dflash_config, auto_map) + model.safetensors
+ modeling_dflash.py, so AutoModel.from_pretrained(DIR, trust_remote_code=True) loads it.

  dflash-train export --checkpoint runs/tiny/checkpoints/step-0000512 --out drafter/
  dflash-train export --checkpoint runs/tiny --out drafter/     (its latest checkpoint)

It also writes SERVE.md and serve.json beside the weights (and prints them): the vLLM and SGLang
command lines that serve this drafter with its target. An export an engine would refuse or serve
wrongly (fc width, a mask_hidden weight, causal layers, another RoPE, a bad mask token or layer
id) is refused in one line, exit 2, and nothing is written.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}. Fix: e.g. 100")
    return value


def _train_parser() -> argparse.ArgumentParser:
    p = options.command_parser(
        "dflash-train",
        TRAIN_HELP,
        epilog="Subcommands: dflash-train export --help | dflash-train data --help | "
        "dflash-train eval --help | dflash-train gate --help | dflash-train report --help",
    )
    options.add_config(p, "YAML config file, or a bundled name: tiny-cpu, gpu-paper")
    p.add_argument("--output-dir", metavar="DIR", help="where checkpoints (and by default metrics) go")
    p.add_argument(
        "--max-steps",
        type=_positive_int,
        metavar="N",
        help="stop after at most N optimizer steps (train.epochs still bounds the run; "
        "the LR schedule spans the steps actually run)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="PATH",
        help="continue from the latest checkpoint in --output-dir, or from PATH "
        "(a checkpoints/step-NNNNNNN directory, or another run's output dir)",
    )
    p.add_argument(
        "--compile-lock",
        choices=COMPILE_LOCK_MODES,
        help="protection against the torch.compile FX-tracing race between drafter threads "
        "(default lock; none/patch are for experiments)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        help="flex: compiled flex_attention (GPU); sdpa: dense mask (CPU, or any device)",
    )
    p.add_argument(
        "--target-devices", metavar="LIST", help="comma-separated, e.g. cuda:0 (one target worker each)"
    )
    p.add_argument(
        "--drafter-devices",
        metavar="LIST",
        help="comma-separated, e.g. cuda:1,cuda:2 (one drafter thread + replica each; "
        "repeat a device for several threads on it, e.g. cpu,cpu)",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        help="threads (default): one process, a drafter thread per device; torchrun: this "
        "process is one rank of `torchrun --nproc-per-node N -m trainer ...` (DDP)",
    )
    p.add_argument(
        "--metrics-file", metavar="PATH", help="JSON-lines metrics (default <output-dir>/metrics.jsonl)"
    )
    p.add_argument("--seed", type=int, help="seed for init, data order and anchors")
    options.add_overrides(p, "override any config key (YAML value), repeatable: --set train.lr=3e-4")
    return p


def _export_parser() -> argparse.ArgumentParser:
    p = options.command_parser("dflash-train export", EXPORT_HELP)
    options.add_checkpoint(
        p, "a checkpoints/step-NNNNNNN directory, or an output dir (its latest checkpoint)"
    )
    options.add_out(p, "DIR", "export directory (created)")
    options.add_dtype(p, "weight dtype of the export (default bf16; training keeps fp32 masters)")
    options.add_target(p, "the target to serve with (default: the one the run trained against)")
    return p


SUBCOMMANDS = ("export", "data", "eval", "gate", "report")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        # training takes only options, so a bare first word is a subcommand: name the closest one
        close = closest_match(argv[0], SUBCOMMANDS)
        hint = f" (did you mean {close!r}?)" if close else ""
        _train_parser().error(
            f"unknown command {argv[0]!r}{hint}; commands: {', '.join(SUBCOMMANDS)}, "
            "or train with options only (--config ...)"
        )
    if argv and argv[0] == "eval":
        from trainer.cli.eval import eval_parser, run_eval

        return run_eval(eval_parser().parse_args(argv[1:]))
    if argv and argv[0] == "gate":
        from trainer.cli.gate import gate_parser, run_gate_command

        return run_gate_command(gate_parser().parse_args(argv[1:]))
    if argv and argv[0] == "export":
        export_args = _export_parser().parse_args(argv[1:])
        return run_command("dflash-train", lambda: _run_export(export_args))
    if argv and argv[0] == "report":
        from trainer.cli.report import report_parser, run_report

        return run_report(report_parser().parse_args(argv[1:]))
    if argv and argv[0] == "data":
        from trainer.cli.data import main as data_main

        return data_main(argv[1:])
    train_args = _train_parser().parse_args(argv)
    return run_command("dflash-train", lambda: _run_train(train_args))


def _run_train(args: argparse.Namespace) -> int:
    from trainer.config import load_config
    from trainer.train.preflight import check_output_paths, check_resume

    cfg = load_config(args.config, options.overrides_from_args(args))
    check_resume(cfg)  # before anything is created
    check_output_paths(cfg)
    try:
        from trainer.train.loop import train  # torch and transformers load once the config is good

        result = train(cfg)
    except KeyboardInterrupt:
        from trainer.train.shutdown import EXIT_ABORTED, exit_if_threads_stuck

        print("dflash-train: aborted (no checkpoint written)", file=sys.stderr)
        exit_if_threads_stuck(EXIT_ABORTED)
        return EXIT_ABORTED
    except Exception as exc:  # noqa: BLE001 - recorded in the metrics file; the log has the traceback
        if input_error(exc) is not None:
            raise  # bad input: run_command says it in one line
        print(f"dflash-train: training failed: {exc}", file=sys.stderr)
        return 1
    what = "finished" if result.reason == "max_steps" else "stopped on request"
    print(
        f"dflash-train: {what} at step {result.steps_done}/{result.total_steps}; "
        f"last checkpoint {result.checkpoint}"
    )
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from trainer.train.checkpoint import drafter_config_of, load_checkpoint, resolve_export_source

    options.check_out_dir(args.out)
    path = resolve_export_source(args.checkpoint)  # a step dir, or a run dir's latest: before torch loads
    from trainer.infer.export import export_checkpoint
    from trainer.infer.serve_recipe import recipe_for_checkpoint, write_recipe

    state = load_checkpoint(path)
    drafter_config_of(state)  # a damaged config.json or drafter_config.json: one line, before --out
    out = export_checkpoint(state, args.out, args.dtype)
    recipe = recipe_for_checkpoint(state, out, args.target)
    write_recipe(recipe, out)
    print(f"dflash-train: exported {path} -> {out}")
    print("\n".join(recipe.lines()))
    return 0
