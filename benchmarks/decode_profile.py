"""Every kernel of the static decode loop's calls at one shape: name, launches and device time per call, for a
target-only step, a verify, a draft and a whole speculative round. The loop runs as decode_cost runs it,
but without CUDA graphs, so the profiler sees each kernel (a graph replays the same ones, no host between).

    python benchmarks/decode_profile.py --device cuda:0 --shapes small,8b --out $OUT/decode-profile.md
    python benchmarks/decode_profile.py --device cpu --shapes tiny --kernels eager --out /tmp/dp.md   (smoke)

On the CPU the rows are the aten ops that do the work (no kernels there).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import doc_parser, sync, versions  # noqa: E402
from benchmarks.decode_cost import KERNELS, ROW_NAME, SHAPES, build, parts_of, with_block  # noqa: E402


def inventory(run, device: str, calls: int) -> dict:
    """{kernels_per_call, device_ms_per_call, rows: [(name, launches, us)]}, per call, over `calls` calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.startswith("cuda")
    run()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            run()
        sync(device)
    launches: collections.Counter = collections.Counter()
    micros: collections.Counter = collections.Counter()
    for event in prof.events():
        wanted = event.device_type == DeviceType.CUDA if on_cuda else not event.cpu_children
        if wanted and (on_cuda or event.name.startswith("aten::")):
            launches[event.name] += 1
            micros[event.name] += event.time_range.elapsed_us()
    rows = [
        (name, launches[name] / calls, micros[name] / calls)
        for name in sorted(micros, key=micros.__getitem__)
    ]
    return {
        "kernels_per_call": sum(launches.values()) / calls,
        "device_ms_per_call": sum(micros.values()) / calls / 1e3,
        "rows": rows[::-1],
    }


def profile_shape(shape: str, block: int, kernels: str, device: str, calls: int) -> dict:
    """Each part of decode_cost's loop at `shape`, after a prefill that leaves positions mid-decode."""
    from trainer.fused_projections import fuse_projections
    from trainer.infer.static_decode import StaticDecoder

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, drafter = build(shape, device, dtype)
    compile, fused, rowwise, triton = KERNELS[kernels]
    if fused:
        fuse_projections(model)
    spec = SHAPES[shape]
    prompt = list(range(3, 3 + spec["prompt"]))
    d = with_block(drafter, block)
    dec = StaticDecoder(
        model, d.cfg.target_layer_ids, d, rows=1, max_prompt=spec["prompt"], max_new_tokens=spec["new"],
        graphs=False, compile=compile, rowwise=rowwise, triton=triton,
    )  # fmt: skip
    out = {}
    with torch.no_grad():
        dec.prefill([prompt], spec["new"], True)
        for name, run in parts_of(dec).items():
            out[ROW_NAME[name]] = inventory(run, device, calls)
            print(
                f"  {shape} {ROW_NAME[name]}: {out[ROW_NAME[name]]['kernels_per_call']:.0f} kernels",
                flush=True,
            )
    return out


def markdown(args, info: dict, results: dict) -> str:
    lines = [
        f"# The decode loop's kernels on {info.get('gpu', args.device)}",
        "",
        f"`python benchmarks/decode_profile.py --device {args.device} --shapes {args.shapes} "
        f"--blocks {args.block} --kernels {args.kernels}` (torch {info['torch']}; per call, the mean of "
        f"{args.calls} calls, no CUDA graphs). Device time is the kernels' own; a graph replay adds a gap of "
        "about a microsecond per kernel.",
        "",
    ]
    for shape, parts in results.items():
        lines += [f"## {shape}", "", "| part | kernels / call | kernel ms / call |", "|---|---|---|"]
        lines += [
            f"| {p} | {r['kernels_per_call']:.0f} | {r['device_ms_per_call']:.3f} |" for p, r in parts.items()
        ]
        for part, r in parts.items():
            lines += [
                "",
                f"### {shape}: {part}",
                "",
                "| kernel | launches / call | us / call |",
                "|---|---|---|",
            ]
            lines += [f"| `{name[:100]}` | {n:g} | {us:.1f} |" for name, n, us in r["rows"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = doc_parser(__doc__)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", default="small")
    p.add_argument("--blocks", dest="block", type=int, default=16)
    p.add_argument("--kernels", default="triton", choices=list(KERNELS))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    info = versions(args.device)
    results = {}
    for shape in args.shapes.split(","):
        results[shape] = profile_shape(shape, args.block, args.kernels, args.device, args.calls)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    Path(args.out).write_text(markdown(args, info, results))
    Path(args.out).with_suffix(".json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    print(Path(args.out).read_text()[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
