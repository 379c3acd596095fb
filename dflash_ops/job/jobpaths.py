"""Where a job's pieces live on its target, derived from the inventory's Job (one place only)."""

from __future__ import annotations

import posixpath

from trainer import metrics_format

from dflash_ops.job.model import Job

# Marks every process the launcher starts (inherited by children), so leftovers of an earlier
# launch can be told apart from anything else on the GPUs: see remote/jobprocs.py.
JOB_MARKER_ENV = "DFLASH_OPS_JOB"


def inductor_cache(job: Job) -> str:
    return posixpath.join(job.cache_dir, "inductor")


def triton_cache(job: Job) -> str:
    return posixpath.join(job.cache_dir, "triton")


def releases_dir(job: Job) -> str:
    return posixpath.join(job.workdir, "releases")


def current_release(job: Job) -> str:
    return posixpath.join(job.workdir, "current")


def runs_dir(job: Job) -> str:
    """One directory per run (`runs/NNNN/`): its checkpoints survive relaunches, no other run touches them."""
    return getattr(job, "runs_dir", "") or posixpath.join(job.workdir, "runs")


def legacy_run_dir(job: Job) -> str:
    """The single --output-dir of earlier versions; the launch moves it to runs/0001 once."""
    return posixpath.join(job.workdir, "run")


def owned_by_the_job(workdir: str) -> list[tuple[str, str]]:
    """(path, what) of the job's own directories under its workdir, which no cache may touch."""
    job = Job(workdir=workdir, python="", config="")
    return [
        (runs_dir(job), "runs (checkpoints)"),
        (legacy_run_dir(job), "run dir of earlier versions (checkpoints)"),
        (releases_dir(job), "releases"),
        (current_release(job), "current release"),
    ]


def lock_file(job: Job) -> str:
    """Held (flock) on the target by the one dflash-ops command acting on the job (joblock.py)."""
    return posixpath.join(job.workdir, ".dflash-ops.lock")


def state_file(job: Job) -> str:
    """The job state (running / stopped / finished) that dflash-ops writes next to the job."""
    return posixpath.join(job.workdir, "job-state.json")


# The launcher creates the cache dir with this file in it; purge-cache deletes only a dir holding it.
CACHE_MARKER = ".dflash-ops-cache"
# A run the trainer completed holds this file (the trainer writes it): relaunch starts a new run.
RUN_FINISHED = metrics_format.RUN_FINISHED


def cache_marker(job: Job) -> str:
    return posixpath.join(job.cache_dir, CACHE_MARKER)


def marker_value(job: Job) -> str:
    """Identifies this job's processes: unique per box, since it holds the job id derived from the workdir."""
    return f"{job.tmux_socket}/{job.session}/{job.job_id}"


def legacy_marker_value(job: Job) -> str:
    """The marker an earlier version put on the job's processes, so a job it launched is still seen."""
    return f"{job.tmux_socket}/{job.legacy_session}"


def identity_args(job: Job) -> dict:
    return {
        "socket": job.tmux_socket,
        "session": job.session,
        "marker": f"{JOB_MARKER_ENV}={marker_value(job)}",
        "legacy_session": job.legacy_session,
        "legacy_marker": f"{JOB_MARKER_ENV}={legacy_marker_value(job)}",
        "state_file": state_file(job),
    }
