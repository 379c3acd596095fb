"""The README's first set-up command (read from the README by .ci/fresh_machine.sh, which runs it for
real, twice, in CI) asks apt for exactly what a stock Debian/Ubuntu lacks: tmux, and python3-venv
when the system python has no ensurepip. Here apt-get and python3 are stand-ins on an otherwise
empty PATH, and the run stops where the virtualenv would be made."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

APT_GET = """#!/bin/bash
echo "apt-get $*" >> "$CALLS"
if [ "$1" = install ]; then for p in "$@"; do [ "$p" = python3-venv ] && touch "$HAS_ENSUREPIP"; done; fi
exit 0
"""
# ensurepip is there once $HAS_ENSUREPIP exists; `-m venv` only records itself and stops the command
PYTHON3 = """#!/bin/bash
if [ "$1" = -c ]; then [ -e "$HAS_ENSUREPIP" ]; exit; fi
echo "python3 $*" >> "$CALLS"
exit 1
"""


def readme_command() -> str:
    out = subprocess.run(["bash", str(REPO / ".ci" / "fresh_machine.sh"), "--print-command"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    assert "python3 -m venv .venv" in out and "torch==2.13.0" in out
    return out


@pytest.mark.parametrize("have_tmux, have_ensurepip, apt", [
    (True, True, []),
    (False, False, ["apt-get update", "apt-get install -y tmux python3-venv"]),
    (True, False, ["apt-get update", "apt-get install -y tmux python3-venv"]),
    (False, True, ["apt-get update", "apt-get install -y tmux python3-venv"]),
])
def test_apt_installs_what_is_missing_then_the_venv_is_made(tmp_path, have_tmux, have_ensurepip, apt):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("apt-get", APT_GET), ("python3", PYTHON3)) + ((("tmux", "#!/bin/true\n"),) if have_tmux else ()):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls, ensurepip = tmp_path / "calls", tmp_path / "has-ensurepip"
    if have_ensurepip:
        ensurepip.touch()
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CALLS": str(calls), "HAS_ENSUREPIP": str(ensurepip)}
    proc = subprocess.run(["/bin/bash", "-c", readme_command()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0  # the stand-in python3 stops it at the virtualenv
    assert calls.read_text().splitlines() == apt + ["python3 -m venv .venv"]
    assert not os.path.exists(tmp_path / ".venv")
