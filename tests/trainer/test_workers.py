"""Worker threads: gradients averaged and clipped, replicas stay identical, a failure stops everything."""
from __future__ import annotations

import copy
import threading
import time
import types

import pytest
import torch

from trainer.compile_lock import CompileGuard
from trainer.config import load_config
from trainer.data.dataset import BatchPlan, make_batch
from trainer.train.loop import (
    build_dataset, build_replicas, drafter_config, make_block_drawer, make_loss_fn, train,
)
from trainer.data.target import load_target
from trainer.train.workers import TrainingWorkers, WorkerFailure

pytestmark = pytest.mark.timeout(120)  # a hang is a failure, not a stuck CI job

SMALL = {
    "data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 30, "train.batch_size": 2, "train.num_anchors": 6,
    "run.torch_threads": 1, "run.log_every": 1000,
}


def tiny_cfg(tmp_path, **extra):
    overrides = dict(SMALL, output_dir=str(tmp_path / "run"))
    overrides.update(extra)
    return load_config("tiny-cpu", overrides)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Real tiny target, synthetic data and two CPU drafter replicas (built like train() does)."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("w"))
    torch.set_num_threads(1)
    target = load_target(cfg.target.spec, "cpu", torch.float32, layer_ids=cfg.target.layer_ids,
                         tiny=cfg.target.tiny)
    dataset = build_dataset(cfg, target)
    return cfg, target, dataset


def make_workers(parts, compute_loss=None, target=None, replicas=2):
    cfg, real_target, dataset = parts
    target = target or real_target
    cfg.run.drafter_devices = ["cpu"] * replicas
    plan = BatchPlan(len(dataset), cfg.train.batch_size, replicas, cfg.train.seed)
    reps = build_replicas(cfg, drafter_config(cfg, real_target), real_target, total_steps=20)
    guard = CompileGuard("lock")
    workers = TrainingWorkers(targets=[target], replicas=reps, dataset=dataset, plan=plan,
                              compute_loss=compute_loss or make_loss_fn(cfg), draw_blocks=make_block_drawer(cfg),
                              guard=guard,
                              grad_clip=cfg.train.grad_clip, feature_dtype=torch.float32)
    return workers, reps


def test_barrier_action_averages_then_clips_and_copies_to_every_replica(parts):
    workers, reps = make_workers(parts)
    workers.grad_clip = 0.5
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for rep, gen in zip(reps, gens):
        for p in rep.trainable():
            p.grad = torch.randn(p.shape, generator=gen)
    # expected, computed the plain way: elementwise mean, then torch's own clip_grad_norm_
    mean = [(a.grad + b.grad) / 2 for a, b in zip(reps[0].trainable(), reps[1].trainable())]
    holders = [torch.nn.Parameter(torch.zeros_like(m)) for m in mean]
    for h, m in zip(holders, mean):
        h.grad = m.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(holders, 0.5)  # returns the norm before clipping

    workers._average_gradients()

    assert workers._grad_norm == pytest.approx(float(expected_norm), rel=1e-5)
    assert float(expected_norm) > 0.5  # so clipping really happened
    for rep in reps:
        for p, h in zip(rep.trainable(), holders):
            torch.testing.assert_close(p.grad, h.grad)
    assert all(a.grad.data_ptr() != b.grad.data_ptr() for a, b in zip(reps[0].trainable(), reps[1].trainable()))


def test_one_replica_is_clipped_in_place_with_no_gradient_copy(parts):
    workers, reps = make_workers(parts, replicas=1)
    workers.grad_clip = 0.5
    gen = torch.Generator().manual_seed(5)
    for p in reps[0].trainable():
        p.grad = torch.randn(p.shape, generator=gen)
    holders = [torch.nn.Parameter(torch.zeros_like(p)) for p in reps[0].trainable()]
    for h, p in zip(holders, reps[0].trainable()):
        h.grad = p.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(holders, 0.5)
    before = [p.grad.data_ptr() for p in reps[0].trainable()]

    workers._average_gradients()

    assert workers._grad_norm == pytest.approx(float(expected_norm), rel=1e-5) and float(expected_norm) > 0.5
    assert [p.grad.data_ptr() for p in reps[0].trainable()] == before  # scaled where it was
    for p, h in zip(reps[0].trainable(), holders):
        torch.testing.assert_close(p.grad, h.grad)


def test_with_fused_adamw_the_clip_is_the_optimizers_grad_scale_and_makes_no_pass_of_its_own(parts):
    """The barrier leaves the averaged gradient as it is and hands each fused AdamW the divisor; the
    step then lands where torch's clip_grad_norm_ and a plain AdamW step land."""
    workers, reps = make_workers(parts)
    workers.grad_clip = 0.5
    for rep in reps:
        rep.optimizer = torch.optim.AdamW(rep.trainable(), lr=1e-2, weight_decay=0.1, fused=True)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for rep, gen in zip(reps, gens):
        for p in rep.trainable():
            p.grad = torch.randn(p.shape, generator=gen)
    mean = [(a.grad + b.grad) / 2 for a, b in zip(reps[0].trainable(), reps[1].trainable())]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in reps[0].trainable()]
    for r, m in zip(reference, mean):
        r.grad = m.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    assert float(expected_norm) > 0.5  # so clipping really happens

    workers._average_gradients()

    for rep in reps:
        assert float(rep.optimizer.grad_scale) == pytest.approx(float(expected_norm) / 0.5, rel=1e-5)
        for p, m in zip(rep.trainable(), mean):
            torch.testing.assert_close(p.grad, m)  # not scaled: AdamW divides in its own pass
        rep.optimizer.step()
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    plain.step()
    for rep in reps:
        for p, r in zip(rep.trainable(), reference):
            torch.testing.assert_close(p.detach(), r.detach())


def test_two_drafter_threads_keep_identical_replicas(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=6)
    target = load_target(cfg.target.spec, "cpu", torch.float32, layer_ids=cfg.target.layer_ids,
                         tiny=cfg.target.tiny)
    initial = build_replicas(cfg, drafter_config(cfg, target), target, 6)[0].model.state_dict()
    result = train(cfg, out=_Sink())
    assert result.steps_done == 6 and len(result.replicas) == 2
    first, second = (r.model.state_dict() for r in result.replicas)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    moved = [name for name in first if not torch.equal(first[name], initial[name])]
    assert len(moved) == len(first)  # every weight trained; identical because grads were shared
    opt_a, opt_b = (r.optimizer.state_dict()["state"] for r in result.replicas)
    for index in opt_a:
        assert torch.equal(opt_a[index]["exp_avg"], opt_b[index]["exp_avg"])


def test_an_exception_in_one_drafter_thread_stops_all_threads(parts):
    cfg = parts[0]
    real = make_loss_fn(cfg)

    def failing(replica, batch):
        if replica.index == 1 and batch.step == 2:
            raise ValueError("boom in drafter 1")
        return real(replica, batch)

    workers, _ = make_workers(parts, compute_loss=failing)
    started = time.monotonic()
    with workers:
        workers.start(0, 10)
        workers.run_step(0)
        workers.run_step(1)
        with pytest.raises(WorkerFailure) as err:
            workers.run_step(2)
    assert err.value.thread == "drafter1"
    assert isinstance(err.value.original, ValueError) and "boom in drafter 1" in str(err.value)
    assert "failing" in err.value.traceback_text  # the worker's own traceback travels with it
    assert time.monotonic() - started < 60
    assert not [t for t in workers._threads if t.is_alive()]  # drafter0 left the barrier, target0 its queue


def test_an_exception_in_the_target_worker_stops_all_threads(parts):
    cfg, target, _ = parts

    class BrokenTarget:
        """The real target, whose features() fails on the third batch it is asked for."""

        device = "cpu"

        def __init__(self):
            self.calls = 0

        def features(self, input_ids, attention_mask=None):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("target fell over")
            return target.features(input_ids, attention_mask=attention_mask)

    workers, _ = make_workers(parts, target=BrokenTarget())
    with workers:
        workers.start(0, 10)
        with pytest.raises(WorkerFailure) as err:
            for step in range(10):  # it fails on batch 3, during step 0 or 1 depending on prefetch
                workers.run_step(step)
    assert step <= 1
    assert err.value.thread == "target0" and "target fell over" in str(err.value)
    assert not [t for t in workers._threads if t.is_alive()]


def test_closing_idle_workers_ends_every_thread(parts):
    workers, _ = make_workers(parts, replicas=3)
    workers.start(0, 10)
    workers.run_step(0)
    time.sleep(0.3)  # the target worker is now blocked on full queues
    workers.close()
    assert not [t for t in workers._threads if t.is_alive()]
    assert threading.active_count() < 20


class _Sink:
    def write(self, text):
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


def test_the_target_thread_draws_each_batch_blocks_before_the_drafter_step(parts):
    """A drafter step finds its anchors, mask and token count ready (drawn on the target thread, from
    the host's copy of the loss mask), the same blocks the step would have drawn for itself."""
    cfg = parts[0]
    real, draw = make_loss_fn(cfg), make_block_drawer(cfg)
    seen = []

    def recording(replica, batch):
        seen.append((batch.step, batch.replica, batch.blocks))
        return real(replica, batch)

    workers, _ = make_workers(parts, compute_loss=recording)
    with workers:
        workers.start(0, 2)
        summaries = [workers.run_step(step) for step in range(2)]
    assert sorted((step, replica) for step, replica, _ in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for step, replica, blocks in seen:
        assert blocks is not None, (step, replica)
        again = draw(make_batch(parts[2], workers.plan, step, replica), "cpu")
        assert torch.equal(blocks.anchors, again.anchors) and torch.equal(blocks.valid, again.valid)
        assert blocks.tokens == again.tokens == int(again.valid.sum()) * cfg.drafter.block_size > 0
    assert [s.tokens for s in summaries] == [
        sum(blocks.tokens for step, _, blocks in seen if step == s.step - 1) for s in summaries
    ]
    assert all(isinstance(s.loss, float) and isinstance(s.grad_norm, float) for s in summaries)


def test_a_step_run_ahead_starts_before_its_turn_and_reads_the_same_numbers(parts):
    """run_step(s, ahead=True) lets step s+1 train without another call; run_step(s+1) then only reads
    it (and starts nothing more), and every summary, the gradient norm included, is what the
    one-at-a-time run reports."""
    cfg = parts[0]
    real = make_loss_fn(cfg)
    started = []

    def recording(replica, batch):
        started.append((batch.step, replica.index))
        return real(replica, batch)

    plain, _ = make_workers(parts)
    with plain:
        plain.start(0, 3)
        expected = [plain.run_step(step) for step in range(3)]
    workers, _ = make_workers(parts, compute_loss=recording)
    with workers:
        workers.start(0, 3)
        first = workers.run_step(0, ahead=True)
        deadline = time.monotonic() + 30
        while sorted(started) != [(0, 0), (0, 1), (1, 0), (1, 1)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(started) == [(0, 0), (0, 1), (1, 0), (1, 1)], "step 1 trains without its call"
        second = workers.run_step(1, ahead=False)
        time.sleep(0.2)
        assert len(started) == 4, "reading a step that ran ahead starts no other"
        third = workers.run_step(2)
    assert [first, second, third] == expected
    assert len({s.grad_norm for s in expected}) == 3  # a norm read from the wrong step would show


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_drafter_step_never_waits_on_the_host(parts):
    """From its command to its report, a drafter step on a GPU queues work and never syncs (a sync
    there leaves the GPU idle while the host catches up), the lead's and another replica's alike;
    only run_step waits, for the copy of the step's numbers."""
    cfg, target, dataset = parts
    cfg = copy.deepcopy(cfg)
    cfg.run.drafter_devices = ["cuda:0", "cuda:0"]
    reps = build_replicas(cfg, drafter_config(cfg, target), target, total_steps=3)
    cuda_target = types.SimpleNamespace(device="cpu", features=target.features)
    workers = TrainingWorkers(
        targets=[cuda_target], replicas=reps, dataset=dataset, plan=BatchPlan(len(dataset), 2, 2, 0),
        compute_loss=make_loss_fn(cfg), draw_blocks=make_block_drawer(cfg), guard=CompileGuard("lock"),
        grad_clip=cfg.train.grad_clip, feature_dtype=torch.float32,
    )
    reports = []
    with workers:
        workers.start(0, 2)
        workers.run_step(0)  # the first step may compile, which syncs
        while any(t.name == "target0" and t.is_alive() for t in workers._threads):
            time.sleep(0.05)  # the target thread has drawn every batch (its copies may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for commands in workers._commands.values():
                commands.put(1)
            while len(reports) < 2 and not workers._failures.event.wait(0.05):
                reports += [] if workers._reports.empty() else [workers._reports.get()]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert not workers._failures.items, workers._failures.items[0].traceback_text
    assert sorted(report.replica for report in reports) == [0, 1]
    for report in reports:
        assert report.ready is not None and report.tokens > 0
        numbers = report.read()
        assert numbers.device.type == "cpu" and numbers.shape == (cfg.drafter.block_size + 1,)
        assert torch.isnan(numbers[1]) == (report.replica != 0), "the lead alone carries the gradient norm"
