"""Scripts that run ON the target. Each is standalone (standard library only, Python >= 3.8)
because the target may have nothing but a system python3; dflash-ops sends their text."""
from __future__ import annotations

import json
import pathlib
import shlex


def script_source(filename: str) -> str:
    """The text of a script in this package, to hand to python on the target."""
    return (pathlib.Path(__file__).parent / filename).read_text(encoding="utf-8")


def pick_python(python: str, who: str) -> str:
    """Shell lines setting $py to the job's python, or python3 when that is not installed yet
    (e.g. before the first deploy); exit 127 with a message naming `who` when neither exists."""
    q = shlex.quote(python)
    return (f"py={q}\n"
            'if [ ! -x "$py" ]; then py=$(command -v python3) || {\n'
            f"  printf '%s: neither %s nor python3 is installed\\n' {shlex.quote(who)} {q} >&2; exit 127; }}\n"
            "fi\n")


def python_stdin_command(python: str, filename: str, args: dict) -> str:
    """Run script `filename` with its source on stdin (the caller passes script_source(filename)
    as stdin): a short command line that --dry-run can print; arguments as one quoted JSON word."""
    return pick_python(python, filename) + f'"$py" - {shlex.quote(json.dumps(args))}  # stdin: {filename}\n'
