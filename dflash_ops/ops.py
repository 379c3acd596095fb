"""The operations behind each CLI command, as plain functions over one Target (tests call these)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator

from dflash_ops.observe import budget, health, status as status_lib

from dflash_ops import commands

from dflash_ops.errors import DflashOpsError, InputError, JobBusy
from dflash_ops.inventory.model import Target
from dflash_ops.observe.probe import run_probe
from dflash_ops.observe.log_tail import tail_log  # noqa: F401 (tail-log, one of the operations)
from dflash_ops.observe.target_status import TargetStatus
from dflash_ops.act.relaunch_guard import RelaunchGuard
from dflash_ops.transport.factory import make_transport

if TYPE_CHECKING:
    from dflash_ops.act import deploy
    from dflash_ops.act.runner import RunResult

# The commands that act on a job are dflash_ops.commands; they import the steps when they run, so
# `status`, `health` and `tail-log` start without them.


@contextlib.contextmanager
def connect(target: Target) -> Iterator:
    transport = make_transport(target)
    try:
        yield transport
    finally:
        transport.close()


@dataclasses.dataclass
class Checked:
    """One target's status and verdict; `report` is None when the check itself could not run."""

    target: Target
    verdict: health.Verdict
    status: TargetStatus
    report: object = None


def check(target: Target, now: float | None = None, timeout_s: float | None = None) -> Checked:
    """One probe round trip, then the verdict; unreachable targets give UNKNOWN, never raise.
    With `timeout_s` the whole check ends within it (see budget.py): parts that run out of
    their share are UNKNOWN, the others are still reported."""
    if timeout_s is None:
        return _check(target, now)
    shares = budget.split(timeout_s, gpu_on_host=target.gpu_host_ctid is not None)
    return budget.within(
        timeout_s,
        lambda: _check(budget.limit_connect(target, shares.connect_s), now, shares),
        lambda: _unknown(target, f"no answer within the {timeout_s:g} s budget (--timeout)"),
    )


def checked_outcome(outcome) -> Checked:
    """A fan-out's Checked for one target; a check that raised reads as UNKNOWN with its error
    (one line), never as a missing answer."""
    if outcome.error is None:
        return outcome.value
    error = outcome.error
    first = (str(error).splitlines() or [""])[0][:300]
    return _unknown(outcome.target, f"the check itself failed ({type(error).__name__}: {first})")


def _unknown(target: Target, reason: str) -> Checked:
    verdict = health.unknown(reason)
    return Checked(target, verdict, status_lib.build_status(target.name, None, target.job, verdict))


def _check(target: Target, now: float | None, shares: budget.Shares | None = None) -> Checked:
    try:
        with connect(target) as transport:
            if shares is None:
                report = run_probe(transport, target.job, gpu_on_host=target.gpu_host_ctid)
            else:
                report = run_probe(
                    transport,
                    target.job,
                    gpu_on_host=target.gpu_host_ctid,
                    timeout=shares.run_s,
                    part_s=shares.part_s,
                )
    except DflashOpsError as exc:
        return _unknown(target, str(exc).splitlines()[0])
    verdict = health.evaluate(report, target.job, now)
    return Checked(target, verdict, status_lib.build_status(target.name, report, target.job, verdict), report)


@dataclasses.dataclass
class HealthAction:
    attempted: bool
    message: str
    result: RunResult | None = None


def auto_relaunch(target: Target, checked: Checked) -> HealthAction | None:
    """Relaunch a CRITICAL target, at most max_relaunches_per_hour, never twice at once."""
    if checked.verdict.level != "CRITICAL":
        return None
    guard = RelaunchGuard(target.name, target.job.health.max_relaunches_per_hour)
    with guard.hold() as allowed:
        if allowed is not True:
            return HealthAction(False, f"auto-relaunch skipped: {allowed}")
        try:  # an attempt counts against the hourly budget once it holds the job's lock
            result = commands.relaunch(target, on_locked=guard.record)
        except JobBusy as exc:
            return HealthAction(False, f"auto-relaunch skipped: {exc.reason}")
        except DflashOpsError as exc:
            return HealthAction(True, f"auto-relaunch FAILED: {str(exc).splitlines()[0]}")
    outcome = "succeeded" if result.ok else "FAILED: " + result.summary()
    return HealthAction(True, f"auto-relaunch {outcome}", result)


def list_releases(target: Target) -> list[deploy.Release]:
    """The releases kept on the target, most recently deployed first."""
    from dflash_ops.act import deploy

    with connect(target) as transport:
        return deploy.parse_list(
            transport.check(deploy.list_script(target.job), timeout=30, step="list releases").stdout
        )


def require_kept_release(target: Target, release: str | None) -> None:
    """`deploy --rollback [RELEASE]`: RELEASE (none: a release besides the current one) must be kept
    on the target, checked before anything switches (one line, exit 2)."""
    releases = list_releases(target)
    kept = [r.id for r in releases]
    if release is None:
        if not any(not r.current for r in releases):
            raise InputError(
                f"--rollback: no earlier release to roll back to on {target.name} "
                f"(kept: {', '.join(kept) or 'none'}); nothing was changed"
            )
        return
    if release not in kept:
        raise InputError(
            f"--rollback {release}: no such release kept on {target.name} "
            f"(kept: {', '.join(kept) or 'none'}); `dflash-ops deploy --list` shows them"
        )
