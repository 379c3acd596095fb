"""Experiment trackers (`run.report_to`): tensorboard, wandb, mlflow, fed the metrics records.

Each record MetricsWriter writes (the JSON line, read back) goes to `Trackers.feed`: the metrics
file stays the one source of truth. A tracker that is not installed, cannot start or raises is
named in ONE line and dropped. Records from other threads queue for the writer's thread, so
tracker libraries are called from one thread.

Where each writes (under --output-dir unless its own settings say otherwise): tensorboard in
tensorboard/; wandb in wandb/ (project $WANDB_PROJECT or "dflash"; WANDB_MODE=offline: no network);
mlflow at $MLFLOW_TRACKING_URI, else a file store mlruns/ (experiment $MLFLOW_EXPERIMENT_NAME or "dflash").
"""

from __future__ import annotations

import collections
import importlib
import math
import os
import threading
from typing import Any, Callable

from trainer import metrics_format
from trainer.config import TRACKERS

INSTALL_HINT = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}
# values a step or eval record carries that are no measurement of the run
_NOT_SCALARS = {"v", "event", "time", "step", "total_steps", "eta_s"}
# per-block-position lists: position k of the block is pos{k}, k from 1
_PER_POSITION = {"acc", "acceptance"}


def scalars_of(record: dict) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of a step, eval or compile record, else None: train/<field> (acc as
    train/acc/pos1.., plus train/tau_expected), eval/<field>, compile/duration_s."""
    event = record.get("event")
    step = record.get("step")
    if event not in ("step", "eval", "compile") or not isinstance(step, int) or isinstance(step, bool):
        return None
    if event == "compile":
        duration = _number(record.get("duration_s"))
        return (max(step, 0), {"compile/duration_s": duration}) if duration is not None else None
    prefix = "train" if event == "step" else "eval"
    values: dict[str, float] = {}
    for name, value in record.items():
        if name in _NOT_SCALARS:
            continue
        if isinstance(value, list):
            items: dict[str | None, Any] = {
                (f"pos{i + 1}" if name in _PER_POSITION else str(i)): v for i, v in enumerate(value)
            }
        elif isinstance(value, dict):  # e.g. a {min, median, max} summary
            items = {str(key): item for key, item in value.items()}
        else:
            items = {None: value}
        for key, item in items.items():
            if (number := _number(item)) is not None:
                values[f"{prefix}/{name}" if key is None else f"{prefix}/{name}/{key}"] = number
    acc = record.get("acc")
    if event == "step" and isinstance(acc, list) and all(_number(a) is not None for a in acc):
        values["train/tau_expected"] = metrics_format.expected_tau(acc)
    return step, values


# the records worth a line in a tracker's event log (the relaunch and stop history), as that line
_EVENT_LINES = {
    "compile": "compile {thread} step {step}: {duration_s} s ({reason})",
    "checkpoint": "checkpoint step {step}: {path}",
    "error": "error ({kind}): {message}",
    "done": "done step {step} ({reason})",
}


class _Fields(dict):
    def __missing__(self, key):
        return None  # a field the record lacks reads None, as record.get would


def event_of(record: dict) -> tuple[int, str, str] | None:
    """(step, kind, text) of a record worth a line in a tracker's event log, else None."""
    event = record.get("event")
    if event not in _EVENT_LINES:
        return None
    step = record["step"] if isinstance(record.get("step"), int) else 0
    return step, event, _EVENT_LINES[event].format_map(_Fields(record, step=step))


def _number(value) -> float | None:
    """A number (a boolean counts: True is 1.0) as float, else None."""
    return float(value) if isinstance(value, (int, float)) else None


def flat_config(config: dict, prefix: str = "") -> dict[str, str]:
    """{"train.lr": "0.0006", ...}: a nested config as the flat string params mlflow takes."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:500]
    return flat


class Tracker:
    """One tracker library: open() (once) gets the run's start record, the other methods its later ones."""

    name = ""
    library = ""  # the module it drives, imported on construction: ImportError when not installed

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.opened = False
        self.lib: Any = importlib.import_module(self.library) if self.library else None
        self.run: Any = None  # what open() starts: the library's run (tensorboard: its event writer)

    def open(self, config: dict, run_name: str) -> None:
        pass

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def event(self, step: int, kind: str, text: str) -> None:
        pass

    def close(self) -> None:  # called only once open() went through
        pass


class TensorBoard(Tracker):
    name = "tensorboard"
    library = "torch.utils.tensorboard"  # needs the tensorboard package

    def open(self, config, run_name):
        self.run = self.lib.SummaryWriter(log_dir=os.path.join(self.output_dir, "tensorboard"), flush_secs=10)
        self.run.add_text(
            "config", "```\n" + "\n".join(f"{k}: {v}" for k, v in flat_config(config).items()) + "\n```"
        )

    def scalars(self, step, values):
        for tag, value in values.items():
            self.run.add_scalar(tag, value, step)

    def event(self, step, kind, text):
        self.run.add_text("events", text, step)

    def close(self):
        self.run.close()


class Wandb(Tracker):
    name = library = "wandb"
    last_step = 0  # the highest step logged so far (scalars sets it per instance)

    def open(self, config, run_name):
        settings = self.lib.Settings(console="off", silent=True)  # the trainer's log stays its own
        self.run = self.lib.init(
            project=os.environ.get("WANDB_PROJECT", "dflash"),
            name=run_name,
            dir=self.output_dir,
            config=config,
            settings=settings,
        )

    def scalars(self, step, values):
        self.last_step = max(self.last_step, step)  # wandb drops data logged at an earlier step
        self.run.log(values, step=self.last_step)

    def event(self, step, kind, text):
        self.run.summary[f"last_{kind}"] = text

    def close(self):
        self.run.finish()


class Mlflow(Tracker):
    name = library = "mlflow"

    def open(self, config, run_name):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a local store needing no database package (mlflow-skinny has none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.lib.set_tracking_uri("file:" + os.path.abspath(os.path.join(self.output_dir, "mlruns")))
        self.lib.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dflash"))
        self.run = self.lib.start_run(run_name=run_name)
        params = list(flat_config(config).items())
        for first in range(0, len(params), 100):  # mlflow takes at most 100 params a call
            self.lib.log_params(dict(params[first : first + 100]))

    def scalars(self, step, values):
        if finite := {k: v for k, v in values.items() if math.isfinite(v)}:  # mlflow refuses NaN/inf
            self.lib.log_metrics(finite, step=step)

    def event(self, step, kind, text):
        self.lib.set_tag(f"last_{kind}", text[:5000])

    def close(self):
        self.lib.end_run()


KINDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}
assert tuple(KINDS) == TRACKERS, "a tracker class for each name run.report_to accepts"


class Trackers:
    """The trackers a run reports to; a failing one is named in one line through `say` and dropped."""

    def __init__(self, names, output_dir: str, say: Callable[[str], None]):
        self.say, self.output_dir = say, output_dir
        self.active: list[Tracker] = []
        self._owner = threading.get_ident()
        self._pending: collections.deque = collections.deque()
        for name in names:
            try:
                self.active.append(KINDS[name](output_dir))
            except Exception as exc:  # noqa: BLE001 - ImportError, or a library broken on import
                self._off(name, exc)

    def __bool__(self) -> bool:
        return bool(self.active)

    def feed(self, record: dict) -> None:
        if not self.active:
            return
        self._pending.append(record)
        if threading.get_ident() == self._owner:
            self._deliver()

    def close(self) -> None:
        if threading.get_ident() == self._owner:
            self._deliver()
        for tracker in [t for t in self.active if t.opened]:  # one never opened has nothing to close
            self._call(tracker, tracker.close)
        self.active = []

    def _deliver(self) -> None:
        while self._pending:
            record = self._pending.popleft()
            for tracker in list(self.active):
                self._call(tracker, self._send, tracker, record)

    def _send(self, tracker: Tracker, record: dict) -> None:
        is_start = record.get("event") == "start"
        if not tracker.opened:
            config = record["config"] if is_start and isinstance(record.get("config"), dict) else {}
            tracker.open(config, os.path.basename(os.path.normpath(self.output_dir)))
            tracker.opened = True
        if is_start:
            return
        if (values := scalars_of(record)) is not None and values[1]:
            tracker.scalars(*values)
        if (event := event_of(record)) is not None:
            tracker.event(*event)

    def _call(self, tracker: Tracker, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
            if tracker in self.active:
                self.active.remove(tracker)
                self._off(tracker.name, exc)

    def _off(self, name: str, exc: BaseException) -> None:
        if isinstance(exc, ImportError):
            hint = INSTALL_HINT.get(name, name)
            why = f"is not installed (pip install {hint}, or the dflash-ops[{name}] extra)"
        else:
            detail = str(exc).strip().splitlines()
            why = f"failed ({type(exc).__name__}{': ' + detail[0][:200] if detail else ''})"
        self.say(f"report_to: {name} {why}; training continues without it")
