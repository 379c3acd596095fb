"""What a picture of a run shows, as plain data: a run's history built from its metrics records.

Standard library only. The records may come from another machine: every value is type-checked
and anything malformed is left out, never trusted. A run is one or more launches (segments): each
`start` record begins one, so a resumed run's relaunches show as segment boundaries.
"""

from __future__ import annotations

import dataclasses
import math

from trainer import metrics_format
from trainer.train.metrics import format_duration


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
        row = self.summary_row()
        best = (
            "no eval yet"
            if row["best_tau"] is None
            else f"best τ {row['best_tau']:.3f} (step {row['best_tau_step']})"
        )
        total = f"/{row['total_steps']}" if row["total_steps"] else ""
        state = ", finished" if self.finished else ""
        return (
            f"{self.name}: {row['steps']}{total} steps, {best}, {format_duration(self.wall_s)}, "
            f"{self.launches} launch{'es' if self.launches != 1 else ''}{state}"
        )


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


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


def history(name: str, launches: list[list[dict]]) -> RunHistory:
    """A run's history from its launches' records (each list oldest first, launches in order)."""
    steps, loss, tau_expected, tokens, memory = [], [], [], [], []
    evals, markers = [], []
    total, finished, wall = None, False, 0.0
    launches = [part for launch in launches for part in segments([r for r in launch if isinstance(r, dict)])]
    launches = [part for part in launches if part]
    for number, launch in enumerate(launches):
        times = [t for t in (_float(r.get("time")) for r in launch) if t is not None and math.isfinite(t)]
        wall += (max(times) - min(times)) if times else 0.0
        first_step = None
        for record in launch:
            event, step = record.get("event"), _int(record.get("step"))
            if event == "step" and step is not None:
                value = _float(record.get("loss"))
                if value is None:
                    continue
                if first_step is None:
                    first_step = step
                acc = _floats(record.get("acc"))
                steps.append(step)
                loss.append(value)
                tau_expected.append(metrics_format.expected_tau(list(acc)) if acc else float("nan"))
                rate = _float(record.get("tokens_per_s"))
                tokens.append(rate if rate is not None else float("nan"))
                mem = _float(record.get("gpu_memory_gib"))
                if mem is not None:
                    memory.append(mem)
                total = _int(record.get("total_steps")) or total
            elif event == "eval" and step is not None:
                tau = _float(record.get("tau"))
                if tau is not None:
                    evals.append(
                        EvalPoint(
                            step,
                            tau,
                            _floats(record.get("acceptance")) or (),
                            _float(record.get("tau_per_prompt_mean")),
                        )
                    )
            elif event == "done" and step is not None:
                reason = str(record.get("reason"))[:80]
                finished = reason == "max_steps"
                if not finished:
                    markers.append(Marker(step, "stop", f"stopped at step {step} ({reason})"))
            elif event == "error":
                at = steps[-1] if steps else 0
                markers.append(Marker(at, "error", f"error at step {at}: {str(record.get('kind'))[:40]}"))
        if number > 0 and first_step is not None:
            markers.append(
                Marker(first_step - 1, "relaunch", f"relaunch: resumed after step {first_step - 1}")
            )
        last_event = launch[-1].get("event")
        if number < len(launches) - 1 and last_event not in ("done", "error"):
            at = steps[-1] if steps else 0
            markers.append(Marker(at, "ended", f"launch ended at step {at} without a last record"))
    if len(memory) != len(steps):
        memory = []  # only some launches recorded it: not one series
    return RunHistory(
        name=name,
        steps=tuple(steps),
        loss=tuple(loss),
        tau_expected=tuple(tau_expected),
        tokens_per_s=tuple(tokens),
        gpu_memory_gib=tuple(memory),
        evals=tuple(evals),
        markers=tuple(sorted(markers, key=lambda m: m.step)),
        total_steps=total,
        finished=finished,
        wall_s=wall,
        launches=len(launches),
    )


def history_from_lines(name: str, launches_lines: list[list[str]]) -> RunHistory:
    """history() from raw metrics lines (untrusted text: foreign and partial lines are dropped)."""
    return history(name, [metrics_format.parse_lines("\n".join(lines)) for lines in launches_lines])
