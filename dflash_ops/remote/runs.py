"""A job's runs: one directory per run in its runs dir, named by its number (NNNN, at least four
digits), and the rule for which run a launch continues. Standard library only, Python >= 3.8:
remote.bundle() sends this file's text ahead of each remote script (the launcher, and the run a
multinode job chooses once for all its nodes)."""

import os
import re

try:  # imported from the package (tests)
    from trainer import metrics_format
except ImportError:  # on the target: remote.bundle() defined it ahead of this script
    import metrics_format  # type: ignore[no-redef]

RUN_NAME = re.compile(r"[0-9]{4,}")


def is_run_name(text):
    return isinstance(text, str) and RUN_NAME.fullmatch(text) is not None


def newest(runs):
    """The name of the highest-numbered run in `runs`, or None."""
    last = None
    for name in sorted(os.listdir(runs)):
        if is_run_name(name) and os.path.exists(os.path.join(runs, name)):
            if last is None or int(name) > int(last):
                last = name
    return last


def choose(runs, resume):
    """The run a launch uses, its directory created: with `resume` the newest run unless the trainer
    left it finished (metrics_format.RUN_FINISHED), else a new one numbered after the newest."""
    os.makedirs(runs, exist_ok=True)
    last = newest(runs)
    if (
        resume
        and last is not None
        and not os.path.exists(os.path.join(runs, last, metrics_format.RUN_FINISHED))
    ):
        run = last
    else:
        run = "%04d" % (int(last or 0) + 1)
    os.makedirs(os.path.join(runs, run), exist_ok=True)
    return run
