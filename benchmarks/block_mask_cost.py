"""The block mask's share of a paper-dims drafter step: trainer.masks.build_block_mask (tiles from the
visible intervals) against create_block_mask (mask_mod evaluated at every (q, kv)), alternating in one
process, three runs each: the mask build alone (synchronised) and the whole step of
benchmarks/train_throughput.py's compiled part (anchors, mask, forward, backward, AdamW).

    python benchmarks/block_mask_cost.py --device cuda:0 --out $OUT/block-mask-cost.json
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import train_throughput as throughput  # noqa: E402
from benchmarks.common import doc_parser, versions  # noqa: E402
from trainer import masks  # noqa: E402
from trainer.compile_lock import CompileGuard  # noqa: E402


BUILDERS = {"intervals": masks.build_block_mask, "create_block_mask": masks.evaluated_block_mask}


def seconds(fn, device: str) -> float:
    throughput._sync(torch, device)
    began = time.perf_counter()
    fn()
    throughput._sync(torch, device)
    return time.perf_counter() - began


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    cli = p.parse_args()
    small = [] if cli.device.startswith("cuda") else ["--small", "--attention", "sdpa"]  # flex needs CUDA
    args, dims, _ = throughput._settings(throughput._parser(), ["--device", cli.device, *small])
    guard = CompileGuard("lock").install()
    cfg, model, optimizer, dtype = throughput._build(args, dims, torch)
    gen = torch.Generator().manual_seed(1)
    batch = throughput._batch(args, dims, cfg, torch, dtype, gen)

    def step(index: int) -> float:
        with guard.step("drafter0", index, tuple(batch[0].shape)):
            return seconds(
                lambda: throughput._train_step(
                    args, dims, cfg, model, optimizer, batch, gen, args.attention, torch
                ),
                args.device,
            )

    for index in range(3):  # compiles
        step(index)
    runs: dict[str, list] = {name: [] for name in BUILDERS}
    for run in range(3):
        for name, builder in BUILDERS.items():
            anchors, valid = masks.sample_anchors(batch[1], dims["anchors"], cfg.block_size, gen)
            built = functools.partial(builder, anchors, valid, dims["ctx"], cfg.block_size, args.device)
            build = [seconds(built, args.device) for _ in range(cli.steps)]
            masks.build_block_mask = builder  # what _train_step calls
            steps = [step(100 * run + i) for i in range(cli.steps)]
            masks.build_block_mask = BUILDERS["intervals"]
            row = {"run": run, "mask_ms": statistics.median(build) * 1e3, "step_s": statistics.median(steps)}
            runs[name].append(row)
            print(name, json.dumps(row), flush=True)
    Path(cli.out).write_text(
        json.dumps({"info": versions(args.device), "dims": dims, "runs": runs}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
