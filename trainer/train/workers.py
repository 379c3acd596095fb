"""Threads that do the work: target workers make features, drafter threads train replicas.

    target worker t (one per target device)      drafter thread r (one per drafter device)
    for step, for each replica r it serves:      wait for "do step s" from the main thread
      batch = make_batch(step, r)   --queue r-->   take batch s from queue r
      batch.blocks = draw_blocks(batch)            with guard.step(): loss; loss.backward()
      batch.features = target(batch)               barrier: grads averaged over replicas, clipped
                                                   optimizer.step(); scheduler.step(); report

Nothing in a drafter step waits on the host: the report's numbers reach the host by an asynchronous copy
that run_step waits for. run_step(s, ahead=True) also lets step s+1 start before s is read, so the
device runs from one step into the next while the main thread logs.

Replicas start identical and get identical averaged gradients, so they stay identical. Between
the main thread's steps every drafter thread is idle: the loop logs and checkpoints then. Any
exception in any thread stops them all; the first real error (not a consequence such as
BrokenBarrierError) reaches the main thread as WorkerFailure, with the worker's traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
import traceback
from typing import Any, Callable

import torch

from trainer.data.dataset import Batch, BatchPlan, Dataset, make_batch

POLL_S = 0.1  # how often blocked threads look at the stop event
JOIN_TIMEOUT_S = 30.0  # for all threads together
ABORT_JOIN_TIMEOUT_S = 5.0  # after an abort: a stuck thread will not end, do not wait long for it


class WorkerFailure(Exception):
    """An exception raised in a worker thread, carried to the main thread."""

    def __init__(self, thread: str, original: BaseException, traceback_text: str):
        self.thread, self.original, self.traceback_text = thread, original, traceback_text
        super().__init__(f"{thread}: {type(original).__name__}: {original}")


@dataclasses.dataclass
class Failure:
    """Why a run ends, with a worker thread's exception unwrapped from its WorkerFailure."""

    raised: BaseException  # what reached the main thread
    original: BaseException  # what went wrong, in whichever thread
    where: str  # " in thread drafter1", or "" for the main thread
    traceback_text: str

    @property
    def bad_input(self) -> bool:
        """A config, data or checkpoint error (it has an exit code): its one line beats a traceback."""
        return isinstance(getattr(self.original, "exit_code", None), int)

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """Call it while handling `exc` (a main-thread traceback is read from the handler)."""
        if isinstance(exc, WorkerFailure):
            return cls(exc, exc.original, f" in thread {exc.thread}", exc.traceback_text)
        return cls(exc, exc, "", traceback.format_exc())

    @property
    def interrupted(self) -> bool:
        return isinstance(self.raised, KeyboardInterrupt)

    def summary(self) -> str:
        return f"{type(self.original).__name__}{self.where}: {self.original}"


class StepAbandoned(KeyboardInterrupt):
    """The main thread stopped waiting for a step (a stop request ran out of time)."""


class _Stopped(Exception):
    """Raised inside a worker when another thread failed or the pool is closing."""


@dataclasses.dataclass
class Replica:
    """One drafter copy on one device, with its own optimizer and LR schedule."""

    index: int
    device: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # resume rebuilds it from its lambdas

    @property
    def name(self) -> str:
        return f"drafter{self.index}"

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, backward() is called on it
    acc: torch.Tensor  # [block-1] per-position accuracy
    tokens: int  # block tokens trained in this batch (valid anchors x block size)


@dataclasses.dataclass
class StepSummary:
    step: int  # 1-based count of optimizer steps done
    loss: float  # mean over replicas
    acc: list[float]  # mean over replicas, per block position 1..B-1
    tokens: int  # summed over replicas
    grad_norm: float  # of the averaged gradient, before clipping
    lr: float  # the learning rate this step used


@dataclasses.dataclass
class _Report:
    replica: int
    step: int
    numbers: torch.Tensor  # [loss, grad norm (nan but on the lead), acc...] on the host once ready
    ready: torch.cuda.Event | None  # recorded after the copy to the host (None: the copy was synchronous)
    tokens: int
    lr: float

    def read(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()  # waits for this step only, not for one started after it
        return self.numbers


class _WorkerThread(threading.Thread):
    dflash_worker = True  # see shutdown.worker_threads_alive


class _Failures:
    """Collects worker exceptions; the first one that is not a mere consequence wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[WorkerFailure] = []
        self.event = threading.Event()

    def add(self, thread: str, exc: BaseException) -> None:
        with self._lock:
            self.items.append(WorkerFailure(thread, exc, traceback.format_exc()))
        self.event.set()

    def primary(self) -> WorkerFailure | None:
        with self._lock:
            for item in self.items:
                if not isinstance(item.original, (_Stopped, threading.BrokenBarrierError)):
                    return item
            return self.items[0] if self.items else None


@dataclasses.dataclass(kw_only=True, eq=False)
class TrainingWorkers:
    """Start with `start(first_step, total_steps)`, then `run_step(step)` per step; `close()` always."""

    targets: list
    replicas: list[Replica]
    dataset: Dataset
    plan: BatchPlan
    compute_loss: Callable[[Replica, Batch], LossOutput]
    draw_blocks: Callable[[Batch, str], Any]  # (batch, drafter device) -> its blocks, drawn ahead of the step
    guard: Any
    grad_clip: float
    feature_dtype: torch.dtype
    queue_depth: int = 2

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._failures = _Failures()
        # keyed by replica index: under torchrun a process holds one replica whose index is its rank
        self._commands: dict[int, queue.Queue[int]] = {r.index: queue.Queue() for r in self.replicas}
        self._batches: dict[int, queue.Queue[Batch]] = {
            r.index: queue.Queue(maxsize=self.queue_depth) for r in self.replicas
        }
        self._reports: queue.Queue = queue.Queue()
        self._barrier = threading.Barrier(len(self.replicas), action=self._average_gradients)
        self._grad_norm = torch.tensor(float("nan"))
        self._threads: list[threading.Thread] = []
        self._doing: dict[str, str] = {}  # drafter -> what it is doing, for a stop that times out
        self._issued = -1  # the last step the drafters were told to do
        self._early: list[_Report] = []  # reports of a step that started ahead, read with their step

    def start(self, first_step: int, total_steps: int) -> None:
        """`first_step` is 0-based (the number of steps already done)."""
        self._issued = first_step - 1
        for t, target in enumerate(self.targets):
            served = [r for r in range(len(self.replicas)) if r % len(self.targets) == t]
            if served:
                self._spawn(f"target{t}", self._target_loop, target, served, first_step, total_steps)
        for replica in self.replicas:
            self._spawn(replica.name, self._drafter_loop, replica)

    def run_step(
        self, step: int, give_up: Callable[[], str | None] | None = None, ahead: bool = False
    ) -> StepSummary:
        """Every replica trains its batch of step `step` (0-based); a reason from the polled
        `give_up()` raises StepAbandoned. With `ahead`, step+1 starts as soon as the drafters are free:
        the caller promises to run it next, before anything that needs the drafters idle."""
        for wanted in (step, step + 1) if ahead else (step,):
            if wanted > self._issued:
                for commands in self._commands.values():
                    commands.put(wanted)
                self._issued = wanted
        reports = self._collect(step, give_up)
        numbers = torch.stack([rep.read() for rep in reports])
        return StepSummary(
            step=step + 1,
            loss=float(numbers[:, 0].mean()),
            acc=[float(a) for a in numbers[:, 2:].mean(0)],
            tokens=sum(rep.tokens for rep in reports),
            grad_norm=float(numbers[0, 1]),
            lr=reports[0].lr,
        )

    def _collect(self, step: int, give_up: Callable[[], str | None] | None) -> list[_Report]:
        """The reports of `step`, in replica order (one of the step after it is kept for its turn)."""
        reports = [rep for rep in self._early if rep.step == step]
        self._early = [rep for rep in self._early if rep.step != step]
        while len(reports) < len(self.replicas):
            if self._failures.event.is_set():
                self._raise_failure()
            if give_up is not None and (reason := give_up()):
                done = {rep.replica for rep in reports}
                busy = [
                    f"{r.name} ({self._doing.get(r.name, '?')})" for r in self.replicas if r.index not in done
                ]
                raise StepAbandoned(
                    f"{reason}: step {step + 1} did not finish: {', '.join(busy)}; "
                    "exiting without a checkpoint"
                )
            try:
                report = self._reports.get(timeout=POLL_S)
            except queue.Empty:
                continue
            (reports if report.step == step else self._early).append(report)
        return sorted(reports, key=lambda rep: rep.replica)

    def close(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop all threads, none left blocked on a queue or the barrier; joins for at most
        `join_timeout_s` in all (a thread stuck in a kernel never ends: trainer.train.shutdown)."""
        self._stop.set()
        self._barrier.abort()
        _drain(*self._batches.values(), *self._commands.values())
        deadline = time.monotonic() + join_timeout_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _raise_failure(self) -> None:
        self.close()  # also lets the other threads report, so the root cause can be chosen
        failure = self._failures.primary()
        assert failure is not None  # called once a failure is recorded
        raise failure from failure.original

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        aborted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.close(ABORT_JOIN_TIMEOUT_S if aborted else JOIN_TIMEOUT_S)

    def _spawn(self, name: str, fn, *args) -> None:
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the main thread
                if not self._stop.is_set() or not isinstance(exc, _Stopped):
                    self._failures.add(name, exc)
                self._stop.set()
                self._barrier.abort()

        # daemon: a thread stuck inside a torch kernel must not keep a failed process alive
        thread = _WorkerThread(target=run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _target_loop(self, target, served: list[int], first_step: int, total_steps: int) -> None:
        _use_device(target.device)
        for step in range(first_step, total_steps):
            for r in served:
                replica = self.replicas[r]
                # from a feature cache: has features
                batch = make_batch(self.dataset, self.plan, step, replica.index)
                dev = replica.device
                batch.blocks = self.draw_blocks(batch, dev)
                features = batch.features
                if features is None:
                    mask = batch.attention_mask.to(target.device)
                    features = target.features(batch.input_ids.to(target.device), attention_mask=mask)
                # a cache batch sits in pinned memory: its copy overlaps the drafter's work
                batch.features = features.to(dev, self.feature_dtype, non_blocking=features.is_pinned())
                batch.input_ids = batch.input_ids.to(dev)
                batch.loss_mask = batch.loss_mask.to(dev)
                batch.attention_mask = batch.attention_mask.to(dev)
                self._put(self._batches[replica.index], batch)

    def _drafter_loop(self, replica: Replica) -> None:
        _use_device(replica.device)
        while True:
            self._doing[replica.name] = "waiting for the next step"
            step = self._get(self._commands[replica.index])
            self._doing[replica.name] = "waiting for its batch from the target worker"
            batch = self._get(self._batches[replica.index])
            if batch.step != step:
                raise RuntimeError(f"{replica.name}: got the batch of step {batch.step} for step {step}")
            lr = replica.optimizer.param_groups[0]["lr"]
            self._doing[replica.name] = "in forward+backward"
            # the whole forward+backward may compile; a new shape would mean a recompile
            with self.guard.step(replica.name, step, tuple(batch.input_ids.shape), device=replica.device):
                out = self.compute_loss(replica, batch)
                out.loss.backward()
            # outside the guard: a barrier inside a guarded step could deadlock against a compile
            self._doing[replica.name] = "waiting for the others at the gradient barrier"
            self._barrier.wait()
            self._doing[replica.name] = "in the optimizer step"
            replica.optimizer.step()
            replica.scheduler.step()
            replica.optimizer.zero_grad(set_to_none=True)
            self._reports.put(self._report(replica, step, out, lr))

    def _report(self, replica: Replica, step: int, out: LossOutput, lr: float) -> _Report:
        """The step's numbers copied to the host without waiting; the lead's carry the gradient norm,
        which the barrier action left for this step (the next one cannot run before this thread)."""
        loss = out.loss.detach().float().view(1)
        lead = replica is self.replicas[0]
        norm = self._grad_norm.to(loss) if lead else torch.full_like(loss, float("nan"))  # no host copy
        numbers = torch.cat([loss, norm.view(1), out.acc.detach().float()])
        on_cuda = numbers.device.type == "cuda"
        host = numbers.to("cpu", non_blocking=on_cuda)  # pinned, asynchronous from a GPU
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _Report(replica.index, step, host, ready, int(out.tokens), lr)

    def _average_gradients(self) -> None:
        """Barrier action (one thread, all others parked): mean grads, clip, copy to every replica."""
        home = torch.device(self.replicas[0].device)
        per_replica = [r.trainable() for r in self.replicas]
        averaged: list[torch.Tensor] = []
        for params in zip(*per_replica, strict=True):
            total: torch.Tensor | None = None
            for p in params:  # fixed replica order: the sum does not depend on thread timing
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if total is None and g.dtype == torch.float32 and g.device == home:
                    total = g.detach()  # the first replica's own fp32 gradient holds the result: no copy
                    continue
                g = g.detach().to(home, torch.float32)
                total = g.clone() if total is None else total.add_(g)
            assert total is not None  # one parameter per replica, and there is at least one replica
            averaged.append(total.div_(len(params)) if len(params) > 1 else total)
        norm = torch.nn.utils.get_total_norm(averaged) if averaged else torch.tensor(0.0)
        over = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)  # the clip divides the grads by it
        # a fused AdamW divides inside its own kernel (its grad_scale): no pass of the clip's own
        folded = all(_divides_grads(r.optimizer) for r in self.replicas)
        for i, avg in enumerate(averaged):
            if not folded:
                avg.div_(over)
            for replica_params in per_replica:
                p = replica_params[i]
                if p.grad is None or p.grad.data_ptr() != avg.data_ptr():  # not the accumulator itself
                    p.grad = avg.to(p.device, p.dtype, copy=True)
        for replica in self.replicas if folded else ():
            replica.optimizer.grad_scale = over.to(replica.device)  # type: ignore[attr-defined]
        self._grad_norm = norm.detach()  # reported by the lead, read on the host later: no sync mid-step

    def _get(self, q: queue.Queue):
        return self._until_stopped(lambda: q.get(timeout=POLL_S))

    def _put(self, q: queue.Queue, item) -> None:
        self._until_stopped(lambda: q.put(item, timeout=POLL_S))

    def _until_stopped(self, attempt: Callable):
        """attempt() again every POLL_S until it goes through; _Stopped once the stop event is set."""
        while not self._stop.is_set():
            try:
                return attempt()
            except (queue.Empty, queue.Full):
                continue
        raise _Stopped()


def _divides_grads(optimizer: torch.optim.Optimizer) -> bool:
    """A fused Adam/AdamW step divides every gradient by its `grad_scale` tensor on the device."""
    return isinstance(optimizer, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))  # AdamW is one


def _use_device(device: str) -> None:
    """Make a thread's own CUDA device current, so nothing it launches lands on cuda:0 by default."""
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def _drain(*queues: queue.Queue) -> None:
    for q in queues:
        with contextlib.suppress(queue.Empty):
            while True:
                q.get_nowait()
