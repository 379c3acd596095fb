"""Race regression harness: do drafter threads trip over torch.compile's global FX flag?

    python benchmarks/race_harness.py --mode all --trials 20 --threads 3 --timeout 300 \
        --device cuda:0 --out benchmarks/results/race.md [--recompile]

K independent trials per compile-lock mode. Each trial is a fresh process with fresh, EMPTY inductor
and triton cache directories (a warm cache hides the race), in which N drafter threads built from
the real trainer code (trainer.model.DFlashDrafter, trainer.masks.build_block_mask per step, the
trainer's compiled flex_attention, the fused DFlash loss, backward, trainer.compile_lock.CompileGuard)
start their first step together behind a barrier and meet at a barrier after every backward (where
the trainer averages gradients). `--recompile` changes the context length every step after step 0,
drafter i running i lengths ahead, so some threads recompile while others replay cached graphs.

Per mode it reports trials that raised the FX-tracing error, other errors (e.g. KeyError 'custom'
from create_block_mask), hangs (no result within --timeout; the child dumps its stacks first) and
clean trials, prints a table and writes it, with torch/CUDA/driver versions, the date and the exact
command, to --out (markdown; a JSON copy next to it).

Modes: lock (the fix), none (unprotected: must fail at least once, or the harness proves nothing),
patch (is_fx_symbolic_tracing monkeypatched), first-step (benchmarks.baselines: a lock around each thread's
first step only).
torch >= 2.12 hides the race by holding is_compiling() true for a whole compile session; there,
--emulate-old-torch restores the older behaviour. On CPU (smoke runs) flex_attention has no
backward, so trials run forward only under no_grad.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import faulthandler
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.baselines import GUARD_MODES, compile_guard  # noqa: E402
from benchmarks.common import doc_parser, fresh_compile_env, popen_text, versions  # noqa: E402

OUTCOMES = ("clean", "fx_tracing", "other_error", "hang")
RESULT_TAG = "TRIAL_RESULT "


# ---- one trial (child process) -----------------------------------------------------------------


def _drafter_setup(args, torch):
    """Small dims: a trial should cost seconds of compute, not minutes (compiles dominate)."""
    from trainer.model import DFlashDrafter, DrafterConfig

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = args.hidden, args.vocab
    embed = torch.nn.Embedding(vocab, hidden)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02, generator=gen)
        lm_head.weight.normal_(0, 0.02, generator=gen)
    cfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        target_layer_ids=[1, 2, 3],
        num_layers=args.layers,
        block_size=16,
    )
    embed, lm_head = embed.to(device, dtype), lm_head.to(device, dtype)
    replicas = []
    for _ in range(args.threads):
        torch.manual_seed(0)  # identical replicas, as in training
        replicas.append(DFlashDrafter(cfg, embed, lm_head).to(device, dtype))
    return cfg, replicas, dtype


def context_length(args, step: int, index: int) -> int:
    if not args.recompile or step == 0:
        return args.ctx
    return args.ctx + 128 * (step + index)  # drafter i runs i lengths ahead


def _install_compile(args, torch):
    """The compile guard of args.mode, installed before anything compiles, and the compiled
    flex_attention through args.compile_backend; with --emulate-old-torch, torch's compile session
    as older versions had it."""
    faulthandler.dump_traceback_later(max(5.0, args.timeout - 10), exit=False)  # stacks of a hang
    if args.emulate_old_torch and hasattr(torch.compiler, "_compile_session_context"):
        import contextlib

        # a deliberate patch of torch's internals: the compile session of older torch versions
        torch.compiler._compile_session_context = contextlib.nullcontext
    from trainer import model as model_module

    guard = compile_guard(args.mode).install()
    if args.compile_backend != "inductor":
        # Same ONE compiled flex_attention the trainer uses, through a cheaper backend.
        from torch.nn.attention.flex_attention import flex_attention

        model_module.use_compiled_flex_attention(
            torch.compile(flex_attention, backend=args.compile_backend, dynamic=False, fullgraph=True)
        )
    return guard


def _drafter_step(
    args, cfg, model, guard, name: str, step: int, index: int, gen, dtype, train: bool, torch
) -> float:
    """One training step of one replica as the trainer runs it; its seconds."""
    from trainer.loss import block_labels
    from trainer.masks import build_block_mask, sample_anchors

    ctx = context_length(args, step, index)
    input_ids = torch.randint(0, cfg.vocab_size - 1, (1, ctx), generator=gen).to(args.device)
    loss_mask = torch.ones(1, ctx, dtype=torch.bool, device=args.device)
    features = torch.randn(1, ctx, cfg.context_size, generator=gen).to(args.device, dtype)
    began = time.perf_counter()
    # The trainer draws blocks on its target thread (trainer.train.loop.make_block_drawer); here in the step.
    with guard.step(name, step, (ctx,)), torch.set_grad_enabled(train):
        anchors, valid = sample_anchors(loss_mask.cpu(), args.anchors, cfg.block_size, gen)
        anchors, valid = anchors.to(args.device), valid.to(args.device)
        mask = build_block_mask(anchors, valid, ctx, cfg.block_size, args.device)
        hidden = model(features, input_ids, anchors, mask, "flex")
        labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, cfg.block_size)
        loss, _ = model.loss(hidden, labels, label_mask, gamma=7.0)
        if train:
            loss.backward()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize(args.device)
    return round(time.perf_counter() - began, 3)


def _failure(name: str, step: int, exc: BaseException) -> dict:
    """A replica's failure as the trial reports it, with the race's own kinds told apart."""
    from trainer.compile_lock import is_fx_tracing_error

    text = str(exc)
    kind = (
        "fx_tracing"
        if is_fx_tracing_error(exc)
        else "key_error_custom"
        if isinstance(exc, KeyError) and "custom" in text
        else "other"
    )
    return {
        "thread": name,
        "step": step,
        "kind": kind,
        "type": type(exc).__name__,
        "message": (text.splitlines() or [""])[0][:300],
        "traceback": traceback.format_exc()[-2000:],
    }


def run_trial(args) -> dict:
    import torch

    guard = _install_compile(args, torch)
    cfg, replicas, dtype = _drafter_setup(args, torch)
    train = args.device.startswith("cuda")  # CPU: flex_attention refuses backward
    errors: list[dict] = []
    errors_lock = threading.Lock()
    start = threading.Barrier(args.threads)
    grad_sync = threading.Barrier(args.threads)  # where the trainer averages gradients
    first_step_s: dict[str, float] = {}

    def drafter(index: int) -> None:
        name = f"drafter{index}"
        model = replicas[index]
        gen = torch.Generator().manual_seed(1000 + index)
        step = -1
        try:
            start.wait(timeout=args.timeout)
            for step in range(args.steps):
                seconds = _drafter_step(args, cfg, model, guard, name, step, index, gen, dtype, train, torch)
                if step == 0:
                    first_step_s[name] = seconds
                grad_sync.wait(timeout=args.timeout)
                model.zero_grad(set_to_none=True)
        except threading.BrokenBarrierError:
            return  # another thread failed first; its error is the one that counts
        except BaseException as exc:  # noqa: BLE001 - a trial reports every failure
            with errors_lock:
                errors.append(_failure(name, step, exc))
            start.abort()
            grad_sync.abort()

    began = time.perf_counter()
    threads = [
        threading.Thread(target=drafter, args=(i,), name=f"drafter{i}", daemon=True)
        for i in range(args.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    faulthandler.cancel_dump_traceback_later()
    return {
        "mode": args.mode,
        "errors": errors,
        "compiles": guard.events,
        "first_step_s": first_step_s,
        "elapsed_s": round(time.perf_counter() - began, 3),
        "trained": train,
    }


# ---- the harness (parent process) --------------------------------------------------------------


def classify(result: dict | None, hung: bool) -> str:
    if hung:
        return "hang"
    if result is None:
        return "other_error"  # died without a result (crash, OOM kill ...)
    kinds = {e["kind"] for e in result["errors"]}
    if "fx_tracing" in kinds:
        return "fx_tracing"
    return "other_error" if kinds else "clean"


def trial_command(args, mode: str) -> list[str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--mode",
        mode,
        "--threads",
        str(args.threads),
        "--timeout",
        str(args.timeout),
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--ctx",
        str(args.ctx),
        "--anchors",
        str(args.anchors),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
        "--compile-backend",
        args.compile_backend,
    ]
    if args.recompile:
        cmd.append("--recompile")
    if args.emulate_old_torch:
        cmd.append("--emulate-old-torch")
    return cmd


def run_one(args, mode: str, index: int) -> dict:
    """A fresh process with fresh empty caches; killed (with its children) at --timeout."""
    scratch = tempfile.mkdtemp(prefix=f"race-{mode}-{index}-")
    env = fresh_compile_env(scratch, PYTHONUNBUFFERED="1")
    began = time.monotonic()
    proc = popen_text(trial_command(args, mode), env, start_new_session=True)
    hung = False
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = None
    for line in (out or "").splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
    outcome = classify(result, hung)
    first_error = ""
    if result and result["errors"]:
        e = result["errors"][0]
        first_error = f"{e['thread']} step {e['step']}: {e['type']}: {e['message']}"
    elif outcome != "clean":
        first_error = (
            (err or "").strip().splitlines()[-1][:300] if (err or "").strip() else f"rc {proc.returncode}"
        )
    return {
        "mode": mode,
        "trial": index,
        "outcome": outcome,
        "seconds": round(time.monotonic() - began, 1),
        "first_error": first_error,
        "compiles": len(result["compiles"]) if result else None,
        "first_step_s": result.get("first_step_s") if result else None,
        "error_kinds": sorted({e["kind"] for e in result["errors"]}) if result else [],
        "stderr_tail": (err or "")[-3000:] if outcome != "clean" else "",
    }


def summarise(rows: list[dict], modes: list[str]) -> list[dict]:
    table = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        counts = {o: sum(r["outcome"] == o for r in mine) for o in OUTCOMES}
        table.append(
            {
                "mode": mode,
                "trials": len(mine),
                **counts,
                "key_error_custom": sum("key_error_custom" in r["error_kinds"] for r in mine),
                "failed": len(mine) - counts["clean"],
                "median_trial_s": sorted(r["seconds"] for r in mine)[len(mine) // 2] if mine else None,
            }
        )
    return table


def render(table: list[dict], rows: list[dict], info: dict, command: str, args) -> str:
    lines = [
        f"# FX-tracing race harness — {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "",
        f"Command: `{command}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        f"Setup: {args.threads} drafter threads on {args.device}, {args.steps} steps, context {args.ctx}"
        f"{' (+128 per step after step 0, staggered per thread)' if args.recompile else ''}, "
        f"{args.anchors} anchors, hidden {args.hidden}, {args.layers} layers, compile backend "
        f"{args.compile_backend}, fresh empty inductor/triton caches per trial, per-trial limit "
        f"{args.timeout} s, {args.parallel} trial(s) at a time"
        f"{', old-torch emulation' if args.emulate_old_torch else ''}.",
        "",
        "| mode | trials | clean | FX-tracing error | other error | of which KeyError 'custom' | hang "
        "| failed | median trial s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['mode']} | {t['trials']} | {t['clean']} | {t['fx_tracing']} | {t['other_error']} "
            f"| {t['key_error_custom']} | {t['hang']} | {t['failed']} | {t['median_trial_s']} |"
        )
    lines += [
        "",
        "Trials:",
        "",
        "| mode | # | outcome | s | compiles | first-step s per thread | first error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = json.dumps(r["first_step_s"]) if r["first_step_s"] else ""
        lines.append(
            f"| {r['mode']} | {r['trial']} | {r['outcome']} | {r['seconds']} | {r['compiles']} "
            f"| {first} | {r['first_error'].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def print_table(table: list[dict]) -> None:
    header = (
        f"{'mode':<11} {'trials':>6} {'clean':>6} {'fx_err':>6} {'other':>6} {'keyerr':>6} {'hang':>5} "
        f"{'failed':>6}"
    )
    print(header)
    for t in table:
        print(
            f"{t['mode']:<11} {t['trials']:>6} {t['clean']:>6} {t['fx_tracing']:>6} {t['other_error']:>6} "
            f"{t['key_error_custom']:>6} {t['hang']:>5} {t['failed']:>6}"
        )


def verdict(table: list[dict]) -> list[str]:
    """The harness's self-check: the unprotected run must fail, the lock must not."""
    problems = []
    for t in table:
        if t["mode"] == "none" and t["trials"] and t["failed"] == 0:
            problems.append(
                "mode none never failed: this run cannot tell a fix from luck "
                "(warm cache? torch >= 2.12 without --emulate-old-torch?)"
            )
        if t["mode"] == "lock" and t["failed"]:
            problems.append(f"mode lock failed {t['failed']} of {t['trials']} trials")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = doc_parser(__doc__)
    parser.add_argument(
        "--mode",
        default="all",
        choices=GUARD_MODES + ("all",),
        help="all = none, lock, patch (first-step only when named)",
    )
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="per trial, seconds; past it = hang")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", help="markdown results file (a .json copy is written next to it)")
    parser.add_argument("--parallel", type=int, default=1, help="trials running at once (own processes)")
    parser.add_argument("--recompile", action="store_true", help="new context length every step after 0")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=512, help="context length at step 0")
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument(
        "--emulate-old-torch",
        action="store_true",
        help="null torch.compiler._compile_session_context (torch >= 2.12 hides the race)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.trials, args.threads, args.steps, args.parallel) < 1:
        parser.error("--trials, --threads, --steps and --parallel must be >= 1")

    if args.child:
        if args.mode == "all":
            parser.error("--child runs one mode")
        print(RESULT_TAG + json.dumps(run_trial(args)), flush=True)
        return 0

    command = shlex.join(
        [
            os.path.relpath(sys.argv[0]) if argv is None else "benchmarks/race_harness.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    modes = ["none", "lock", "patch"] if args.mode == "all" else [args.mode]
    info = versions(args.device)
    print(f"race harness: {args.trials} trials x {modes} on {args.device} ({info})", flush=True)
    rows = []
    # Trials are independent processes; --parallel runs several at once (compiles are CPU-bound).
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for mode in modes:
            futures = [pool.submit(run_one, args, mode, index) for index in range(args.trials)]
            for future in concurrent.futures.as_completed(futures):
                row = future.result()
                rows.append(row)
                print(
                    f"  {mode:<10} trial {row['trial'] + 1}/{args.trials}: {row['outcome']:<12} "
                    f"{row['seconds']:>6} s  {row['first_error'][:100]}",
                    flush=True,
                )
    rows.sort(key=lambda r: (modes.index(r["mode"]), r["trial"]))
    table = summarise(rows, modes)
    print()
    print_table(table)
    problems = verdict(table)
    for problem in problems:
        print("CHECK:", problem)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(render(table, rows, info, command, args))
            if problems:
                fh.write("\nChecks that failed:\n\n" + "".join(f"- {p}\n" for p in problems))
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump({"command": command, "versions": info, "summary": table, "trials": rows}, fh, indent=1)
        print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
