"""What a picture of a run shows, as plain data: a run's history built from its metrics records.

Standard library only. The records may come from another machine: every value is type-checked
and anything malformed is left out, never trusted. A run is one or more launches (segments): each
`start` record begins one, so a resumed run's relaunches show as segment boundaries.
"""

from __future__ import annotations

import dataclasses
import math

from trainer import metrics_format
from trainer.progress import format_duration


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    step: int
    tau: float  # the contract's `tau`: pooled over all rounds
    acceptance: tuple[float, ...]
    tau_per_prompt_mean: float | None = None  # the mean of per-prompt means, when recorded


@dataclasses.dataclass(frozen=True)
class Marker:
    step: int
    kind: str  # "relaunch" | "stop" | "error" | "ended" (a launch that left no last record)
    text: str


@dataclasses.dataclass(frozen=True)
class RunHistory:
    name: str
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    tau_expected: tuple[float, ...]  # from each step's per-position accuracy (metrics_format)
    tokens_per_s: tuple[float, ...]
    gpu_memory_gib: tuple[float, ...]  # per step when recorded (else empty)
    evals: tuple[EvalPoint, ...]
    markers: tuple[Marker, ...]
    total_steps: int | None
    finished: bool
    wall_s: float
    launches: int

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    @property
    def best_eval(self) -> EvalPoint | None:
        measured = [e for e in self.evals if math.isfinite(e.tau)]
        return max(measured, key=lambda e: e.tau) if measured else None

    def summary_row(self) -> dict:
        best = self.best_eval
        return {
            "run": self.name,
            "best_tau": None if best is None else round(best.tau, 3),
            "best_tau_step": None if best is None else best.step,
            "steps": self.last_step,
            "total_steps": self.total_steps,
            "finished": self.finished,
            "wall_s": round(self.wall_s, 1),
            "launches": self.launches,
        }

    def summary_line(self) -> str:
        """`run 0003: 1200/90000 steps, best τ 3.412 (step 1200), 2h01m12s, 2 launches`"""
        best = self.best_eval
        best_text = "no eval yet" if best is None else f"best τ {round(best.tau, 3):.3f} (step {best.step})"
        total = f"/{self.total_steps}" if self.total_steps else ""
        state = ", finished" if self.finished else ""
        return (
            f"{self.name}: {self.last_step}{total} steps, {best_text}, {format_duration(self.wall_s)}, "
            f"{self.launches} launch{'es' if self.launches != 1 else ''}{state}"
        )


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _floats(value) -> tuple[float, ...] | None:
    if not isinstance(value, list):
        return None
    numbers = [_float(v) for v in value]
    return None if any(n is None for n in numbers) else tuple(n for n in numbers if n is not None)


def segments(records: list[dict]) -> list[list[dict]]:
    """Records split into launches: each `start` begins a new one."""
    parts: list[list[dict]] = []
    for record in records:
        if record.get("event") == "start" or not parts:
            parts.append([])
        parts[-1].append(record)
    return parts


@dataclasses.dataclass
class _Series:
    """A run's history as it is read, launch by launch."""

    steps: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    tau_expected: list[float] = dataclasses.field(default_factory=list)
    tokens: list[float] = dataclasses.field(default_factory=list)
    memory: list[float] = dataclasses.field(default_factory=list)
    evals: list[EvalPoint] = dataclasses.field(default_factory=list)
    markers: list[Marker] = dataclasses.field(default_factory=list)
    total: int | None = None
    finished: bool = False
    wall: float = 0.0

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def add_launch(self, launch: list[dict], relaunched: bool, followed: bool) -> None:
        """One launch's records; `relaunched`: a launch came before it, `followed`: one comes after."""
        times = [t for t in (_float(r.get("time")) for r in launch) if t is not None and math.isfinite(t)]
        self.wall += (max(times) - min(times)) if times else 0.0
        steps = [self.add_record(record) for record in launch]
        first_step = next((step for step in steps if step is not None), None)
        if relaunched and first_step is not None:
            self.markers.append(
                Marker(first_step - 1, "relaunch", f"relaunch: resumed after step {first_step - 1}")
            )
        if followed and launch[-1].get("event") not in ("done", "error"):
            at = self.last_step
            self.markers.append(Marker(at, "ended", f"launch ended at step {at} without a last record"))

    def add_record(self, record: dict) -> int | None:
        """Takes in one record; returns its step when it is a step record with a loss."""
        event, step = record.get("event"), _int(record.get("step"))
        if event == "step" and step is not None:
            return self.add_step(step, record)
        if event == "eval" and step is not None:
            tau = _float(record.get("tau"))
            if tau is not None:
                acceptance = _floats(record.get("acceptance")) or ()
                self.evals.append(EvalPoint(step, tau, acceptance, _float(record.get("tau_per_prompt_mean"))))
        elif event == "done" and step is not None:
            reason = str(record.get("reason"))[:80]
            self.finished = reason == "max_steps"
            if not self.finished:
                self.markers.append(Marker(step, "stop", f"stopped at step {step} ({reason})"))
        elif event == "error":
            at = self.last_step
            self.markers.append(Marker(at, "error", f"error at step {at}: {str(record.get('kind'))[:40]}"))
        return None

    def add_step(self, step: int, record: dict) -> int | None:
        value = _float(record.get("loss"))
        if value is None:
            return None
        acc = _floats(record.get("acc"))
        self.steps.append(step)
        self.loss.append(value)
        self.tau_expected.append(metrics_format.expected_tau(list(acc)) if acc else float("nan"))
        rate = _float(record.get("tokens_per_s"))
        self.tokens.append(rate if rate is not None else float("nan"))
        mem = _float(record.get("gpu_memory_gib"))
        if mem is not None:
            self.memory.append(mem)
        self.total = _int(record.get("total_steps")) or self.total
        return step


def history(name: str, launches: list[list[dict]]) -> RunHistory:
    """A run's history from its launches' records (each list oldest first, launches in order)."""
    launches = [part for launch in launches for part in segments([r for r in launch if isinstance(r, dict)])]
    series = _Series()
    for number, launch in enumerate(launches):
        series.add_launch(launch, relaunched=number > 0, followed=number < len(launches) - 1)
    # only some launches recorded GPU memory: not one series
    memory = series.memory if len(series.memory) == len(series.steps) else []
    return RunHistory(
        name=name,
        steps=tuple(series.steps),
        loss=tuple(series.loss),
        tau_expected=tuple(series.tau_expected),
        tokens_per_s=tuple(series.tokens),
        gpu_memory_gib=tuple(memory),
        evals=tuple(series.evals),
        markers=tuple(sorted(series.markers, key=lambda m: m.step)),
        total_steps=series.total,
        finished=series.finished,
        wall_s=series.wall,
        launches=len(launches),
    )


def history_from_lines(name: str, launches_lines: list[list[str]]) -> RunHistory:
    """history() from raw metrics lines (untrusted text: foreign and partial lines are dropped)."""
    return history(name, [metrics_format.parse_lines("\n".join(lines)) for lines in launches_lines])
