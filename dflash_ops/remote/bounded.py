"""Commands and calls bounded by a deadline, because a wedged driver can hang nvidia-smi or NVML."""

from __future__ import annotations

import os
import subprocess
import threading
import time


def start(argv):
    """Start argv now and collect it with `finish`, so the probe's commands run side by side."""
    try:
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        return (127, "", "%s: command not found" % argv[0])


def finish(started, deadline):
    """(exit code, stdout, stderr) by `deadline`; 127: no such program, 124: out of time (killed)."""
    if isinstance(started, tuple):
        return started
    try:
        out, err = started.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        started.kill()
        started.communicate()
        return 124, "", "%s gave no answer within the probe's time" % os.path.basename(started.args[0])
    return started.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def out_of_time(what, part_s):
    return {
        "error": "%s gave no answer within %.1f s (a wedged driver or a hung command)" % (what, part_s),
        "out_of_time": True,
    }


def in_thread(fn, deadline, *args):
    """fn(*args), or None at `deadline` (a hung in-process call cannot be killed: left in a daemon thread)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else None
