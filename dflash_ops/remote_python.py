"""Run a stdlib-only Python script on the target in the same round trip as any shell around it."""
from __future__ import annotations

import json
import shlex

from .model import Job


def python_command(job: Job, source: str, args: dict) -> str:
    """Shell snippet running `source` with the job's python (falling back to python3).

    The source travels as one `-c` argument and the arguments as one JSON argument, both quoted,
    so nothing in them is ever parsed by a shell.
    """
    py = shlex.quote(job.python)
    return (f"PY={py}; [ -x \"$PY\" ] || PY=python3; "
            f"\"$PY\" -c {shlex.quote(source)} {shlex.quote(json.dumps(args))}")
