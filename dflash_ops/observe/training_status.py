"""What status shows of training: the progress of the run and its latest evaluation (tau)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Training:
    """Fields in the JSON's order; a number JSON cannot hold (NaN) is None."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_update_age_s: float | None = None
    finished: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Training:
        return cls(**data)

    def step_text(self) -> str:
        if self.step is None:
            return "-"
        return str(self.step) + (f"/{self.total_steps}" if self.total_steps else "")


@dataclasses.dataclass(frozen=True)
class EvalStatus:
    """The latest speculative-decoding evaluation and how old it is."""

    step: int | None
    tau: float | None
    acceptance: tuple[float, ...]
    lossless: bool | None
    expected_tau: float | None
    age_s: float | None

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "tau": self.tau,
            "acceptance": list(self.acceptance),
            "lossless": self.lossless,
            "expected_tau": self.expected_tau,
            "age_s": self.age_s,
        }

    @classmethod
    def from_json(cls, data: dict) -> EvalStatus:
        return cls(**{**data, "acceptance": tuple(data["acceptance"])})


def progress_line(training: Training, evaluated: EvalStatus | None, data_source: str | None) -> str:
    """`step 120/1000  loss 2.3141  45.2 Ktok/s  tau 2.50 (90 s ago)  ETA 1:23  last metrics 12 s ago`"""
    t = training
    loss = "-" if t.loss is None else f"{t.loss:.4f}"
    speed = "-" if t.tokens_per_s is None else f"{t.tokens_per_s / 1000:.1f}"
    age = t.last_update_age_s
    freshness = "no metrics yet" if age is None else f"last metrics {format_age(age)} ago"
    source = f"  data {data_source}" if data_source else ""
    tau = ""
    if evaluated is not None and evaluated.tau is not None:
        tau = f"  tau {evaluated.tau:.2f} ({format_age(evaluated.age_s)} ago)"
    eta = format_eta(t.eta_s)
    return f"step {t.step_text()}  loss {loss}  {speed} Ktok/s{tau}  ETA {eta}  {freshness}{source}"


def format_eta(seconds) -> str:
    """`22 s`, `12m05s` under an hour (where h:mm would show 0:00), else h:mm (hours may exceed 24)."""
    if seconds is None:
        return "-"
    if seconds < 59.5:
        return f"{max(0, round(seconds))} s"
    if seconds < 3599.5:
        whole = int(round(seconds))
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = int(round(seconds / 60))
    return f"{minutes // 60}:{minutes % 60:02d}"


def format_age(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
