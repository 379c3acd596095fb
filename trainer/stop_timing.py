"""How long a stopping trainer may take, in the one place both the trainer and dflash-ops read it.

After SIGTERM the running step (with the one started ahead of it, which the trainer allows only while
two steps take half the grace at most) has `run.stop_grace_s` (default DEFAULT_STOP_GRACE_S) to finish; a
trainer still alive WATCHDOG_MARGIN_S after that is ended by its watchdog. `dflash-ops stop|relaunch
--grace S` SIGKILLs whatever is left S seconds after its SIGTERM, so S must leave room for both and
for the watchdog's own log line: S >= ops_grace_floor(stop_grace_s).
"""

from __future__ import annotations

DEFAULT_STOP_GRACE_S = 20.0
WATCHDOG_MARGIN_S = 8.0
LOG_MARGIN_S = 1.0  # the watchdog's last line reaches the log before ops' SIGKILL


def ops_grace_floor(stop_grace_s: float) -> float:
    """The shortest `dflash-ops --grace` that lets a trainer with this stop grace end by itself."""
    return stop_grace_s + WATCHDOG_MARGIN_S + LOG_MARGIN_S
