"""Writes the job state file (json-encoded, renamed into place so no reader sees half of it); stdlib only.
The pane runs it when the run completes: PYTHON -I -c SOURCE STATE_FILE STATE_JSON TIME_FIELD."""

import contextlib
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
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def stamped(state, field):
    return dict(state, **{field: int(time.time())})


if __name__ == "__main__":
    write(sys.argv[1], stamped(json.loads(sys.argv[2]), sys.argv[3]))
