"""One node's check: a probe round trip, then the verdict and the status (unreachable: UNKNOWN)."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe import budget, health, status as status_lib
from dflash_ops.errors import DflashOpsError
from dflash_ops.job.model import Target
from dflash_ops.observe.probe import DEFAULT_TIMEOUT_S, run_probe
from dflash_ops.observe.status import TargetStatus
from dflash_ops.transport.factory import connect


@dataclasses.dataclass
class Checked:
    """One target's status and verdict; `report` is None when the check itself could not run."""

    target: Target
    verdict: health.Verdict
    status: TargetStatus
    report: object = None


def check(target: Target, now: float | None = None, timeout_s: float | None = None) -> Checked:
    """One probe round trip, then the verdict, never raising; `timeout_s` bounds the whole check."""
    if timeout_s is None:
        return _check(target, now)
    shares = budget.split(timeout_s, gpu_on_host=target.gpu_host_ctid is not None)
    return budget.within(
        timeout_s,
        lambda: _check(budget.limit_connect(target, shares.connect_s), now, shares),
        lambda: _unknown(target, f"no answer within the {timeout_s:g} s budget (--timeout)"),
    )


def checked_outcome(outcome) -> Checked:
    if outcome.error is None:
        return outcome.value
    error = outcome.error
    first = (str(error).splitlines() or [""])[0][:300]
    return _unknown(outcome.target, f"the check itself failed ({type(error).__name__}: {first})")


def _unknown(target: Target, reason: str) -> Checked:
    verdict = health.unknown(reason)
    return Checked(target, verdict, status_lib.build_status(target.name, None, target.job, verdict))


def _check(target: Target, now: float | None, shares: budget.Shares | None = None) -> Checked:
    timeout, part_s = (DEFAULT_TIMEOUT_S, None) if shares is None else (shares.run_s, shares.part_s)
    try:
        with connect(target) as transport:
            report = run_probe(
                transport, target.job, timeout, gpu_on_host=target.gpu_host_ctid, part_s=part_s
            )
    except DflashOpsError as exc:
        return _unknown(target, str(exc).splitlines()[0])
    verdict = health.evaluate(report, target.job, now)
    return Checked(target, verdict, status_lib.build_status(target.name, report, target.job, verdict), report)
