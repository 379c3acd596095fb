"""Scripts that run ON the target, kept as files so linters see them. Python ones are stdlib-only and
travel on stdin after the modules they share (bundle()); bash ones take every value as "$1"...,
so no value is ever spliced into their text."""

from __future__ import annotations

import functools
import importlib.resources
import json
import pathlib
import shlex

from trainer import metrics_format, metrics_history

_HERE = pathlib.Path(__file__).parent
# The stdlib-only modules every remote script may import, each after the ones it imports, under the
# names the scripts import them by (inside packages that hold nothing else on the target); a script
# that needs none of the helpers still gets them (a few KiB)
PACKAGES = ("dflash_ops", "dflash_ops.remote", "trainer")
SHARED_MODULES = (
    ("dflash_ops.remote.facts", _HERE / "facts.py"),
    ("trainer.metrics_format", pathlib.Path(metrics_format.__file__)),
    ("dflash_ops.remote.bounded", _HERE / "bounded.py"),
    ("dflash_ops.remote.procs", _HERE / "procs.py"),
    ("dflash_ops.remote.gpu_read", _HERE / "gpu_read.py"),
    ("dflash_ops.remote.gpu_faults", _HERE / "gpu_faults.py"),
    ("trainer.metrics_history", pathlib.Path(metrics_history.__file__)),
    ("dflash_ops.remote.runs", _HERE / "runs.py"),
    ("dflash_ops.remote.state_write", _HERE / "state_write.py"),
)


def script_source(filename: str) -> str:
    """The text of a script in this package (package data, wherever the package is installed)."""
    return importlib.resources.files(__name__).joinpath(filename).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def shell_code(filename: str) -> str:
    """Bash script `filename` without whole-line comments; no single quote in it, so it quotes cleanly."""
    lines = script_source(filename).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#")) + "\n"


def shell_argv(filename: str, *args: str) -> list[str]:
    """argv running bash script `filename` with `args` as "$1"...; $0 names the file for bash's errors."""
    # The text travels as `bash -c`'s argument rather than on stdin: stdin is taken where the
    # script receives data (put's bytes) or shares a command with a remote Python script.
    return ["bash", "-c", shell_code(filename), filename, *args]


def shell_command(filename: str, *args: str) -> str:
    """shell_argv as one command line, every word quoted (the script for Transport.run)."""
    return shlex.join(shell_argv(filename, *args))


@functools.lru_cache(maxsize=None)
def bundle(filename: str) -> bytes:
    """Script `filename` as one program: the shared modules defined first, then the script as __main__."""
    prelude = ["import sys as _sys, types as _types"]
    prelude += [f"_sys.modules[{name!r}] = _types.ModuleType({name!r})" for name in PACKAGES]
    for name, path in SHARED_MODULES:
        package, _, module = name.rpartition(".")
        prelude.append(
            f"_m = _sys.modules[{name!r}] = _types.ModuleType({name!r}); "
            f"setattr(_sys.modules[{package!r}], {module!r}, _m); "
            f"exec(compile({path.read_text(encoding='utf-8')!r}, {name!r}, 'exec'), _m.__dict__)"
        )
    prelude.append(
        f"exec(compile({script_source(filename)!r}, {filename!r}, 'exec'), {{'__name__': '__main__'}})"
    )
    return ("\n".join(prelude) + "\n").encode()


def python_command(python: str, filename: str, args: dict, who: str | None = None) -> str:
    """The command running `filename` with the job's python (python3 before deploy); args: one JSON word."""
    return shell_command("run_python.sh", python, filename, who or filename, json.dumps(args))
