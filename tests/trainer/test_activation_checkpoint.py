"""Activation checkpointing of drafter layers: the same numbers, less kept, recompute under the lock."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.trainer.test_model import BLOCK, make_batch, make_drafter, run_sdpa
from trainer.compile_lock import carry_step
from trainer.config import ConfigError, load_config
from trainer.loss import block_labels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIAL = os.path.join(REPO, "tests", "trainer", "lock_trial.py")


def loss_and_grads(checkpointed: bool):
    drafter = make_drafter(seed=3, num_layers=3)
    drafter.checkpoint_layers = checkpointed
    context, input_ids, anchors, valid = make_batch(seed=4)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    forwards = []
    for layer in drafter.layers:
        layer.register_forward_pre_hook(lambda *_: forwards.append(1))  # recompute may stop early
    hidden = run_sdpa(drafter, context, input_ids, anchors, valid)
    labels, label_mask = block_labels(input_ids, loss_mask, anchors, valid, BLOCK)
    loss, _ = drafter.loss(hidden, labels, label_mask, gamma=4.0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    return loss.detach(), grads, len(forwards)


def test_checkpointed_layers_give_the_same_loss_and_gradients_fp32():
    loss_plain, grads_plain, forwards_plain = loss_and_grads(False)
    loss_ckpt, grads_ckpt, forwards_ckpt = loss_and_grads(True)
    assert (forwards_plain, forwards_ckpt) == (3, 6)  # each layer ran again in backward
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=1e-7)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        assert grads_plain[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_recompute_runs_under_the_forwards_autocast():
    """bf16 autocast is entered in the drafter thread; the recompute must see it too, or it would
    rebuild fp32 activations the backward does not expect."""
    results = {}
    for checkpointed in (False, True):
        drafter = make_drafter(seed=5, num_layers=2)
        drafter.checkpoint_layers = checkpointed
        context, input_ids, anchors, valid = make_batch(seed=6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = run_sdpa(drafter, context, input_ids, anchors, valid)
        hidden.float().pow(2).mean().backward()  # outside the autocast block, as in training
        results[checkpointed] = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    for name, grad in results[False].items():
        torch.testing.assert_close(results[True][name], grad, rtol=0, atol=0, msg=name)


def test_no_recompute_without_autograd():
    drafter = make_drafter(num_layers=2)
    drafter.checkpoint_layers = True
    context, input_ids, anchors, valid = make_batch()
    with torch.no_grad():
        plain = run_sdpa(drafter, context, input_ids, anchors, valid)
    drafter.checkpoint_layers = False
    with torch.no_grad():
        assert torch.equal(plain, run_sdpa(drafter, context, input_ids, anchors, valid))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backward needs a GPU")
def test_cuda_checkpointed_compiled_flex_gives_the_same_loss_and_gradients():
    """The recompute re-enters the compiled flex_attention in the GPU's autograd thread."""
    from tests.trainer.test_model import CTX
    from trainer.masks import build_block_mask

    device = "cuda"
    context, input_ids, anchors, valid = (t.to(device) for t in make_batch(seed=9, pad_blocks=1))
    labels, label_mask = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool), anchors, valid, BLOCK)
    results = {}
    for checkpointed in (False, True):
        drafter = make_drafter(seed=2, head_dim=16).to(device)  # fp32; flex kernels need head_dim >= 16
        drafter.checkpoint_layers = checkpointed
        mask = build_block_mask(anchors, valid, CTX, BLOCK, device)
        loss, _ = drafter.loss(drafter(context, input_ids, anchors, mask, backend="flex"), labels, label_mask, 7.0)
        loss.backward()
        results[checkpointed] = (loss.detach(), {n: p.grad for n, p in drafter.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


# ---- config --------------------------------------------------------------------------------

def test_config_defaults_and_choices():
    cfg = load_config("tiny-cpu", {"train.activation_checkpointing": "layers",
                                   "run.compile_mode": "max-autotune-no-cudagraphs"})
    assert cfg.train.activation_checkpointing == "layers"
    default = load_config("tiny-cpu", {})
    assert default.train.activation_checkpointing == "none" and default.run.compile_mode == "default"
    assert default.run.stop_grace_s > 0


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_modes_are_refused_with_the_reason(mode):
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", {"run.compile_mode": mode})
    text = str(err.value)
    assert "`run.compile_mode`" in text and "CUDA graph" in text and "default" in text


def test_unknown_checkpointing_names_the_key_and_choices():
    with pytest.raises(ConfigError, match=r"`train.activation_checkpointing` must be one of none, layers"):
        load_config("tiny-cpu", {"train.activation_checkpointing": "all"})


# ---- the compile lock and the recompute, in process ---------------------------------------------

def _recompute_elsewhere(guard, events, devices: tuple[str, str], new_length: int):
    """Step a (shared, on devices[0]) has a checkpointed function whose recompute runs in another
    thread - as a GPU's autograd worker runs it - and compiles there, while step b (devices[1]) is
    inside the guard. Returns (events, order of 'b leaves' / 'compile starts')."""
    # one code object for both tests: each uses its own new length
    compiled = torch.compile(lambda x: torch.tanh(x) * 2, backend="eager", dynamic=False)
    for name, dev in zip(("a", "b"), devices):
        with guard.step(name, 0, (1,), device=dev):
            compiled(torch.randn(2))  # compiled in an exclusive first step
    events.clear()
    b_inside, release_b, a_ready = threading.Event(), threading.Event(), threading.Event()
    order, carried = [], {}

    def step_b():
        with guard.step("b", 1, (1,), device=devices[1]):
            b_inside.set()
            release_b.wait(10)
            order.append("b leaves")

    def step_a():
        with guard.step("a", 1, (1,), device=devices[0]):
            fn = carry_step(lambda x: compiled(x))
            fn(torch.randn(2))  # the forward: cached, nothing compiles
            carried["fn"] = fn
            a_ready.set()
            worker.join(20)  # like loss.backward(): wait for the autograd thread

    def autograd_thread():
        a_ready.wait(10)
        carried["fn"](torch.randn(new_length))  # the recompute: a new shape, so it compiles here
        order.append("recompute done")

    thread_b = threading.Thread(target=step_b, daemon=True)
    thread_b.start()
    assert b_inside.wait(5)
    worker = threading.Thread(target=autograd_thread, name="autograd-worker", daemon=True)
    thread_a = threading.Thread(target=step_a, daemon=True)
    worker.start()
    thread_a.start()
    assert a_ready.wait(10)
    worker.join(1.0)
    finished_before_b = "recompute done" in order
    release_b.set()
    for thread in (thread_a, thread_b, worker):
        thread.join(20)
    recompiles = [e for e in events if e["phase"] == "recompute"]
    return recompiles, order, finished_before_b


def test_a_recompile_in_another_threads_recompute_waits_and_is_logged(installed_guard):
    guard, events = installed_guard
    recompiles, order, finished_before_b = _recompute_elsewhere(guard, events, ("cuda:1", "cuda:2"), 5)
    assert not finished_before_b, "the recompute compiled while step b was inside the guard"
    assert order == ["b leaves", "recompute done"]
    assert len(recompiles) == 1, events
    event = recompiles[0]
    assert (event["thread"], event["step"], event["reason"], event["exclusive"]) == ("a", 1, "unpredicted", True)
    assert event["os_thread"] == "autograd-worker"
    # every thread's next step is exclusive again after an unpredicted compile
    with guard.step("b", 2, (1,), device="cuda:2"):
        assert guard._lock.writer is not None


def test_a_recompute_beside_steps_on_its_own_gpu_does_not_wait_for_itself(installed_guard):
    """Step b's backward would queue on the same autograd thread: waiting would deadlock."""
    guard, events = installed_guard
    recompiles, order, finished_before_b = _recompute_elsewhere(guard, events, ("cuda:0", "cuda:0"), 7)
    assert finished_before_b and order == ["recompute done", "b leaves"]
    event = recompiles[0]
    assert (event["thread"], event["reason"], event["exclusive"]) == ("a", "recompute_beside_same_device_steps", False)
    from trainer.compile_lock import compile_reason

    assert compile_reason(event) == "recompute_beside_same_device_steps, in checkpoint recompute, NOT exclusive"
    with guard.step("a", 2, (1,), device="cuda:0"):
        assert guard._lock.writer is not None


# ---- the race in checkpoint recompute, end to end (fresh processes, older-torch emulation) -------

RECOMPUTE_TRIAL = ("race", "--checkpoint", "--recompile-in-recompute", "--repeat", "100", "--steps", "2",
                   "--micro", "6", "--layers", "3")


def _start_trial(tmp_path, mode: str) -> subprocess.Popen:
    cache = tmp_path / f"cache-{mode}-{time.monotonic_ns()}"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
               PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, TRIAL, *RECOMPUTE_TRIAL, "--mode", mode], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float = 240) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"hang": True, "errors": [{"kind": "hang", "step": None}], "compiles": []}
    for line in out.splitlines():
        if line.startswith("TRIAL_RESULT "):
            return json.loads(line[len("TRIAL_RESULT "):])
    raise AssertionError(f"trial printed no result (rc {proc.returncode}):\n{err[-3000:]}")


@pytest.mark.slow  # two trial processes side by side, ~35 s on two busy cores
def test_recompiles_in_checkpoint_recompute_race_unless_the_full_lock_covers_them(tmp_path):
    """Each step after the first compiles only inside its backward (checkpoint recompute).

    With the lock around each thread's first step only, those compiles race the other threads'
    cached forwards (FX-tracing error at step >= 1). The full lock upgrades the recompute's shared
    step to exclusive: clean, every compile alone, each logged with phase "recompute"."""
    baseline, locked = _start_trial(tmp_path, "first-step"), _start_trial(tmp_path, "lock")
    result, unprotected = _result(locked), _result(baseline)
    if not unprotected["errors"]:  # the race is timing-dependent: one more chance
        unprotected = _result(_start_trial(tmp_path, "first-step"))
    assert unprotected["errors"], "recompute compiles never raced without the full lock: the trial proves nothing"
    assert all(e["kind"] in ("fx_tracing", "hang") and (e["step"] is None or e["step"] >= 1)
               for e in unprotected["errors"]), unprotected["errors"]

    assert result["errors"] == [], result["errors"]
    compiles = result["compiles"]
    assert all(c["exclusive"] for c in compiles), [c for c in compiles if not c["exclusive"]]
    in_recompute = [c for c in compiles if c["phase"] == "recompute" and c["step"] >= 1]
    assert in_recompute and {"unpredicted"} <= {c["reason"] for c in in_recompute}, compiles
    assert all(c["thread"].startswith("drafter") for c in compiles)
