"""The launch: a numbered log, the trainer in a detached tmux session, environment set explicitly.

`bash -c` under pct exec is a non-login shell (no profile, no venv activation), so every path is
absolute and every variable the trainer needs is passed here.
"""
from __future__ import annotations

import shlex

from . import jobpaths, tmux, torchrun
from .model import Job


def trainer_argv(job: Job) -> list[str]:
    argv = [job.python, "-m", "trainer", "--config", job.config, "--output-dir", jobpaths.run_dir(job)]
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


def pane_script(job: Job, resume: bool) -> str:
    """What runs inside the tmux pane; $1 is the log path chosen by the launch script."""
    q = shlex.quote
    exports = "\n".join(f"export {k}={q(v)}" for k, v in trainer_env(job).items())
    checkpoints = q(jobpaths.run_dir(job) + "/checkpoints")
    resume_arg = (f'if ls -d {checkpoints}/step-* >/dev/null 2>&1; then set -- "$@" --resume; fi'
                  if resume else "")
    argv = " ".join(q(a) for a in trainer_argv(job))
    return f"""log=$1; shift
{exports}
cd {q(job.workdir)}
{resume_arg}
echo "[dflash-ops] $(date -Is) launching:" {q(argv)} "$*" >"$log"
{argv} --metrics-file "${{log%.log}}.metrics.jsonl" "$@" >>"$log" 2>&1
code=$?
echo "[dflash-ops] $(date -Is) trainer exited with code $code" >>"$log"
exit $code
"""


def launch_script(job: Job, resume: bool = True) -> str:
    """Creates dirs, picks the next train-NNNN.log, starts the session, prints the log path."""
    q = shlex.quote
    logs = job.log_dir
    return f"""set -eu
mkdir -p {q(logs)} {q(jobpaths.inductor_cache(job))} {q(jobpaths.triton_cache(job))} {q(jobpaths.run_dir(job))}
if {tmux.has_session(job)}; then echo {q("session " + job.session + " is already running; stop it first")} >&2; exit 3; fi
last=$(ls -1 {q(logs)} | sed -n 's/^{jobpaths.LOG_PREFIX}\\([0-9][0-9]*\\)\\.log$/\\1/p' | sort -n | tail -n 1)
n=$(( 10#${{last:-0}} + 1 ))
log={q(logs)}/$(printf '{jobpaths.LOG_PREFIX}%04d.log' "$n")
: >"$log"
{tmux.new_session(job, pane_script(job, resume), '_ "$log"')} >/dev/null
echo "$log"
"""
