"""The `local` target: bash on this machine, with the same time-limit semantics as remote targets."""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import tempfile
import threading
import time

from dflash_ops.errors import TransportError
from dflash_ops.transport.base import AFTER_EXIT_S, Transport, decode, outlived


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: a child killed by signal N reads as 128+N, as bash reports it."""
    return 128 - returncode if returncode < 0 else returncode


class LocalTransport(Transport):
    def _execute(
        self, argv: list[str], stdin: bytes | None, limit_s: float, step: str
    ) -> tuple[int, bytes, bytes, float]:
        start = time.monotonic()
        try:
            # Own session: `timeout` then signals only the script's process group, never us.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise TransportError(self.name, step, f"cannot start {argv[0]!r}: {exc}") from None
        out: list[bytes] = []
        err: list[bytes] = []
        threads = [
            threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True),
        ]
        if stdin is not None:
            threads.append(threading.Thread(target=feed, args=(proc.stdin, stdin), daemon=True))
        for t in threads:
            t.start()
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            _join(threads, AFTER_EXIT_S)
            raise outlived(self.name, step, limit_s, b"".join(err), "killed its process group") from None
        # A background child that inherited stdout (`cmd &`) may keep the pipe open for as long as
        # it lives: take what arrived shortly after the exit, as the ssh transport does.
        _join(threads, AFTER_EXIT_S)
        return exit_code_of(proc.returncode), b"".join(out), b"".join(err), time.monotonic() - start

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        directory = os.path.dirname(os.path.abspath(remote_path))
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(remote_path)}.tmp.")
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)  # explicit: not subject to the umask, like chmod
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, remote_path)
            tmp = None
        except OSError as exc:
            raise TransportError(self.name, step, f"cannot write {remote_path}: {exc}") from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    @contextlib.contextmanager
    def hold(self, script: str, step: str = "hold", answer_s: float = 30):
        try:
            proc = subprocess.Popen(
                ["bash", "-c", script],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise TransportError(self.name, step, f"cannot start bash: {exc}") from None
        assert proc.stdin is not None and proc.stdout is not None
        try:
            yield _first_line(proc.stdout.fileno(), time.monotonic() + answer_s)
        finally:
            proc.stdin.close()  # EOF: the script ends and lets go of what it held
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
            proc.stdout.close()

    def interactive(self, script: str) -> int:
        return exit_code_of(subprocess.call(["bash", "-c", script]))

    def _command_line_of(self, argv: list[str]) -> str:
        return shlex.join(argv)


def _first_line(fd: int, deadline: float, most: int = 4096) -> str:
    data = b""
    while b"\n" not in data and len(data) < most:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, most)
        if not chunk:
            break
        data += chunk
    return decode(data.split(b"\n", 1)[0])


def _pump(stream, sink: list[bytes]) -> None:
    with stream:
        while True:
            data = stream.read1(65536)
            if not data:
                return
            sink.append(data)


def feed(stream, data: bytes) -> None:
    # the script ended without reading all of it; its exit code tells the story
    with contextlib.suppress(BrokenPipeError, OSError):
        with stream:
            stream.write(data)


def _join(threads: list[threading.Thread], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
