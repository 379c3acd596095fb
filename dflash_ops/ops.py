"""The operations behind each CLI command, as plain functions over one Target (tests call these)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shlex
import time
from typing import TYPE_CHECKING, Callable, Iterator

from dflash_ops.observe import budget, health, status as status_lib

from dflash_ops import commands

from dflash_ops.act import jobpaths, jobstate
from dflash_ops.errors import DflashOpsError, InputError, JobBusy, RemoteCommandError
from dflash_ops.inventory.model import Target
from dflash_ops.observe.probe import run_probe
from dflash_ops.observe.target_status import TargetStatus
from dflash_ops.act.relaunch_guard import RelaunchGuard
from dflash_ops.remote import facts, shell_command
from dflash_ops.transport.base import quote_argv
from dflash_ops.transport.factory import make_transport

if TYPE_CHECKING:
    from dflash_ops.act import deploy
    from dflash_ops.playbook.run import RunResult

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


def require_kept_release(target: Target, release: str) -> None:
    """`deploy --rollback RELEASE`: RELEASE must be kept on the target, checked before anything
    switches (a mistyped id is the user's mistake: one line, exit 2)."""
    kept = [r.id for r in list_releases(target)]
    if release not in kept:
        raise InputError(
            f"--rollback {release}: no such release kept on {target.name} "
            f"(kept: {', '.join(kept) or 'none'}); `dflash-ops deploy --list` shows them"
        )


# ------------------------------------------------------------------ logs

# names on one line (at most 4 MiB of them); facts.newest_log_name picks
LIST_LOGS = "ls -1 {dir} 2>/dev/null | head -c 4194304 | tr '\\n' /; echo"


# --grep filters here (Python regex), over at most this many of the newest lines, so a log of a
# week-long run is not pulled over ssh whole.
GREP_WINDOW_LINES = 200_000


def newest_log(transport, target: Target) -> str:
    log_dir = target.job.log_dir
    listing = transport.check(
        LIST_LOGS.format(dir=shlex.quote(log_dir)), timeout=30, step="find newest log"
    ).stdout
    name = facts.newest_log_name(listing.strip().split("/"))
    if not name:
        raise DflashOpsError(
            f"[{target.name}] no {facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX} in {log_dir} yet; "
            "launch the job first (dflash-ops relaunch)"
        )
    return f"{log_dir.rstrip('/')}/{name}"


def job_log(transport, target: Target) -> str:
    """The log of the run the job state names (never merely the newest file); the newest
    train-NNNN.log only for a job launched before there was a job state. A state file that cannot
    be read as one is refused (one line), never guessed past."""
    path = jobpaths.state_file(target.job)
    out = transport.check(jobstate.read_script(target.job), timeout=30, step="find the job's log").stdout
    _, kind, text = (out.split("\n", 2) + ["", ""])[:3]
    state, named = jobstate.parse(text), jobstate.load(text)
    why = None
    if kind.strip() == jobstate.NOT_A_FILE:
        why = "is not a regular file"
    elif text.strip() and state is None:
        why = f"holds no dflash-ops job state (damaged, or larger than {jobstate.MAX_BYTES} bytes)"
    elif isinstance(named, dict) and named.get("log") is not None and state is not None and state.log is None:
        why = f"names a log that is not a path ({json.dumps(named['log'])[:60]})"
    if why is not None:
        raise DflashOpsError(
            f"[{target.name}] job state {path} {why}; pass --log PATH to read a log "
            "(the next relaunch rewrites the state)"
        )
    if state is None or not state.log:
        return newest_log(transport, target)
    if not transport.run(quote_argv(["test", "-e", state.log]), timeout=30, step="find the job's log").ok:
        run = f"run {state.run:04d}" if isinstance(state.run, int) else "the current run"
        raise DflashOpsError(
            f"[{target.name}] the log of {run}, {state.log}, is missing (deleted or rotated "
            "away?); pass --log PATH to read another file"
        )
    return state.log


def _filter(lines: list[str], pattern: re.Pattern | None) -> list[str]:
    return [line for line in lines if pattern is None or pattern.search(line)]


def compile_grep(grep: str | None) -> re.Pattern | None:
    if grep is None:
        return None
    try:
        return re.compile(grep)
    except re.error as exc:
        raise InputError(f"--grep {grep!r}: not a valid regular expression ({exc})") from None


# A --log that is not a regular file (a directory, a device) would "read" as nothing at all:
# remote/log_read.sh exits with this code.
_NOT_A_FILE = 3


def _read_from(
    transport, target: Target, path: str, offset: int, follow_job: bool
) -> tuple[str | None, int, str]:
    """(the job's current log or None, size of `path`, its bytes after `offset`) in one run. The
    current log is the one the job state names; the newest train-NNNN.log only without a state."""
    log_dir = shlex.quote(target.job.log_dir)
    current = (
        f"{{ {jobstate.read_command(target.job)}; }} | tr '\\n' ' '; echo; {LIST_LOGS.format(dir=log_dir)}; "
        if follow_job
        else "echo; echo; "
    )
    out = transport.check(
        current + shell_command("log_chunk.sh", path, str(offset)),
        timeout=60,
        step="follow log",
    ).stdout
    state_line, _, rest = out.partition("\n")
    newest, _, rest = rest.partition("\n")
    size_line, _, chunk = rest.partition("\n")
    state = jobstate.parse(state_line.strip())
    if state is not None and state.log:
        return state.log, _size(target, size_line), chunk
    newest = facts.newest_log_name(newest.strip().split("/"))
    newest_path = f"{target.job.log_dir.rstrip('/')}/{newest}" if newest else None
    return newest_path, _size(target, size_line), chunk


def _size(target: Target, line: str) -> int:
    """A file size the log scripts printed; anything else is a failure in one line."""
    if not line.strip().isdigit():
        raise DflashOpsError(f"[{target.name}] read log: expected the log's size, got {line.strip()[:80]!r}")
    return int(line)


def tail_log(
    target: Target,
    lines: int = 50,
    follow: bool = False,
    grep: str | None = None,
    log: str | None = None,
    emit: Callable[[str], None] = print,
    poll_s: float = 1.0,
    should_stop: Callable[[], bool] = lambda: False,
) -> str:
    """Print the last `lines` lines (matching `grep`) of the job's log (the one the job state names);
    with follow, keep printing new lines by polling byte offsets (nothing keeps running remotely when
    we stop). Following the job's log (no `log` given) moves on to the log the job state names when
    a relaunch starts one."""
    pattern = compile_grep(grep)
    with connect(target) as transport:
        path = log or job_log(transport, target)
        # the size first, so follow continues exactly where this read ended
        first = transport.run(
            shell_command("log_read.sh", path, str(GREP_WINDOW_LINES if pattern else int(lines))),
            timeout=60,
            step="read log",
        )
        if log and first.exit_code == _NOT_A_FILE:
            raise InputError(
                f"--log {log}: {first.stdout.strip() or 'not a regular file'} on {target.name}; "
                f"give a log file ({facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX} in {target.job.log_dir})"
            )
        if not first.ok:
            raise RemoteCommandError(target.name, "read log", first)
        size_line, _, text = first.stdout.partition("\n")
        offset = _size(target, size_line)
        for line in _filter(text.splitlines(), pattern)[-lines:]:
            emit(line)
        partial = ""
        while follow and not should_stop():
            time.sleep(poll_s)
            current, size, chunk = _read_from(transport, target, path, offset, follow_job=not log)
            if size < offset:  # truncated or replaced: start again from its beginning
                offset, partial = 0, ""
                continue
            offset = size
            partial += chunk
            *complete, partial = partial.split("\n")
            for line in _filter(complete, pattern):
                emit(line)
            if (
                current
                and current != path
                and transport.run(quote_argv(["test", "-f", current]), timeout=30, step="follow log").ok
            ):
                # a relaunch started the next log: follow that one, as tail -F
                for line in _filter([partial] if partial else [], pattern):
                    emit(line)
                path, offset, partial = current, 0, ""
                emit(f"==> following {path} (a newer log) <==")
        return path
