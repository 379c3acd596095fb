"""Scripts that run ON the target, kept as files of this package so linters see them.

Python scripts (*.py) are standalone (standard library only, Python >= 3.8) because the target may
have nothing but a system python3. dflash-ops sends a script's text on python's stdin, preceded by
the shared modules it imports (bundle()), so nothing needs installing there and the command line
(what --dry-run prints, what `ps` shows) stays short.

Bash scripts (*.sh) take every value as a positional argument ("$1"...), so no value is ever
spliced into their text; shell_argv() (or shell_command(), the same as one command line) is the
one way they travel."""

from __future__ import annotations

import functools
import importlib.resources
import json
import pathlib
import shlex

from trainer import metrics_format, metrics_history


_HERE = pathlib.Path(__file__).parent
# (module name on the target, file) of the stdlib-only modules every remote script may import, each
# after the ones it imports; a script that needs none of the helpers still gets them (a few KiB)
SHARED_MODULES = (
    ("facts", _HERE / "facts.py"),
    ("metrics_format", pathlib.Path(metrics_format.__file__)),
    ("bounded", _HERE / "bounded.py"),
    ("procs", _HERE / "procs.py"),
    ("gpu_read", _HERE / "gpu_read.py"),
    ("gpu_faults", _HERE / "gpu_faults.py"),
    ("metrics_history", pathlib.Path(metrics_history.__file__)),
    ("runs", _HERE / "runs.py"),
    ("state_write", _HERE / "state_write.py"),
)


def script_source(filename: str) -> str:
    """The text of a script in this package (package data, wherever the package is installed)."""
    return importlib.resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def shell_code(filename: str) -> str:
    """Bash script `filename` as it travels: without its whole-line comments, which are for readers
    of the file. Its code holds no single quote, so a quoted command line (what --dry-run prints)
    shows the code as it is."""
    lines = script_source(filename).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#")) + "\n"


def shell_argv(filename: str, *args: str) -> list[str]:
    """argv running bash script `filename` with `args` as its "$1"...; $0 names the file, so bash's
    own errors say which script they come from."""
    # The text travels as `bash -c`'s argument rather than on stdin: stdin is taken where the
    # script receives data (put's bytes) or shares a command with a remote Python script.
    return ["bash", "-c", shell_code(filename), filename, *args]


def shell_command(filename: str, *args: str) -> str:
    """shell_argv as one command line, every word quoted (the script for Transport.run)."""
    return shlex.join(shell_argv(filename, *args))


@functools.lru_cache(maxsize=None)
def bundle(filename: str) -> bytes:
    """Script `filename` as one self-contained program: the shared modules are defined first
    (registered under their plain names, which the script imports when not run from this package),
    then the script runs as __main__ (its own text compiled whole, `from __future__` included)."""
    prelude = ["import sys as _sys, types as _types"]
    for name, path in SHARED_MODULES:
        prelude.append(
            f"_m = _sys.modules[{name!r}] = _types.ModuleType({name!r}); "
            f"exec(compile({path.read_text(encoding='utf-8')!r}, {name!r}, 'exec'), _m.__dict__)"
        )
    prelude.append(
        f"exec(compile({script_source(filename)!r}, {filename!r}, 'exec'), {{'__name__': '__main__'}})"
    )
    return ("\n".join(prelude) + "\n").encode()


def python_command(python: str, filename: str, args: dict, who: str | None = None) -> str:
    """The command running script `filename` with the job's python (python3 before the first
    deploy; remote/run_python.sh); the caller passes bundle(filename) as stdin. Its arguments are
    one JSON word."""
    return shell_command("run_python.sh", python, filename, who or filename, json.dumps(args))
