"""benchmarks/seed_scale.py's markdown: one table row per shape and part, the failures said in words."""

from __future__ import annotations

SEEDS = (
    "12-20 K tokens/s: the seeds' healthy training figure on their 8-GPU rig (context tokens/s, all 8 GPUs)"
)


def _f(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _failed(result: dict) -> str | None:
    if not result:
        return "not run"
    return f"failed: {result['failed']}" if "failed" in result else None


def _path(path: dict | None) -> str:
    return "dense" if path is None else ", ".join(f"{part}: {who}" for part, who in path.items())


def build_row(name: str, b: dict) -> str:
    if _failed(b):
        return f"| {name} | {_failed(b)} |||||||"
    mem = b.get("memory_gib") or {}
    finite = (
        "all finite" if not b["nonfinite_layers"] else f"NaN/inf at hidden states {b['nonfinite_layers']}"
    )
    return (
        f"| {name} | {b['params'] / 1e9:.2f} B | {b['load_s']:.1f} | {_f(mem.get('allocated'))} | "
        f"{finite} (max abs {b['max_abs_hidden']:.3g}) | {_path(b['gated_deltanet'])} | "
        f"{b['feature_forward_s'] * 1000:.0f} | {b['feature_tokens_per_s']:,.0f} |"
    )


def train_row(name: str, t: dict, peak: dict) -> str:
    if "steady_step_s" not in t:
        why = _failed(t) or "no steady step"
        return f"| {name} | {why} (rc {t.get('rc')}, steps {t.get('steps')}) |||||||||"
    flops = t.get("flops") or {}
    return (
        f"| {name} | {t['startup_s']:.1f} | {t['first_step_s']:.1f} | {t['steady_step_s']:.3f} | "
        f"{t['context_tokens_per_s']:,.0f} | {t['block_tokens_per_s']:,.0f} | "
        f"{_f(t.get('peak_memory_gib'))} | "
        f"{_f(flops.get('target', 0) / 1e12, '.3g')} + {_f(flops.get('drafter', 0) / 1e12, '.3g')} | "
        f"{_f(t.get('tflops'), '.3g')} | "
        f"{_f(100 * t['mfu'] if t.get('mfu') else None)} % of {_f(peak.get('tflops'), '.3g')} |"
    )


def data_rows(name: str, shape: dict) -> list[str]:
    rows = []
    c, r, d = shape.get("cache", {}), shape.get("regenerate", {}), shape.get("decode", {})
    rows.append(
        f"| {name} | cache-features | "
        + (
            _failed(c)
            or f"{c['tokens_per_s']:,.0f} tokens/s ({c['sequences']} seq, {c['bytes'] / 2**30:.2f} GiB); "
            f"{c['seconds']:.2f} s = {c['vs_bare_forward']:.2f}x the bare feature forward of the same "
            f"batches ({c['bare_forward_s']:.2f} s, batch {c['batch']})"
        )
        + " |"
    )
    rows.append(
        f"| {name} | data regenerate | "
        + (
            _failed(r)
            or "; ".join(
                f"{x['new_tokens_per_s']:,.0f} new tokens/s, batches up to {x['batch']} ({x['batch_rule']}), "
                f"{x['records']} records, {x['new_tokens']} new tokens in {x['seconds']:.1f} s"
                for x in (r.get("small_batch"), r)
                if x and "failed" not in x
            )
        )
        + " |"
    )
    rows.append(
        f"| {name} | decode | "
        + (
            _failed(d)
            or f"target-only {d['target_ms_per_token']:.2f} ms/token; speculative round "
            f"{d['round_ms']:.2f} ms = {d['round_vs_step']:.2f} target steps at block {d['block']} "
            f"({d['rounds']} rounds, random drafter); loop: {d['loop']}; speculative vs target-only tokens: "
            f"{d.get('same_tokens')}"
        )
        + " |"
    )
    return rows


def render(report: dict) -> str:
    args, shapes = report["args"], report["shapes"]
    label = f" ({args['label']})" if args.get("label") else ""
    lines = [
        f"# Seed scale{label}: the seeds' job on one device",
        "",
        f"`python benchmarks/seed_scale.py {'--tiny ' if args['tiny'] else ''}--device {args['device']} "
        f"--shapes {args['shapes']} --parts {args['parts']} --checkpointing {args['checkpointing']}`",
        "",
        f"Versions: {report['versions']}. Sizes: {report['sizes']}. Wall: {_f(report.get('wall_s'))} s.",
        "",
        "| target | params | build s | allocated GiB | forward check | Gated DeltaNet path | feature fwd ms "
        "| fwd tokens/s |",
        "|---|---|---|---|---|---|---|---|",
        *[build_row(n, s.get("build", {})) for n, s in shapes.items()],
        "",
        "Training through the real trainer (`python -m trainer`: target + one drafter on the same device, "
        f"activation checkpointing {args['checkpointing']}); {SEEDS}:",
        "",
        "| target | startup s | first step s | steady step s | context tokens/s | block tokens/s "
        "| peak GiB | TFLOP/step target + drafter | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[train_row(n, s.get("train", {}), s.get("peak", {})) for n, s in shapes.items() if "train" in s],
        *[
            train_row(f"{n}, offline (drafter from the feature cache)", s["offline"], s.get("peak", {}))
            for n, s in shapes.items()
            if "offline" in s
        ],
        "",
        "| target | part | result |",
        "|---|---|---|",
        *[row for n, s in shapes.items() for row in data_rows(n, s)],
        "",
    ]
    return "\n".join(lines)
