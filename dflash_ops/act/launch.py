"""The launch: a numbered log, the trainer in a detached tmux session, environment set explicitly
(remote/launch.sh and remote/pane.sh).

`bash -c` under pct exec is a non-login shell (no profile, no venv activation), so every path is
absolute and every variable the trainer needs is passed here.
"""

from __future__ import annotations

from trainer import metrics_format

from dflash_ops.act import jobpaths, jobstate, tmux, torchrun
from dflash_ops.remote import facts, shell_code, shell_command
from dflash_ops.inventory.model import Job


# Stands for the run's directory (runs/NNNN), which only the launch script picks: the pane script
# puts it in its place.
RUN_DIR = "@RUN_DIR@"


def trainer_argv(job: Job, output_dir: str = RUN_DIR) -> list[str]:
    argv = [job.python, "-m", "trainer", "--config", job.config, "--output-dir", output_dir]
    if job.target_gpus:
        argv += ["--target-devices", ",".join(f"cuda:{i}" for i in job.target_gpus)]
    if job.drafter_gpus:
        argv += ["--drafter-devices", ",".join(f"cuda:{i}" for i in job.drafter_gpus)]
    argv += list(job.train_args)
    return torchrun.launch_line(job, argv) if torchrun.uses_torchrun(job) else argv


def trainer_env(job: Job) -> dict[str, str]:
    env = {
        jobpaths.JOB_MARKER_ENV: jobpaths.marker_value(job),
        # Exactly the dirs purge-cache removes; never the shared /tmp/torchinductor_<user> default.
        "TORCHINDUCTOR_CACHE_DIR": jobpaths.inductor_cache(job),
        "TRITON_CACHE_DIR": jobpaths.triton_cache(job),
        "PYTHONPATH": jobpaths.current_release(job),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(torchrun.env(job))
    env.update(dict(job.env))
    return env


# train-0007.log -> train-0007.metrics.jsonl: what the trainer's rule appends to a log's stem
_METRICS_OF_LOG = metrics_format.metrics_path_for_log(facts.LOG_SUFFIX)
# What the launcher itself puts into the cache dir, as grep -E sees it.
_LAUNCHER_ENTRIES = "inductor|triton|" + jobpaths.CACHE_MARKER.replace(".", "\\.")


def _state(job: Job, state: str, **more) -> str:
    """The job state a launched run writes; remote/launch.sh and pane.sh fill in its slots."""
    return jobstate.json_template(
        state=state,
        run=jobstate.Slot("run_number"),
        run_dir=(jobpaths.runs_dir(job) + "/", jobstate.Slot("run"), ""),
        log=(job.log_dir.rstrip("/") + "/" + facts.LOG_PREFIX, jobstate.Slot("log_number"), facts.LOG_SUFFIX),
        **more,
    )


def pane_args(job: Job) -> list[str]:
    """remote/pane.sh's arguments from WORKDIR on: the trainer's environment and argv."""
    env = [f"{name}={value}" for name, value in trainer_env(job).items()]
    return [job.workdir, RUN_DIR, *env, "--", *trainer_argv(job)]


def launch_script(job: Job, resume: bool = True, run: str | None = None) -> str:
    """remote/launch.sh: picks the run (the newest unfinished one to resume, else a new one; `run`
    NNNN when the caller chose it, as a multinode job does once for all its nodes), the
    next train-NNNN.log, creates the cache dir with its marker (an existing dir only when it holds
    nothing but what the launcher puts there, so purge-cache never deletes anything else), starts
    the session running remote/pane.sh, records the job state `running`; prints the log path."""
    running = _state(job, jobstate.RUNNING, pid=jobstate.Slot("pid"), since=jobstate.Slot("now"))
    finished = _state(job, jobstate.FINISHED, when=jobstate.Slot("now"))
    return shell_command(
        "launch.sh",
        job.tmux_socket,
        job.session,
        tmux.exact(job),
        job.log_dir,
        facts.LOG_PREFIX,
        facts.LOG_SUFFIX,
        _METRICS_OF_LOG,
        jobpaths.runs_dir(job),
        jobpaths.legacy_run_dir(job),
        job.cache_dir,
        jobpaths.cache_marker(job),
        jobpaths.marker_value(job),
        _LAUNCHER_ENTRIES,
        jobpaths.inductor_cache(job),
        jobpaths.triton_cache(job),
        f"run={run}" if run else "resume" if resume else "fresh",
        jobpaths.RUN_FINISHED,
        jobpaths.state_file(job),
        running,
        finished,
        shell_code("pane.sh"),
        f"{jobpaths.JOB_MARKER_ENV}={jobpaths.marker_value(job)}",
        *pane_args(job),
    )
