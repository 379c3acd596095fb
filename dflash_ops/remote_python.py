"""Run a stdlib-only Python script on the target, its source fed on stdin.

Feeding the source on stdin keeps the command line short and readable (it is what --dry-run
prints); the arguments travel as one quoted JSON word, so no shell ever parses them.
"""
from __future__ import annotations

import json
import shlex

from .model import Job


def python_stdin_command(job: Job, script_name: str, args: dict) -> str:
    """`python - ARGS` with the job's python, falling back to python3 (e.g. before the first deploy)."""
    py = shlex.quote(job.python)
    return (f"PY={py}; [ -x \"$PY\" ] || PY=python3; "
            f"\"$PY\" - {shlex.quote(json.dumps(args))}  # stdin: {script_name}")
