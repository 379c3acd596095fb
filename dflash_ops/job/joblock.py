"""One command at a time acts on a job: an flock on the target held for the whole command, released when
the command ends or dies (its connection closes with it)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Iterator

from dflash_ops.job import jobpaths
from dflash_ops.errors import JobBusy, TransportError
from dflash_ops.job.model import Target
from dflash_ops.remote import shell_command

# A holder whose connection hung without closing lets go after this long (a relaunch waits for
# its first step at most --timeout, default 900 s)
MAX_HOLD_S = 6 * 3600
_MAX_HOLDER_TEXT = 200


def _printable(text: str) -> str:
    """Text from the target as shown: bounded, control characters (tabs aside) as `?`."""
    return "".join(ch if ch.isprintable() or ch == "\t" else "?" for ch in text[:_MAX_HOLDER_TEXT])


@contextlib.contextmanager
def held(transport, target: Target, command: str) -> Iterator[None]:
    """Hold the job's lock while the block runs (JobBusy when taken); unreachable: left to the steps."""
    # what the lock file says while this process holds it: the command, then who and since when
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    holder = f"{command}\tpid {os.getpid()} on {socket.gethostname()}, since {since}"
    script = shell_command("job_lock.sh", jobpaths.lock_file(target.job), holder, str(MAX_HOLD_S))
    with contextlib.ExitStack() as stack:
        try:
            answer = stack.enter_context(transport.hold(script, step="lock"))
        except TransportError:
            answer = ""
        word, _, rest = answer.partition(" ")
        if word == "busy":  # rest: the holder's line, `relaunch\tpid 812 on laptop, since …`
            other, _, who = _printable(rest).partition("\t")
            other = other.strip() if other.strip().replace("-", "").isalnum() else "dflash-ops command"
            raise JobBusy(
                target.name,
                f"another {other} is running ({who.strip() or 'pid unknown'}); it holds "
                f"{jobpaths.lock_file(target.job)}: nothing was done here, try again when it has finished",
            )
        if word == "error":
            raise JobBusy(target.name, f"cannot take the job's lock: {_printable(rest)}")
        if word != "locked":
            try:
                transport.run("true", timeout=30, step="lock")
            except TransportError:  # unreachable: left to the steps
                pass
            else:
                raise JobBusy(target.name, "cannot take the job's lock: the lock script gave no answer")
        yield
