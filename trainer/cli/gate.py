"""`dflash-train gate`: the serving gate (trainer.cli.serving_gate) from the command line.

Exit codes: 0 the served drafter accepted every block whole; 1 it did not (one line saying what was
accepted); 2 bad input.
"""

from __future__ import annotations

import argparse
import tempfile

from trainer.cli import options
from trainer.cli.errors import run_command

GATE_HELP = """\
The serving gate: train a fresh drafter on ONE sequence (the target's own continuation of a random
prompt) for a few hundred steps, export it, load the export the way users do
(AutoModel.from_pretrained(DIR, trust_remote_code=True)), decode that prompt with spec_generate and
require every drafted block to be accepted whole. A drafter that trains fine but serves tau ~1
(labels shifted by one, a padding shift in the features, blocks seeing later context) fails it.

  dflash-train gate                                (the bundled tiny-cpu target, CPU, seconds)
  dflash-train gate --config my.yaml --target-devices cuda:0 --drafter-devices cuda:0
"""


def gate_parser() -> argparse.ArgumentParser:
    p = options.command_parser("dflash-train gate", GATE_HELP)
    p.add_argument(
        "--config",
        default="tiny-cpu",
        metavar="FILE",
        help="whose target and drafter shape (default tiny-cpu)",
    )
    p.add_argument("--steps", type=int, default=None, metavar="N", help="training steps (default 300)")
    p.add_argument("--work-dir", metavar="DIR", help="keep the run and the export here (default: a temp dir)")
    p.add_argument("--target-devices", metavar="LIST", help="e.g. cuda:0")
    p.add_argument("--drafter-devices", metavar="LIST", help="e.g. cuda:0 (the gate uses the first)")
    options.add_overrides(p, "override a config key, repeatable: --set drafter.num_layers=2")
    return p


def run_gate_command(args: argparse.Namespace) -> int:
    return run_command("dflash-train gate", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from trainer.cli.serving_gate import GATE_STEPS, run_gate

    steps = GATE_STEPS if args.steps is None else args.steps
    options.check_at_least_one(("--steps", steps))
    overrides = options.overrides_from_args(args)
    if args.work_dir:
        options.check_out_dir(args.work_dir, "--work-dir")
        result = run_gate(args.work_dir, args.config, overrides, steps)
    else:
        with tempfile.TemporaryDirectory(prefix="dflash-gate-") as work_dir:
            result = run_gate(work_dir, args.config, overrides, steps)
    print(result.line())
    return 0 if result.passed else 1
