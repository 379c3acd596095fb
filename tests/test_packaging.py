"""The wheel is complete: every file the product reads at run time is in it (an editable install
reads the checkout and would hide a missing one). .ci/installed_wheel.sh runs the commands from an
installed wheel."""
from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What the product opens by path at run time (grep for __file__ and importlib.resources): the
# scripts run on targets (bash, and the stdlib-only Python sent on stdin), the bundled trainer
# configs, the export's modeling files, and the whole trainer package, which `deploy` packs up
# from where it is installed.
RUNTIME_FILES = [
    "dflash_ops/remote/pane.sh",
    "dflash_ops/remote/launch_job.py",
    "dflash_ops/remote/run_python.sh",
    "dflash_ops/remote/probe_script.py",
    "dflash_ops/remote/jobprocs.py",
    "trainer/configs/tiny-cpu.yaml",
    "trainer/configs/gpu-paper.yaml",
    "trainer/hf_modeling/modeling_dflash.py",
    "trainer/hf_modeling/configuration_dflash.py",
    "trainer/metrics_format.py",
    "trainer/train/stop_watchdog.py",
]


def tracked(*folders: str) -> list[str]:
    """The repository's files under `folders` (git's list; the tree itself without git)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", *folders], capture_output=True,
                             check=True, timeout=30).stdout.decode()
        return [name for name in out.split("\0") if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(REPO)) for f in folders for p in (REPO / f).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """`pip wheel --no-deps` of a copy of the repository's files (a checkout's stale build/ must not
    leak into it)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    names = tracked(".")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in names:
            tar.add(REPO / name, arcname=name)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        tar.extractall(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(root / "dist")],
                   check=True, timeout=600)
    (path,) = (root / "dist").glob("dflash_ops-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_every_file_the_product_reads_at_run_time(wheel):
    names = set(wheel.namelist())
    assert [f for f in RUNTIME_FILES if f not in names] == []
    # and everything else under the two packages: a new script or config is covered too
    missing = [f for f in tracked("dflash_ops", "trainer") if f not in names]
    assert missing == []


def test_the_built_in_commands_are_python_and_playbooks_are_only_the_users(wheel):
    # relaunch, stop, ... are dflash_ops.commands; no YAML of theirs ships, and the checkout's
    # top-level playbooks/ holds the user's own files only
    assert "dflash_ops/commands/__init__.py" in wheel.namelist()
    assert not [name for name in wheel.namelist() if name.startswith("dflash_ops/") and name.endswith(".yaml")]
    assert not list((REPO / "playbooks").glob("*.yaml"))
