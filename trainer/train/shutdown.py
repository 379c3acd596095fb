"""Stopping on SIGTERM/SIGINT, also when a worker thread is stuck (e.g. in a compile that hangs).

- First signal: finish the running step, write a checkpoint, exit 0.
- The step not done within `run.stop_grace_s`, or a second signal: log the busy threads, write the
  `done` record (interrupted), exit 130 at once (os._exit: a stuck thread cannot be joined and may
  hold up the exit handlers) without a new checkpoint.
- Backstop (`watchdog=True`, the threaded trainer): WATCHDOG_MARGIN_S after the grace period,
  trainer.train.stop_watchdog (which sees the signal even when no Python handler can run), else
  faulthandler's timer (exit 1), prints the stacks and ends the trainer. step_finished() disarms both.

trainer.stop_timing says how much of `dflash-ops stop --grace S` this leaves before its SIGKILL.
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
    if not (stuck := worker_threads_alive()):
        return
    print(f"dflash-train: exiting with threads still running: {', '.join(stuck)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
