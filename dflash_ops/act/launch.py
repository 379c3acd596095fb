"""The launch: a numbered log and the trainer in a detached tmux session, every path absolute and
every variable passed, because `bash -c` under pct exec is a non-login shell."""

from __future__ import annotations

import posixpath

from dflash_ops.job import jobpaths, tmux, torchrun
from dflash_ops.remote import python_command, script_source, shell_code
from dflash_ops.job.model import Job

# Stands for the run's directory (runs/NNNN), which only the launcher picks: it puts the run's
# directory in its place.
RUN_DIR = "@RUN_DIR@"


def trainer_argv(job: Job, output_dir: str = RUN_DIR) -> list[str]:
    argv = [job.python, "-m", "trainer", "--config", job.config, "--output-dir", output_dir]
    if job.target_gpus:
        argv += ["--target-devices", ",".join(f"cuda:{i}" for i in job.target_gpus)]
    if job.drafter_gpus:
        argv += ["--drafter-devices", ",".join(f"cuda:{i}" for i in job.drafter_gpus)]
    argv += list(job.train_args)
    return torchrun.launch_line(job, argv) if job.launcher == torchrun.TORCHRUN else argv


def trainer_env(job: Job) -> dict[str, str]:
    return {
        jobpaths.JOB_MARKER_ENV: jobpaths.marker_value(job),
        # Exactly the dirs purge-cache removes; never the shared /tmp/torchinductor_<user> default.
        "TORCHINDUCTOR_CACHE_DIR": jobpaths.inductor_cache(job),
        "TRITON_CACHE_DIR": jobpaths.triton_cache(job),
        "PYTHONPATH": jobpaths.current_release(job),
        "PYTHONUNBUFFERED": "1",
        **torchrun.env(job),
        **dict(job.env),
    }


LAUNCHER = "launch_job.py"


def launch_args(job: Job, resume: bool = True, run: str | None = None) -> dict:
    """remote/launch_job.py's one JSON argument (`run`: the run a multinode job chose for all its nodes)."""
    return {
        "socket": job.tmux_socket,
        "session": job.session,
        "target": tmux.exact(job),
        "logs": job.log_dir,
        "runs": jobpaths.runs_dir(job),
        "legacy_run": jobpaths.legacy_run_dir(job),
        "cache": job.cache_dir,
        "cache_marker": jobpaths.cache_marker(job),
        "cache_entries": [
            posixpath.basename(jobpaths.inductor_cache(job)),
            posixpath.basename(jobpaths.triton_cache(job)),
            jobpaths.CACHE_MARKER,
        ],
        "compiler_caches": [jobpaths.inductor_cache(job), jobpaths.triton_cache(job)],
        "marker_env": jobpaths.JOB_MARKER_ENV,
        "marker": jobpaths.marker_value(job),
        "resume": resume,
        "run": run,
        "state_file": jobpaths.state_file(job),
        "python": job.python,
        "pane_script": shell_code("pane.sh"),
        # the program the pane's python runs to write the finished state
        "state_writer": script_source("state_write.py"),
        # what the pane runs: the trainer's workdir, environment and argv (its run dir as RUN_DIR)
        "workdir": job.workdir,
        "env": trainer_env(job),
        "argv": trainer_argv(job),
        "run_dir_word": RUN_DIR,
    }


def launch_command(job: Job, resume: bool = True, run: str | None = None) -> str:
    """The launch as one command line (the launcher's program, bundle(LAUNCHER), goes on stdin)."""
    return python_command(job.python, LAUNCHER, launch_args(job, resume, run), who="launch")
