"""A job's runs (runs/NNNN) and the rule for which run a launch continues (stdlib only)."""

import os
import re

from trainer import metrics_format

RUN_NAME = re.compile(r"[0-9]{4,}")


def is_run_name(text):
    return isinstance(text, str) and RUN_NAME.fullmatch(text) is not None


def newest(runs):
    names = [n for n in sorted(os.listdir(runs)) if is_run_name(n) and os.path.exists(os.path.join(runs, n))]
    return max(names, key=int, default=None)


def choose(runs, resume):
    """The run a launch uses, created: with `resume` the newest unless finished, else a new one."""
    os.makedirs(runs, exist_ok=True)
    last = newest(runs)
    finished = last is None or os.path.exists(os.path.join(runs, last, metrics_format.RUN_FINISHED))
    run = last if resume and not finished else "%04d" % (int(last or 0) + 1)
    os.makedirs(os.path.join(runs, run), exist_ok=True)
    return run
