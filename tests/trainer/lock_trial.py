"""One race trial in a fresh process (run by test_compile_lock.py; usable by hand).

    python tests/trainer/lock_trial.py race --mode none|first-step|lock|patch [--hide-shapes]
    python tests/trainer/lock_trial.py race --mode lock --checkpoint --recompile-in-recompute --repeat 100
    python tests/trainer/lock_trial.py flag --mode none|patch|lock [--through-guard]
    python tests/trainer/lock_trial.py masks --guard none|lock --compiles 12

Prints one line `TRIAL_RESULT {json}` and exits 0 when the trial itself could run, whatever the
race did; the caller decides what counts. A hang is the caller's timeout. Give every trial a fresh
empty TORCHINDUCTOR_CACHE_DIR: a warm cache can hide the race.

The race needs a thread to CALL compiled code while another thread is inside AOTAutograd's make_fx.
torch 2.13 hides it by holding `torch.compiler.is_compiling()` (a process-global flag) true for a
whole compile session; the trial swaps that session context for a null one (older-torch behaviour,
`--no-emulate-old-torch` to keep 2.13's). flex_attention backward is refused on CPU, so each layer
runs a compiled flex_attention forward on detached q/k/v (an inference-graph make_fx) and a
compiled norm+MLP layer with backward (a joint-graph make_fx): both trace with the FX flag set.

What makes it bite (measured): the flag is set for only ~5-20 % of a compile, late in it, after
dynamo's own tracing. A victim must be running cached compiled calls at that moment, so steps do
gradient accumulation over several micro-batches (a cached step lasts about as long as a compile)
and the drafters walk the shape schedule staggered (drafter i is i shapes ahead): at every step one
drafter compiles a new shape while the others replay cached ones.

`--checkpoint` runs each layer through torch.utils.checkpoint (non-reentrant) with the trainer's
compile_lock.carry_step, as trainer.activation_checkpoint does. `--recompile-in-recompute` passes
the compiled layer an int that differs in the recompute (a guard failure only there), so every
thread's every step compiles inside its backward while the others run cached forwards.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch.utils.checkpoint import checkpoint  # noqa: E402

from benchmarks.baselines import GUARD_MODES, compile_guard  # noqa: E402
from trainer.compile_lock import (  # noqa: E402
    COMPILE_LOCK_MODES,
    MASK_LOCK,
    CompileGuard,
    carry_step,
    is_fx_tracing_error,
)

HEADS, HEAD_DIM = 2, 16
WIDTH = HEADS * HEAD_DIM
# A new sequence length every other step (dynamic=False): steps 0, 2, 4 ... recompile, like a shape
# change or guard failure after step 0 would in training; the steps between are cache hits.
SEQ_LENGTHS = (32, 64, 96, 128, 160, 192, 224, 256)


def seq_len_at(step: int, repeat: int) -> int:
    return SEQ_LENGTHS[(step // repeat) % len(SEQ_LENGTHS)]


def emulate_old_torch() -> None:
    if hasattr(torch.compiler, "_compile_session_context"):
        torch.compiler._compile_session_context = contextlib.nullcontext


def causal(b, h, q, k):
    return q >= k


def build_mask(seq: int, use_lock: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    with MASK_LOCK if use_lock else contextlib.nullcontext():
        return create_block_mask(causal, 1, 1, seq, seq, device="cpu")


def layer(h, w_in, w_out, attn, tag: int = 0):
    """A decoder-ish layer: norm, SwiGLU-ish MLP, residual; `attn` (no grad) mixed in.

    `tag` changes nothing but the guards: a new value is a recompile."""
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    up = normed @ w_in
    return h + (F.silu(up) * up.sigmoid()) @ w_out + attn * (1 + 0 * tag)


def recompute_tagged(fn, tag: int):
    """fn(*args, tag=0) on its first call (the forward), fn(*args, tag=tag) on later ones (recompute)."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        return fn(*args, tag=0 if calls[0] == 1 else tag)

    return run


def run_together(threads: list[threading.Thread]) -> None:
    """Start every thread, then wait for all of them."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_race(args) -> dict:
    if args.emulate_old_torch:
        emulate_old_torch()
    guard = compile_guard(args.mode).install()
    # Created after install(): the patch mode must be in place before torch.compile wraps.
    from torch.nn.attention.flex_attention import flex_attention

    compiled_flex = torch.compile(flex_attention, backend="aot_eager", dynamic=False)
    compiled_layer = torch.compile(layer, backend="aot_eager", dynamic=False)

    def one_layer(h, w_in, w_out, block_mask, tag: int = 0):
        seq = h.shape[1]
        q = h.detach().view(1, seq, HEADS, HEAD_DIM).transpose(1, 2)
        attn = compiled_flex(q, q, q, block_mask=block_mask)
        return compiled_layer(h, w_in, w_out, attn.transpose(1, 2).reshape(1, seq, WIDTH), tag)

    errors: list[dict] = []
    errors_lock = threading.Lock()
    start = threading.Barrier(args.threads)
    grad_sync = threading.Barrier(args.threads)  # stands in for gradient averaging

    def drafter(index: int) -> None:
        name = f"drafter{index}"
        torch._dynamo.config.recompile_limit = 64  # dynamo's config is per thread on torch 2.13
        gen = torch.Generator().manual_seed(index)
        weights = [
            (
                (torch.randn(WIDTH, 2 * WIDTH, generator=gen) / WIDTH**0.5).requires_grad_(),
                (torch.randn(2 * WIDTH, WIDTH, generator=gen) / WIDTH**0.5).requires_grad_(),
            )
            for _ in range(args.layers)
        ]
        step = -1
        try:
            start.wait(timeout=120)
            for step in range(args.steps):
                seq = seq_len_at(step + index * args.stagger, args.repeat)
                block_mask = build_mask(seq, use_lock=not args.no_mask_lock)
                x = torch.randn(1, seq, WIDTH, generator=gen)
                # --hide-shapes: the guard is not told about shape changes and must catch the
                # recompiles as they start.
                shape_key = () if args.hide_shapes else (seq,)
                with guard.step(name, step, shape_key=shape_key):
                    # Compiled calls per layer, as in the drafter: after the first layer they
                    # are cache hits, the calls that meet another thread's tracing.
                    # Gradient accumulation over micro-batches keeps a cached step busy for
                    # about as long as another thread needs to reach make_fx in its compile.
                    for _micro in range(args.micro):
                        h = x
                        for w_in, w_out in weights:
                            if args.checkpoint:
                                tag = 1 + step if args.recompile_in_recompute else 0
                                run = carry_step(recompute_tagged(one_layer, tag))
                                h = checkpoint(run, h, w_in, w_out, block_mask, use_reentrant=False,
                                               preserve_rng_state=False)
                            else:
                                h = one_layer(h, w_in, w_out, block_mask)
                        h.pow(2).mean().backward()
                grad_sync.wait(timeout=300)
        except threading.BrokenBarrierError:
            return  # another thread failed first; its error is the one that counts
        except BaseException as exc:  # noqa: BLE001 - a trial reports every failure
            kind = race_kind(exc)
            with errors_lock:
                errors.append(
                    {
                        "thread": name,
                        "step": step,
                        "kind": kind,
                        "type": type(exc).__name__,
                        "message": str(exc).splitlines()[0][:300] if str(exc) else "",
                        "traceback": "".join(traceback.format_exception(exc))[-1500:],
                    }
                )
            start.abort()
            grad_sync.abort()

    began = time.perf_counter()
    threads = [threading.Thread(target=drafter, args=(i,), name=f"drafter{i}") for i in range(args.threads)]
    run_together(threads)
    return {
        "mode": args.mode,
        "emulate_old_torch": args.emulate_old_torch,
        "torch": torch.__version__,
        "errors": errors,
        "compiles": guard.events,
        "elapsed_s": round(time.perf_counter() - began, 3),
        "compile_hook": guard.compile_hook,
    }


def run_flag(args) -> dict:
    """Deterministic: the stuck global FX flag makes a compiled call raise, unless patched."""
    guard = CompileGuard(args.mode).install()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager")
    compiled(torch.randn(3))  # compiled while the flag is clear
    import torch.fx._symbolic_trace as symbolic_trace

    symbolic_trace._is_fx_tracing_flag = True
    outcome: dict = {"mode": args.mode}
    try:
        if args.through_guard:
            with guard.step("drafter0", 0, shape_key=(3,)):
                compiled(torch.randn(3))
        else:
            compiled(torch.randn(3))
        outcome["raised"] = None
    except Exception as exc:  # noqa: BLE001
        outcome["raised"] = type(exc).__name__
        outcome["fx_tracing_error"] = is_fx_tracing_error(exc)
        outcome["message"] = str(exc).splitlines()[0][:300]
    finally:
        symbolic_trace._is_fx_tracing_flag = False
    return outcome


def race_kind(exc: BaseException) -> str:
    """Which symptom of compiling in one thread while another steps: "fx_tracing" (the global FX flag
    seen set), "mask_race" (`KeyError: 'custom'`: a compile swapped the annotate dict under a
    block-mask build, see run_masks), else "other"."""
    if is_fx_tracing_error(exc):
        return "fx_tracing"
    if isinstance(exc, KeyError) and exc.args == ("custom",):
        return "mask_race"
    return "other"


def run_masks(args) -> dict:
    """create_block_mask in several threads (always under MASK_LOCK, as trainer.masks does it),
    optionally next to a thread that keeps compiling new shapes.

    Builders alone do not collide on this torch (the annotate check-and-set runs under the GIL);
    a compile in another thread swaps the global `current_meta` dict under a builder's feet and
    gives `KeyError: 'custom'`, unless compiles also hold MASK_LOCK (CompileGuard mode "lock").
    """
    guard = CompileGuard(args.guard).install()
    errors: list[str] = []
    done = threading.Event()
    start = threading.Barrier(args.threads + (1 if args.compiles else 0))

    def builder(index: int) -> None:
        start.wait(timeout=60)
        i = 0
        while i < args.iters or (args.compiles and not done.is_set()):
            try:
                build_mask(128 + 128 * ((i + index) % 4), use_lock=not args.no_lock)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")
            i += 1

    def compiler() -> None:
        compiled = torch.compile(lambda x: F.silu(x @ x.T).sum(-1), backend="aot_eager", dynamic=False)
        start.wait(timeout=60)
        try:
            for n in range(args.compiles):
                compiled(torch.randn(8 + n, 16, requires_grad=True)).sum().backward()
        finally:
            done.set()

    threads = [threading.Thread(target=builder, args=(i,)) for i in range(args.threads)]
    if args.compiles:
        threads.append(threading.Thread(target=compiler))
    run_together(threads)
    return {
        "guard": args.guard,
        "mask_lock": not args.no_lock,
        "compiles": len(guard.events),
        "errors": len(errors),
        "key_errors": sum(e.startswith("KeyError") for e in errors),
        "examples": sorted(set(errors))[:3],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    race = sub.add_parser("race")
    race.add_argument("--mode", default="lock", choices=GUARD_MODES)
    race.add_argument("--threads", type=int, default=3)
    race.add_argument("--steps", type=int, default=5)
    race.add_argument("--repeat", type=int, default=1, help="steps per sequence length")
    race.add_argument(
        "--stagger", type=int, default=1,
        help="drafter i starts i*STAGGER steps ahead in the shape schedule, so at each step some "
        "threads compile while others run cached compiled calls",
    )
    race.add_argument("--layers", type=int, default=4, help="layers (2 compiled calls each)")
    race.add_argument("--micro", type=int, default=10, help="micro-batches per step")
    race.add_argument("--hide-shapes", action="store_true", help="constant shape_key for the guard")
    race.add_argument("--no-mask-lock", action="store_true")
    race.add_argument("--checkpoint", action="store_true", help="checkpoint each layer (recompute in backward)")
    race.add_argument("--recompile-in-recompute", action="store_true",
                      help="with --checkpoint: the recompute meets a guard failure and compiles")
    race.add_argument("--no-emulate-old-torch", dest="emulate_old_torch", action="store_false")
    flag = sub.add_parser("flag")
    flag.add_argument("--mode", default="none", choices=COMPILE_LOCK_MODES)
    flag.add_argument("--through-guard", action="store_true")
    masks = sub.add_parser("masks")
    masks.add_argument("--threads", type=int, default=4)
    masks.add_argument("--iters", type=int, default=200)
    masks.add_argument("--no-lock", action="store_true", help="builders skip MASK_LOCK")
    masks.add_argument("--compiles", type=int, default=0, help="a thread compiling N new shapes")
    masks.add_argument("--guard", default="lock", choices=COMPILE_LOCK_MODES)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval (default: Python's own, 5 ms)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # several trials share two cores
    # Every step may bring a new shape: stay compiled rather than fall back to eager after 8.
    torch._dynamo.config.recompile_limit = 64
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    result = {"race": run_race, "flag": run_flag, "masks": run_masks}[args.what](args)
    print("TRIAL_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
