"""Drafter quality: the latest measured acceptance length tau, and what training accuracy predicts
(1 + sum_k prod_{j<=k} acc_j). Far below it means a train/inference mismatch or memorisation."""

from __future__ import annotations

import dataclasses

from trainer import metrics_format
from trainer.tau_diagnosis import ACC_WINDOW as ACC_WINDOW  # the probe reads it here
from trainer.tau_diagnosis import GAP_RATIO, expected_tau_of, likely_cause
from trainer.typed_yaml import finite


@dataclasses.dataclass(frozen=True)
class Acceptance:
    step: int | None
    tau: float | None
    acceptance: tuple[float, ...]
    lossless: bool | None
    time: float | None
    expected_tau: float | None  # from training accuracy up to the eval's step
    split: str = "held-in"  # what the prompts were (trainer.metrics_format EVAL_SPLITS)


def latest(records: list[dict]) -> Acceptance | None:
    """The newest `eval` record of the current run (records after its `start`), or None."""
    start = metrics_format.last_of(records, "start")
    if start is not None:
        records = records[records.index(start) :]
    record = metrics_format.last_of(records, "eval")
    if record is None:
        return None
    step = record.get("step") if isinstance(record.get("step"), int) else None
    steps = [
        r
        for r in records
        if r.get("event") == "step"
        and (step is None or not isinstance(r.get("step"), int) or r["step"] <= step)
    ]
    expected = expected_tau_of(steps)
    acceptance: list = record["acceptance"] if isinstance(record.get("acceptance"), list) else []
    lossless = record.get("lossless") if isinstance(record.get("lossless"), bool) else None
    return Acceptance(
        step=step,
        tau=finite(record.get("tau")),
        acceptance=tuple(v for v in (finite(a) for a in acceptance) if v is not None),
        lossless=lossless,
        time=finite(record.get("time")),
        expected_tau=expected,
        split=record["split"] if record.get("split") in metrics_format.EVAL_SPLITS else "held-in",
    )


def problems(accept: Acceptance | None, min_tau: float) -> list[str]:
    """WARNING reasons: tau under its floor, far under what accuracy predicts, or a speculative mismatch."""
    if accept is None:
        return []
    reasons = []
    at = f" at step {accept.step}" if accept.step is not None else ""
    if accept.lossless is False:
        reasons.append(
            f"speculative decoding{at} did not reproduce the target's greedy output: "
            "a drafter/decoding bug (run dflash-train eval for the first differing token)"
        )
    if accept.tau is None:
        return reasons
    if min_tau > 0 and accept.tau < min_tau:
        reasons.append(f"measured tau {accept.tau:.2f}{at} is below the {min_tau:g} minimum (health.min_tau)")
    if accept.expected_tau is not None and accept.tau < GAP_RATIO * accept.expected_tau:
        held_in, held_out = (None, accept.tau) if accept.split == "held-out" else (accept.tau, None)
        cause = likely_cause(accept.expected_tau, held_in, held_out)
        reasons.append(
            f"measured tau {accept.tau:.2f}{at} is below {GAP_RATIO:g} x the {accept.expected_tau:.2f} "
            "that training accuracy predicts; " + cause.removeprefix("likely cause: ")
        )
    return reasons
