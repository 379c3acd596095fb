"""A watchdog process that ends the trainer when a stop signal cannot reach its Python code.

A Python signal handler runs only when the main thread executes bytecode, which a thread holding
the GIL in C can prevent forever. The C part of the handler still writes the signal's number to the
wakeup fd (signal.set_wakeup_fd): a pipe to this stdlib-only child, which so sees every SIGTERM/SIGINT.
A stop signal arms it; the trainer writes DISARM once the running step is done. Still armed `after_s`
later, it has the trainer print every thread's stack (SIGUSR2), writes one line to its stderr and
SIGKILLs it. It ignores the job's signals itself, exits with the trainer, and signals only its parent.

Run as `python -I -S stop_watchdog.py TRAINER_PID READ_FD AFTER_S` (StopWatchdog.start does).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import signal
import subprocess
import sys
import time

DISARM = 0  # the byte the trainer writes when its main thread is in control again (signal numbers are > 0)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STACKS_SIGNAL = signal.SIGUSR2  # the trainer's faulthandler prints every thread's stack on it
STACKS_WAIT_S = 0.5  # for the stacks to be written before the SIGKILL
POLL_S = 0.5  # how often it checks that the trainer is still its parent

_running: StopWatchdog | None = None  # this process's, for a child forked from it to let go of


class StopWatchdog:
    """The trainer's side: the pipe, the wakeup fd and the child process."""

    def __init__(self, proc: subprocess.Popen, write_fd: int, previous_wakeup_fd: int):
        self.proc, self.write_fd, self.previous_wakeup_fd = proc, write_fd, previous_wakeup_fd

    @classmethod
    def start(cls, after_s: float) -> StopWatchdog | None:
        """Call from the main thread after the stop handlers are installed. None: it could not start."""
        read_fd, write_fd = os.pipe()  # neither end is inherited by other children (PEP 446)
        try:
            os.set_blocking(write_fd, False)  # set_wakeup_fd requires it; a signal handler must never block
            # fd 2: where the watchdog writes too
            faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True)
            watch_args = [str(os.getpid()), str(read_fd), f"{after_s:g}"]  # TRAINER_PID READ_FD AFTER_S
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), *watch_args],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            os.close(write_fd)
            print(
                f"dflash-train: warning: no stop watchdog ({exc}); a thread stuck in C code can keep "
                f"SIGTERM from ending the trainer",
                file=sys.stderr,
            )
            return None
        finally:
            os.close(read_fd)
        global _running
        _running = cls(proc, write_fd, signal.set_wakeup_fd(write_fd))
        return _running

    def disarm(self) -> None:
        """The step that ran at the stop signal is done: the main thread handles the stop itself."""
        with contextlib.suppress(OSError):  # the watchdog is gone: nothing to disarm
            os.write(self.write_fd, bytes([DISARM]))

    def close(self) -> None:
        """The trainer is done: the watchdog sees the pipe close and exits."""
        global _running
        _running = None
        signal.set_wakeup_fd(self.previous_wakeup_fd)
        faulthandler.unregister(STACKS_SIGNAL)
        os.close(self.write_fd)
        # on a timeout it still sees its parent gone once this process exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2 * POLL_S + 1)


def _let_go_in_forked_child() -> None:
    """A forked child's signals are not the trainer's; its copy of the pipe would hide the trainer's exit."""
    global _running
    if _running is not None:
        # not the main thread: Python then delivers no signals to handlers here anyway
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        os.close(_running.write_fd)
        _running = None


os.register_at_fork(after_in_child=_let_go_in_forked_child)


# ---- the watchdog process (stdlib only; runs without the trainer's modules) -------------------


def watch(trainer_pid: int, read_fd: int, after_s: float) -> None:
    for sig in (*STOP_SIGNALS, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    armed_at, armed_by = None, ""
    while os.getppid() == trainer_pid:
        now = time.monotonic()
        wait = POLL_S if armed_at is None else max(0.0, min(POLL_S, armed_at + after_s - now))
        if select.select([read_fd], [], [], wait)[0]:
            data = os.read(read_fd, 64)
            if not data:
                return  # the trainer exited (or closed its end when done)
            for byte in data:
                if byte == DISARM:
                    armed_at = None
                elif byte in STOP_SIGNALS and armed_at is None:
                    armed_at, armed_by = time.monotonic(), signal.Signals(byte).name
        if armed_at is not None and time.monotonic() - armed_at >= after_s:
            end_trainer(trainer_pid, armed_by, time.monotonic() - armed_at)
            return


def end_trainer(trainer_pid: int, armed_by: str, waited_s: float) -> None:
    if os.getppid() != trainer_pid:
        return  # it exited meanwhile: that pid may now be another process's
    os.kill(trainer_pid, STACKS_SIGNAL)
    time.sleep(STACKS_WAIT_S)
    if os.getppid() != trainer_pid:
        return
    line = (
        f"dflash-train watchdog: pid {trainer_pid} still running {waited_s:.0f} s after "
        f"{armed_by}: the interpreter did not get control back (a thread stuck in C code, "
        f"stacks above); ending it with SIGKILL\n"
    )
    os.write(2, line.encode())
    os.kill(trainer_pid, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
