"""A test run leaves no tmux servers or socket files behind (tmux 3.3 keeps a dead server's socket
file, so `kill-server` alone is not enough)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_test_that_starts_tmux_leaves_nothing_in_the_socket_dir():
    # A short dir: unix socket paths are limited to 108 bytes.
    tmux_dir = Path(tempfile.mkdtemp(prefix="tmx-", dir="/tmp"))
    try:
        env = {**os.environ, "TMUX_TMPDIR": str(tmux_dir), "PYTHONPATH": str(REPO)}
        # a test that starts a tmux server on its own socket and ends it with kill-server
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_status.py::test_status_of_a_live_session_from_a_real_probe"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-2000:]
        left = sorted(str(p.relative_to(tmux_dir)) for p in tmux_dir.rglob("*") if not p.is_dir())
        assert left == [], f"socket files left behind: {left}"
    finally:
        shutil.rmtree(tmux_dir, ignore_errors=True)
