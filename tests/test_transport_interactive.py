"""`interactive` (for `attach`): the user's terminal reaches a pty on the target and back.

Each case runs a small client process on a real pseudo-terminal, types into it, and reads the
screen, as a user at a terminal would.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time

import pytest

from dflash_ops.errors import TransportError
from dflash_ops.transport.local import LocalTransport

CLIENT = r"""
import json, sys
from dflash_ops.job.model import HostSpec
from dflash_ops.transport.local import LocalTransport
from dflash_ops.transport.pct import PctTransport
from dflash_ops.transport.ssh import SshTransport
kind, spec, ctid, script = json.loads(sys.argv[1])
if kind == "local":
    t = LocalTransport("local")
elif kind == "ssh":
    t = SshTransport("box", HostSpec(**spec))
else:
    t = PctTransport("ct", HostSpec(**spec), ctid)
code = t.interactive(script)
t.close()
print(f"\r\nEXIT={code}\r")
"""

# Proves a terminal on the far side (tty succeeds), reads what we type, and exits with a code.
SCRIPT = 'tty >/dev/null && echo "HAS-TTY"; read -r line; echo "GOT<$line>"; exit 7'


def _run_on_pty(argv: list[str], typed: bytes, type_after: bytes = b"HAS-TTY", timeout_s: float = 30,
                until: bytes | None = None) -> tuple[int, str]:
    """Run argv on a new pty; type `typed` once `type_after` shows (and again every 2 s until
    `until` shows, when given); (exit code, screen)."""
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "xterm", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env)
    os.close(slave)
    screen = b""
    typed_at = None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 4096)
                except OSError:  # the client closed the terminal
                    break
                if not data:
                    break
                screen += data
            again = (until is not None and until not in screen and typed_at is not None
                     and time.monotonic() - typed_at > 2)
            if (typed_at is None and type_after in screen) or again:
                os.write(master, typed)
                typed_at = time.monotonic()
            if proc.poll() is not None and not ready:
                break
        return proc.wait(timeout=5), screen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def _client(kind: str, target, script: str) -> list[str]:
    spec = dataclasses.asdict(target.ssh) if kind != "local" else None
    return [sys.executable, "-c", CLIENT, json.dumps([kind, spec, target.ctid, script])]


@pytest.fixture(params=["local", "ssh", "pct"])
def client_argv(request):
    target = request.getfixturevalue({"local": "local_target", "ssh": "ssh_target", "pct": "pct_target"}[request.param])
    return lambda script: _client(request.param, target, script)


def test_terminal_passes_both_ways_and_the_exit_code_returns(client_argv):
    code, screen = _run_on_pty(client_argv(SCRIPT), "hello wörld\r".encode())
    assert "HAS-TTY" in screen, screen
    assert "GOT<hello wörld>" in screen, screen
    assert "EXIT=7" in screen and code == 0, screen


def test_attach_to_a_tmux_session_in_the_container(pct_target):
    # What `dflash-ops attach` does: tmux attach inside the container, detach with C-b d.
    from dflash_ops.transport.factory import make_transport
    with make_transport(pct_target) as t:
        t.check("tmux -L att new-session -d -s job 'echo TRAINING-OUTPUT; sleep 600'")
    try:
        argv = _client("pct", pct_target, "tmux -L att attach -t =job")
        # C-b d (detach), typed once tmux shows the session: keys typed earlier are flushed when
        # tmux sets up the terminal, which may still be under way when the output shows: type it again
        code, screen = _run_on_pty(argv, b"\x02d", type_after=b"TRAINING-OUTPUT", until=b"detached")
        assert "TRAINING-OUTPUT" in screen and "detached" in screen, screen
        assert "EXIT=0" in screen
    finally:
        with make_transport(pct_target) as t:
            t.run("tmux -L att kill-server")


def test_interactive_errors_are_transport_errors(ssh_spec):
    from dflash_ops.transport.ssh import SshTransport
    closed = dataclasses.replace(ssh_spec, port=1)
    with pytest.raises(TransportError) as info:
        SshTransport("box", closed).interactive("true")
    assert "box" in str(info.value) and "attach" in str(info.value)


def test_local_interactive_returns_the_exit_code_without_a_terminal():
    assert LocalTransport("local").interactive("exit 3") == 3
    assert LocalTransport("local").interactive("kill -TERM $$") == 143
