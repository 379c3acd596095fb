"""Who trains: the one loop of trainer.train.loop runs over a World, which says how it is spread:
ThreadsWorld (here: one process, a drafter thread per device) or TorchrunWorld
(trainer.train.distributed: this process is one rank of a torchrun job).
"""

from __future__ import annotations

import typing

import torch

from trainer.config import TrainConfig
from trainer.train.shutdown import StopRequest
from trainer.train.workers import Failure, Replica, StepSummary, TrainingWorkers


class World(typing.Protocol):
    """What train() and its loop ask of a world; the defaults are one process's answers."""

    cfg: TrainConfig  # the config as this process trains it (a rank: its own device only)
    size: int  # replicas in the whole job: the batch plan is built for that many
    is_lead: bool  # evaluates and writes checkpoints
    speaks: bool  # writes the metrics file and readable lines, marks the run finished
    devices: list[str]  # for the start record
    trackers: list[str]  # experiment trackers this process reports to
    # may a step start before the one before it is read (nothing else then differs between processes)
    pipelines: bool

    def thread(self, name: str) -> str:
        """A worker thread's name in compile events."""
        return name

    def join(self) -> None:
        """Meet the other processes (before the run's try block: nothing is built yet)."""
        return None

    def agree_data(self, dataset) -> None:
        """Refuse when the processes built different training data."""
        return None

    def agree_resume(self, state) -> None:
        """Refuse a checkpoint that this world cannot continue (before it is restored)."""
        return None

    def ready(self, replicas: list[Replica], start: int) -> None:
        """Last step before training: agree on the start step, wrap the replicas as needed."""
        return None

    def describe(self) -> list[str]:
        """Lines for the startup summary."""
        return []

    def stop_request(self) -> StopRequest:
        """The stop request train() installs with listen()."""

    def listen(self, stop: StopRequest) -> None:
        """Install `stop`'s signal handlers."""

    def step(
        self, workers: TrainingWorkers, index: int, stop: StopRequest, ahead: bool = False
    ) -> StepSummary:
        """Train step `index` (0-based) on every replica; the summary of the whole job. With `ahead`
        (only where `pipelines`), step index+1 is already running when this returns."""

    def stopping(self, stop: StopRequest) -> bool:
        """Whether the run stops after the step just done."""

    def model(self, replicas: list[Replica]) -> torch.nn.Module:
        """The drafter to evaluate and checkpoint (replicas are identical: the lead's, unwrapped)."""

    def failed(self, failure: Failure) -> str | None:
        """Say the failure as this world must; the error record's label, or None for no record."""

    def close(self) -> None:
        """Leave the other processes (in train()'s finally)."""
        return None


class ThreadsWorld(World):
    """One process, a drafter thread per drafter device (trainer.train.workers averages the gradients)."""

    is_lead = speaks = pipelines = True

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.size = len(cfg.run.drafter_devices)
        self.devices = cfg.run.target_devices + cfg.run.drafter_devices
        self.trackers = list(cfg.run.report_to)

    def stop_request(self) -> StopRequest:
        return StopRequest(self.cfg.run.stop_grace_s, watchdog=True)

    def listen(self, stop: StopRequest) -> None:
        stop.install()

    def step(
        self, workers: TrainingWorkers, index: int, stop: StopRequest, ahead: bool = False
    ) -> StepSummary:
        # a stop that runs out of grace gives up
        summary = workers.run_step(index, give_up=stop.overdue, ahead=ahead)
        if stop.requested and not ahead:
            stop.step_finished()  # disarms the watchdog before the checkpoint is written
        return summary

    def stopping(self, stop: StopRequest) -> bool:
        return stop.requested

    def model(self, replicas: list[Replica]) -> torch.nn.Module:
        return replicas[0].model

    def failed(self, failure: Failure) -> str | None:
        return ""
