"""Why tau is low: held-in vs held-out vs the tau training accuracy predicts (no torch: ops read it).

Three numbers tell the causes apart:
- expected: 1 + sum_k prod_{j<=k} acc_j from the training accuracy (trainer.metrics_format.expected_tau),
  averaged over the last step records;
- held-in: tau on unseen records of the training distribution (data.eval_fraction's split, or fresh
  synthetic prompts);
- held-out: tau on other prompts (`--prompts`, e.g. other packages, another domain).
held-in far below expected: what serving computes differs from what training measured on the same
kind of data, a train/inference mismatch (chat template or thinking mode, masks, labels, features)
or a drafter that memorised its training records. held-out far below held-in: the drafter fits its
training distribution and not these prompts (over-fitting to the data; add varied data).
"""

from __future__ import annotations

from trainer import metrics_format
from trainer.typed_yaml import finite

GAP_RATIO = 0.7  # a tau below GAP_RATIO x the one it is compared with is "far below"
ACC_WINDOW = 10  # step records averaged for the expected tau (one batch's accuracy is noisy)


def expected_tau_of(step_records: list[dict], window: int = ACC_WINDOW) -> float | None:
    """Expected tau from the mean per-position accuracy of the last `window` step records with `acc`;
    None if one is not a number in [0, 1] (a damaged record: 1e300 would predict tau inf)."""
    steps = [r for r in step_records if isinstance(r.get("acc"), list) and r["acc"]][-window:]
    if not steps:
        return None
    width = min(len(r["acc"]) for r in steps)
    columns = [[finite(r["acc"][k]) for r in steps] for k in range(width)]
    if any(v is None or not 0 <= v <= 1 for column in columns for v in column):
        return None
    return metrics_format.expected_tau([sum(v for v in c if v is not None) / len(c) for c in columns])


def likely_cause(expected: float | None, held_in: float | None, held_out: float | None = None) -> str:
    """One line naming the likely cause of a low tau, or saying the numbers agree."""
    causes = []
    if expected is not None and held_in is not None and held_in < GAP_RATIO * expected:
        causes.append(
            f"mismatch: held-in tau {held_in:.2f} is far below the {expected:.2f} that training accuracy "
            "predicts, "
            "so serving computes something other than training did (chat template or thinking mode, masks, "
            "labels, features: run dflash-train gate), or the drafter memorised its training records"
        )
    if held_in is None and expected is not None and held_out is not None and held_out < GAP_RATIO * expected:
        causes.append(
            f"held-out tau {held_out:.2f} is far below the {expected:.2f} that training accuracy predicts: "
            "over-fit or a mismatch; tau on held-in records (data.eval_fraction) tells them apart"
        )
    if held_in is not None and held_out is not None and held_out < GAP_RATIO * held_in:
        causes.append(
            f"over-fit: held-out tau {held_out:.2f} is far below held-in {held_in:.2f}: the drafter fits its "
            "training distribution, not these prompts (train on more varied data)"
        )
    if causes:
        return "likely cause: " + "; ".join(causes)
    if held_in is None and held_out is None:
        return "likely cause: unknown (no tau measured)"
    return "likely cause: none found: the measured tau is within reach of what training predicts"
