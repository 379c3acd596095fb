"""`tail-log`: the log the job state names; --follow polls byte offsets, so nothing stays running there."""

from __future__ import annotations

import json
import re
import shlex
import time
from typing import Callable

from dflash_ops.errors import DflashOpsError, InputError, RemoteCommandError
from dflash_ops.job import jobpaths, jobstate
from dflash_ops.job.model import Target
from dflash_ops.observe.text_style import inert, inert_log_line
from dflash_ops.remote import facts, shell_command
from dflash_ops.transport.factory import make_transport

# --grep filters here (Python regex), over at most this many of the newest lines, so a log of a
# week-long run is not pulled over ssh whole.
GREP_WINDOW_LINES = 200_000

# A --log that is not a regular file (a directory, a device) would "read" as nothing at all:
# remote/log_read.sh exits with this code.
_NOT_A_FILE = 3


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
    """Print the last `lines` lines (matching `grep`) of the job's log or `log`; follow moves on to the
    log a relaunch starts, as tail -F does. Returns the path read last."""
    try:
        pattern = None if grep is None else re.compile(grep)
    except re.error as exc:
        raise InputError(f"--grep {grep!r}: not a valid regular expression ({exc})") from None
    transport = make_transport(target)
    try:
        path = log or job_log(transport, target)
        offset = _print_last(transport, target, path, lines, pattern, emit, given=log is not None)
        if follow:
            path = _follow(transport, target, path, offset, pattern, emit, poll_s, should_stop, log is None)
        return path
    finally:
        transport.close()


def job_log(transport, target: Target) -> str:
    """The log the job state names (the newest only without a state); an unreadable state is refused."""
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
    if not transport.run(shlex.join(["test", "-e", state.log]), timeout=30, step="find the job's log").ok:
        run = f"run {state.run:04d}" if isinstance(state.run, int) else "the current run"
        raise DflashOpsError(
            f"[{target.name}] the log of {run}, {inert(state.log)}, is missing (deleted or rotated "
            "away?); pass --log PATH to read another file"
        )
    return state.log


def newest_log(transport, target: Target) -> str:
    log_dir = target.job.log_dir
    listing = transport.check(shell_command("log_list.sh", log_dir), timeout=30, step="find newest log")
    path = _newest_path(target, listing.stdout)
    if path is None:
        raise DflashOpsError(
            f"[{target.name}] no {facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX} in {log_dir} yet; "
            "launch the job first (dflash-ops relaunch)"
        )
    return path


def _newest_path(target: Target, listing: str) -> str | None:
    name = facts.newest_log_name(listing.strip().split("/"))
    return f"{target.job.log_dir.rstrip('/')}/{name}" if name else None


def _print_last(transport, target: Target, path: str, lines: int, pattern, emit, given: bool) -> int:
    """Emit the last `lines` lines of `path`; returns the size read, where a follower continues."""
    script = shell_command("log_read.sh", path, str(GREP_WINDOW_LINES if pattern else int(lines)))
    first = transport.run(script, timeout=60, step="read log")
    if given and first.exit_code == _NOT_A_FILE:
        raise InputError(
            f"--log {path}: {first.stdout.strip() or 'not a regular file'} on {target.name}; "
            f"give a log file ({facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX} in {target.job.log_dir})"
        )
    if not first.ok:
        raise RemoteCommandError(target.name, "read log", first)
    size_line, _, text = first.stdout.partition("\n")
    # split on newlines only: a carriage return is part of its line (inert_log_line)
    _emit(text.rstrip("\n").split("\n") if text else [], pattern, emit, -lines)
    return _size(target, size_line)


def _follow(transport, target, path, offset, pattern, emit, poll_s, should_stop, follow_job) -> str:
    partial = ""
    while not should_stop():
        time.sleep(poll_s)
        current, size, chunk = _poll(transport, target, path, offset)
        if size < offset:  # truncated or replaced: start again from its beginning
            offset, partial = 0, ""
            continue
        offset = size
        partial += chunk
        *complete, partial = partial.split("\n")
        _emit(complete, pattern, emit)
        if follow_job and current and current != path and _is_file(transport, current):
            _emit([partial] if partial else [], pattern, emit)
            path, offset, partial = current, 0, ""
            emit(f"==> following {inert(path)} (a newer log) <==")
    return path


def _poll(transport, target: Target, path: str, offset: int) -> tuple[str | None, int, str]:
    """(the job's current log, the size of `path`, its bytes after `offset`) in one round trip."""
    job = target.job
    script = shell_command(
        "log_follow.sh", jobpaths.state_file(job), str(jobstate.MAX_BYTES), job.log_dir, path, str(offset)
    )
    out = transport.check(script, timeout=60, step="follow log").stdout
    state_line, _, rest = out.partition("\n")
    listing, _, rest = rest.partition("\n")
    size_line, _, chunk = rest.partition("\n")
    state = jobstate.parse(state_line.strip())
    current = state.log if state is not None and state.log else _newest_path(target, listing)
    return current, _size(target, size_line), chunk


def _is_file(transport, path: str) -> bool:
    return transport.run(shlex.join(["test", "-f", path]), timeout=30, step="follow log").ok


def _emit(lines: list[str], pattern: re.Pattern | None, emit: Callable[[str], None], start: int = 0) -> None:
    for line in [line for line in lines if pattern is None or pattern.search(line)][start:]:
        emit(inert_log_line(line))


def _size(target: Target, line: str) -> int:
    if not line.strip().isdigit():
        raise DflashOpsError(f"[{target.name}] read log: expected the log's size, got {line.strip()[:80]!r}")
    return int(line)
