"""Commands and in-process calls bounded by a deadline, for the remote scripts: a wedged driver can
hang nvidia-smi or NVML, and the script must still answer. Standard library only, Python >= 3.8:
remote.bundle() sends this file's text ahead of each remote script."""

from __future__ import annotations

import os
import subprocess
import threading
import time


def start(argv):
    """Start argv now and collect it later with `finish`: the probe's few commands run side by
    side (one nvidia-smi call alone can take a tenth of a second)."""
    try:
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        return (127, "", "%s: command not found" % argv[0])


def finish(started, deadline):
    """(exit code, stdout, stderr) of a started command, waited for until `deadline` (monotonic);
    127 when the program does not exist, 124 when it ran out of time (and was killed)."""
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
    """fn(*args), or None when it is still running at `deadline` (an in-process call that hangs,
    such as NVML on a wedged driver, cannot be killed: it is left in a daemon thread)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else None
