"""The bash scripts run on targets are package data: every one the code names ships with the
package (an installed wheel included), and each passes shellcheck."""
from __future__ import annotations

import importlib.resources
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflash_ops import remote

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dflash_ops"
REMOTE = PACKAGE / "remote"


def scripts_named_in_code() -> set[str]:
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"""["']([A-Za-z0-9_]+\.sh)["']""", path.read_text(encoding="utf-8")))
    return named


def test_every_script_the_code_names_is_package_data_and_none_is_orphaned():
    named = scripts_named_in_code()
    shipped = {p.name for p in REMOTE.glob("*.sh")}
    assert named and named == shipped, (named, shipped)
    package = importlib.resources.files("dflash_ops.remote")
    for name in sorted(named):
        assert package.joinpath(name).is_file(), name
        assert remote.script_source(name).startswith("#!/usr/bin/env bash\n"), name


def test_the_wheel_carries_every_script(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("dflash_ops", "trainer"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert build.returncode == 0, build.stderr
    wheel, = (tmp_path / "dist").glob("dflash_ops-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = {f"dflash_ops/remote/{n}" for n in scripts_named_in_code()} - names
    assert not missing, missing


def test_the_code_sent_holds_no_single_quote_so_a_dry_run_shows_it_as_it_is():
    for name in scripts_named_in_code():
        code = remote.shell_code(name)
        assert "'" not in code and "#!" not in code, name
        shown = remote.shell_command(name, "arg")
        assert shown.startswith("bash -c '" + code) and shown.endswith(f"' {name} arg"), name


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_every_script_is_shellcheck_clean():
    scripts = sorted(str(p) for p in REMOTE.glob("*.sh"))
    result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_arguments_reach_a_script_unchanged(tmp_path):
    hostile = ["a b", "$(touch PWNED)", "`touch PWNED2`", "'q'", '"d"', "x\ny", "", "-n", "--"]
    for value in hostile:
        argv = remote.shell_argv("purge_cache.sh", str(tmp_path / "absent" / value), "marker")
        assert argv[4] == str(tmp_path / "absent" / value)
        shown = subprocess.run(["bash", "-c", remote.shell_command("purge_cache.sh", value, "m")],
                               cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert shown.stdout == "absent\n", (value, shown)
    assert not list(tmp_path.rglob("PWNED*"))
