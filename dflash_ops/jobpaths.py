"""Where a job's pieces live on its target, derived from the inventory's Job (one place only)."""
from __future__ import annotations

import posixpath

from .model import Job

# Marks every process the launcher starts (inherited by children), so leftovers of an earlier
# launch can be told apart from anything else on the GPUs: see processes.py.
JOB_MARKER_ENV = "DFLASH_OPS_JOB"
LOG_PREFIX = "train-"


def inductor_cache(job: Job) -> str:
    return posixpath.join(job.cache_dir, "inductor")


def triton_cache(job: Job) -> str:
    return posixpath.join(job.cache_dir, "triton")


def releases_dir(job: Job) -> str:
    return posixpath.join(job.workdir, "releases")


def current_release(job: Job) -> str:
    return posixpath.join(job.workdir, "current")


def run_dir(job: Job) -> str:
    """The trainer's --output-dir: checkpoints and exports survive relaunches here."""
    return posixpath.join(job.workdir, "run")


def marker_value(job: Job) -> str:
    """Identifies this job's processes: the tmux socket and session together are unique per box."""
    return f"{job.tmux_socket}/{job.session}"
