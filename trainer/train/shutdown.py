"""Stopping on SIGTERM/SIGINT, also when a worker thread is stuck (e.g. in a compile that hangs).

- First signal: finish the running step, write a checkpoint, exit 0.
- That step does not finish within `run.stop_grace_s`: the main thread gives up on it, logs which
  threads are still busy, writes the `done` record (interrupted) and exits with status 130 and
  no new checkpoint (the last periodic one stays). A stuck thread cannot be joined, and it may
  keep the interpreter's exit handlers waiting, so the exit is immediate (os._exit).
- Second signal: abort at once, the same way.
- Backstop (`watchdog=True`, the threaded trainer): a watchdog process (trainer.train.stop_watchdog)
  sees the signal even when the Python handler never gets to run (a thread holding the GIL in C
  code): if the trainer is still alive WATCHDOG_MARGIN_S after the grace period, it has every
  thread's stack printed, logs one line and SIGKILLs the trainer. Without that process (it could
  not start) the handler arms faulthandler's timer instead (stacks, exit status 1). The caller
  must call step_finished() when the running step is done: that disarms both before the
  checkpoint is written.

`dflash-ops stop|relaunch --grace S` (default 30) sends ONE SIGTERM to the job's processes and
SIGKILLs whatever is left after S seconds; trainer.stop_timing says how much S must leave, so that
a stuck trainer is ended by itself or its watchdog, with their log lines, before that SIGKILL.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from trainer.stop_timing import DEFAULT_STOP_GRACE_S, WATCHDOG_MARGIN_S
from trainer.train.stop_watchdog import StopWatchdog

EXIT_ABORTED = 130


class StopRequest:
    """SIGTERM/SIGINT ask for a graceful stop (finish the step, checkpoint, exit); a second one aborts."""

    def __init__(self, grace_s: float = DEFAULT_STOP_GRACE_S, watchdog: bool = False):
        self.grace_s = grace_s
        self.use_watchdog = watchdog
        self.requested = False
        self.signal_name = ""
        self.requested_at: float | None = None
        self.last_step = 0  # steps done so far, for the `done` record of an abort
        self._previous: dict[int, Any] = {}  # signal number -> the handler it had before
        self._watchdog = False
        self._process_watchdog: StopWatchdog | None = None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.use_watchdog:
                self._process_watchdog = StopWatchdog.start(self.grace_s + WATCHDOG_MARGIN_S)
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"second {name}: stopping without a checkpoint")
        self.requested, self.signal_name, self.requested_at = True, name, time.monotonic()
        if self.use_watchdog and self._process_watchdog is None:
            faulthandler.dump_traceback_later(self.grace_s + WATCHDOG_MARGIN_S, exit=True)
            self._watchdog = True

    def overdue(self) -> str | None:
        """Why to stop waiting for the running step (None: keep waiting)."""
        if self.requested_at is None or time.monotonic() - self.requested_at < self.grace_s:
            return None
        return f"{self.signal_name} {self.grace_s:g} s ago (run.stop_grace_s)"

    def step_finished(self) -> None:
        """The step that was running at the signal is done: the main thread is in control again."""
        if self._process_watchdog is not None:
            self._process_watchdog.disarm()
        if self._watchdog:
            faulthandler.cancel_dump_traceback_later()
            self._watchdog = False

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._process_watchdog is not None:
            self._process_watchdog.close()
            self._process_watchdog = None


def worker_threads_alive() -> list[str]:
    """Names of this process's worker threads (trainer.train.workers marks them) still running."""
    return [t.name for t in threading.enumerate() if getattr(t, "dflash_worker", False) and t.is_alive()]


def exit_if_threads_stuck(code: int) -> None:
    """After an abort: leave NOW if worker threads are still running (they would hold up exit)."""
    stuck = worker_threads_alive()
    if not stuck:
        return
    print(f"dflash-train: exiting with threads still running: {', '.join(stuck)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
