"""Run one operation on several targets in parallel; one outcome per target, in inventory order."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable

from dflash_ops.job.model import Target


@dataclasses.dataclass
class Outcome:
    target: Target
    value: Any = None
    error: BaseException | None = None


def fan_out(targets: list[Target], fn: Callable[[Target], Any], max_workers: int = 16) -> list[Outcome]:
    if len(targets) == 1:  # keep tracebacks and Ctrl-C simple for the common case
        try:
            return [Outcome(targets[0], fn(targets[0]))]
        except Exception as exc:  # noqa: BLE001 - reported per target by the caller
            return [Outcome(targets[0], error=exc)]
    outcomes = {t.name: Outcome(t) for t in targets}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(targets))) as pool:
        futures = {pool.submit(fn, t): t for t in targets}
        for future in concurrent.futures.as_completed(futures):
            outcome = outcomes[futures[future].name]
            try:
                outcome.value = future.result()
            except Exception as exc:  # noqa: BLE001
                outcome.error = exc
    return [outcomes[t.name] for t in targets]
