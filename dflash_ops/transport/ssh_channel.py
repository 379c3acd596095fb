"""Bytes on one paramiko channel: stdout until exit, stdin then EOF, stderr drained, a pty passed through."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time

import paramiko

from dflash_ops.transport.base import AFTER_EXIT_S

POLL_S = 0.5  # how often a waiting read looks at the exit status


def read_until_exit(chan: paramiko.Channel, sink: list[bytes], deadline: float) -> None:
    """Stdout until EOF or AFTER_EXIT_S after the exit status (a background child may hold it open)."""
    grace_end = None
    while True:
        now = time.monotonic()
        if grace_end is None and chan.status_event.is_set():
            grace_end = now + AFTER_EXIT_S
        if grace_end is not None and now >= grace_end:
            return
        if now >= deadline:
            if chan.status_event.is_set():
                return
            raise socket.timeout()
        until = deadline if grace_end is None else min(deadline, grace_end)
        chan.settimeout(min(until - now, POLL_S))
        try:
            data = chan.recv(65536)
        except socket.timeout:
            continue
        if not data:
            return
        sink.append(data)


def first_line(chan: paramiko.Channel, deadline: float, most: int = 4096) -> str:
    data = b""
    while b"\n" not in data and len(data) < most:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        chan.settimeout(min(left, POLL_S))
        try:
            chunk = chan.recv(most)
        except socket.timeout:
            continue
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def feed(chan: paramiko.Channel, data: bytes | None) -> None:
    """Send stdin, then EOF (so a remote `cat` ends; cron has no stdin to offer anyway)."""
    # the command ended without reading all of it; its exit code tells the story
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        if data:
            chan.sendall(data)
        chan.shutdown_write()


def drain(recv, sink: list[bytes]) -> None:
    try:
        while True:
            data = recv(65536)
            if not data:
                return
            sink.append(data)
    except (OSError, EOFError, paramiko.SSHException):
        return


def passthrough(chan: paramiko.Channel) -> None:
    """Copy the user's terminal to a pty channel and back until the remote side ends."""
    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    is_tty = os.isatty(in_fd)
    saved = old_winch = None
    if is_tty:
        import termios
        import tty

        saved = termios.tcgetattr(in_fd)
        tty.setraw(in_fd)

        def resize(*_):
            size = shutil.get_terminal_size()
            chan.resize_pty(width=size.columns, height=size.lines)

        if threading.current_thread() is threading.main_thread():
            old_winch = signal.signal(signal.SIGWINCH, resize)
    watch = [chan, in_fd]
    try:
        while True:
            try:
                ready, _, _ = select.select(watch, [], [])
            except InterruptedError:
                continue
            if chan in ready:
                data = chan.recv(65536)
                if not data:
                    return
                os.write(out_fd, data)
            if in_fd in ready:
                data = os.read(in_fd, 4096)
                if data:
                    chan.sendall(data)
                else:
                    chan.shutdown_write()
                    watch = [chan]
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(in_fd, termios.TCSADRAIN, saved)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
