"""One time budget for a `status`/`health` check (NRPE: 10 s), shared out so a hung part reports
UNKNOWN for itself while the others are still reported; a watchdog holds the total."""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable, TypeVar

from dflash_ops.job.model import Target

DEFAULT_HEALTH_S = 10.0  # NRPE's default check timeout
DEFAULT_STATUS_S = 20.0

CONNECT_SHARE = 0.3  # ssh connect, banner and auth (each; also the jump host's)
PARTS_SHARE = 0.6  # the probe's slow parts (GPU query, tmux), side by side
HOST_PARTS_SHARE = 0.35  # each of the two in turn when the GPUs are asked on the Proxmox host
MARGIN_S = 1.0  # the answer's way back and the verdict, after the remote command ends
STARTUP_S = 1.0  # the probe's python starting and writing its answer, around the parts

HOOK_SHARE = 0.25  # `health --on-change`: the hook's part of the budget, at most HOOK_MAX_S
HOOK_MAX_S = 3.0

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Shares:
    total_s: float
    connect_s: float  # each ssh connection step
    part_s: float  # each slow part of the probe
    run_s: float  # the probe's whole run (the remote `timeout`)


def split(total_s: float, gpu_on_host: bool = False) -> Shares:
    """Shares of `total_s`; a GPU query on the Proxmox host runs before the probe, so each gets less."""
    # the remote `timeout` counts whole seconds: round down, so it never outlasts the budget
    run_s = max(1.0, math.floor(total_s - MARGIN_S))
    # the parts end a second before the run's limit: python starts, the answer is written
    turns = 2 if gpu_on_host else 1
    part_s = min(total_s * (HOST_PARTS_SHARE if gpu_on_host else PARTS_SHARE), (run_s - STARTUP_S) / turns)
    return Shares(total_s, max(0.5, total_s * CONNECT_SHARE), max(0.5, part_s), run_s)


def limit_connect(target: Target, connect_s: float) -> Target:
    if target.ssh is None or target.ssh.connect_timeout_s <= connect_s:
        return target
    return dataclasses.replace(target, ssh=dataclasses.replace(target.ssh, connect_timeout_s=connect_s))


def within(seconds: float, work: Callable[[], T], on_timeout: Callable[[], T]) -> T:
    """work() if it returns within `seconds`, else on_timeout(); the abandoned work is a daemon thread."""
    box: dict = {}

    def run():
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="budgeted-check", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return on_timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]
