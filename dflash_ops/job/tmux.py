"""tmux commands for the job's session: its own socket keeps the user's sessions untouched, and
`=NAME` because plain names prefix-match."""

from __future__ import annotations

import shlex

from dflash_ops.job.model import Job
from dflash_ops.remote import procs


def tmux(job: Job, *args: str) -> str:
    return shlex.join(["tmux", "-L", job.tmux_socket, *(procs.tmux_word(a) for a in args)])


def exact(job: Job, session: str | None = None) -> str:
    return "=" + (session or job.session)


def has_session(job: Job, session: str | None = None) -> str:
    """`session`: another name the job runs under (a job launched by an earlier version)."""
    return tmux(job, "has-session", "-t", exact(job, session)) + " 2>/dev/null"


def pane_pids(job: Job) -> str:
    """Prints the session's panes as remote.procs.PANE_FORMAT lines (nothing when it is gone)."""
    return shlex.join(procs.pane_command(job.tmux_socket, job.session)) + " 2>/dev/null"


def pane_problem(answer: str) -> str | None:
    """Why the job's trainer is not running, from pane_pids' answer (None while it runs)."""
    panes = procs.parse_panes(answer)
    if not panes:
        return "the tmux session is gone"
    if panes[0]["dead"]:
        status = panes[0]["status"]
        return "the trainer exited" + (f" with code {status}" if status is not None else "")
    return None


def kill_session(job: Job, session: str | None = None) -> str:
    return tmux(job, "kill-session", "-t", exact(job, session)) + " 2>/dev/null"


def attach(job: Job) -> str:
    return tmux(job, "attach-session", "-t", exact(job))
