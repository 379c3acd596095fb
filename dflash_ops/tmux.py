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


def new_session(job: Job, command: str, quoted_args: str = "") -> str:
    """Start `command` (a bash script) in a detached session; `quoted_args` are shell words
    (already quoted, may reference the caller's variables) passed to it as $0 $1 ….

    The tmux server daemonizes, so this survives the end of the ssh / pct exec call, unlike nohup.
    `remain-on-exit` keeps a crashed pane (and its exit status) visible to status and health.
    """
    # One tmux invocation (";" separates tmux commands), so the option is set before the server
    # can reap a command that fails at once.
    start = tmux(job, "new-session", "-d", "-s", job.session, "-x", "200", "-y", "50", "bash", "-c", command)
    keep = " ".join(
        shlex.quote(a) for a in (";", "set-option", "-w", "-t", exact(job) + ":", "remain-on-exit", "on")
    )
    return f"{start} {quoted_args} {keep}"


def attach(job: Job) -> str:
    return tmux(job, "attach-session", "-t", exact(job))
