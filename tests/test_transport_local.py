"""LocalTransport details that the shared round-trip tests do not reach."""
from __future__ import annotations

import os
import stat
import time

import pytest

from dflash_ops.errors import TransportError
from dflash_ops.transport.local import LocalTransport


def test_put_mode_ignores_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        LocalTransport("local").put(b"x", str(tmp_path / "a" / "b.sh"), mode=0o755)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b.sh").st_mode) == 0o755


def test_put_failure_names_the_path_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("i am a file, not a directory")
    with pytest.raises(TransportError) as info:
        LocalTransport("local").put(b"x", str(tmp_path / "file" / "inside"), step="upload")
    assert "upload" in str(info.value) and str(tmp_path / "file" / "inside") in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_background_child_holding_stdout_does_not_hang_the_run():
    start = time.monotonic()
    result = LocalTransport("local").run("echo started; sleep 20 &")
    assert (result.exit_code, result.stdout) == (0, "started\n")
    assert time.monotonic() - start < 5
