"""Writes the job state file that dflash_ops.job.jobstate reads: the state encoded by json (a
hostile path stays data), a whole new file renamed into place so a reader never sees half a state.
Standard library only, Python >= 3.8.

The launcher imports it (remote.bundle() sends it ahead of each remote script); the tmux pane runs
its text when the trainer has completed the run:
    PYTHON -I -c SOURCE STATE_FILE STATE_JSON TIME_FIELD
which writes the object STATE_JSON with TIME_FIELD set to the time now (unix seconds)."""

import json
import os
import sys
import time


def write(path, state):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(state, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def stamped(state, field):
    """`state` with `field` set to the time now, in whole unix seconds."""
    return dict(state, **{field: int(time.time())})


if __name__ == "__main__":
    write(sys.argv[1], stamped(json.loads(sys.argv[2]), sys.argv[3]))
