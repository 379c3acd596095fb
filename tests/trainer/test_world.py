"""Who trains (trainer/train/world.py): both worlds answer every question the loop asks a World, and the
one-process world answers them for the threads of this process."""

from __future__ import annotations

import inspect
import typing

import pytest

from trainer.config import load_config
from trainer.train.distributed import TorchrunWorld
from trainer.train.shutdown import StopRequest
from trainer.train.world import ThreadsWorld, World


def asked(protocol) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(protocol).items()
        if callable(member) and not name.startswith("_")
    }


@pytest.mark.parametrize("world", [ThreadsWorld, TorchrunWorld])
def test_a_world_answers_every_question_with_the_same_arguments(world):
    for name, signature in asked(World).items():
        assert hasattr(world, name), f"{world.__name__} has no {name}()"
        assert list(inspect.signature(getattr(world, name)).parameters) == list(signature.parameters), name
    from trainer.train.distributed import Rank

    cfg = load_config("tiny-cpu", {})
    made = world(cfg) if world is ThreadsWorld else world(cfg, Rank(0, 1, 0))
    for field in typing.get_type_hints(World):
        assert hasattr(made, field), f"{world.__name__} has no {field}"


def test_the_threads_world_is_the_whole_job_in_this_process():
    cfg = load_config("tiny-cpu", {"run.report_to": ["tensorboard"], "run.stop_grace_s": 7})
    world = ThreadsWorld(cfg)
    assert world.size == len(cfg.run.drafter_devices) == 2
    assert world.devices == cfg.run.target_devices + cfg.run.drafter_devices
    assert world.is_lead and world.speaks and world.trackers == ["tensorboard"]
    assert world.thread("drafter0") == "drafter0" and world.describe() == []
    stop = world.stop_request()
    assert stop.grace_s == 7 and stop.use_watchdog, "one process: the watchdog ends a stuck stop"
    assert world.failed(object()) == "", "an error record without a rank label"
    replicas = [type("Replica", (), {"model": m})() for m in ("lead", "other")]
    assert world.model(replicas) == "lead"


class Workers:
    def __init__(self):
        self.calls = []

    def run_step(self, index, give_up=None, ahead=False):
        self.calls.append((index, give_up, ahead))
        return f"summary {index}"


class Stop(StopRequest):
    def __init__(self, requested: bool):
        super().__init__(grace_s=5)
        self.requested = requested
        self.finished = 0

    def step_finished(self):
        self.finished += 1


@pytest.mark.parametrize("requested", [False, True])
def test_a_step_gives_up_only_through_the_stop_and_a_requested_stop_ends_after_it(requested):
    world = ThreadsWorld(load_config("tiny-cpu", {}))
    workers, stop = Workers(), Stop(requested)
    assert world.step(workers, 3, stop) == "summary 3"
    assert workers.calls == [(3, stop.overdue, False)], "the step gives up when the stop runs out of grace"
    assert stop.finished == int(requested), "the watchdog is disarmed before the checkpoint is written"
    assert world.stopping(stop) is requested
