"""tmux commands for the job's session, as shell snippets sent through a transport.

The job always runs on its own tmux socket (`tmux -L <socket>`), so nothing we do touches the
user's own tmux sessions; targets use `=NAME` because plain names prefix-match.
"""

from __future__ import annotations

import shlex

from .model import Job


def tmux(job: Job, *args: str) -> str:
    return " ".join(["tmux", "-L", shlex.quote(job.tmux_socket), *(shlex.quote(a) for a in args)])


def exact(job: Job) -> str:
    return "=" + job.session


def has_session(job: Job) -> str:
    return tmux(job, "has-session", "-t", exact(job)) + " 2>/dev/null"


def pane_pids(job: Job) -> str:
    """Prints `PID DEAD STATUS` for every pane (nothing when the session is gone)."""
    # `=NAME:` (the session's windows): list-panes -s -t =NAME still prefix-matches in tmux 3.3
    return (
        tmux(
            job,
            "list-panes",
            "-s",
            "-t",
            exact(job) + ":",
            "-F",
            "#{pane_pid} #{pane_dead} #{pane_dead_status}",
        )
        + " 2>/dev/null"
    )


def kill_session(job: Job) -> str:
    return tmux(job, "kill-session", "-t", exact(job)) + " 2>/dev/null"


def attach(job: Job) -> str:
    return tmux(job, "attach-session", "-t", exact(job))
