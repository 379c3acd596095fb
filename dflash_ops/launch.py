"""The launch: a numbered log, the trainer in a detached tmux session, environment set explicitly.

`bash -c` under pct exec is a non-login shell (no profile, no venv activation), so every path is
absolute and every variable the trainer needs is passed here.
"""

from __future__ import annotations

import shlex

from trainer import metrics_format

from . import jobpaths, jobstate, tmux, torchrun
from .remote import facts
from .model import Job


# Stands for the run's directory (runs/NNNN), which only the launch script picks: the pane script
# puts "$out" in its place.
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
# the number of a train-NNNN.log name (sed -n script)
_LOG_NUMBER_SED = f"s/^{facts.LOG_PREFIX}\\([0-9][0-9]*\\){facts.LOG_SUFFIX.replace('.', '[.]')}$/\\1/p"


def _log_json(job: Job) -> tuple:
    return (job.log_dir.rstrip("/") + "/" + facts.LOG_PREFIX, jobstate.Digits("$n"), facts.LOG_SUFFIX)


def _run_dir_json(job: Job) -> tuple:
    return (jobpaths.runs_dir(job) + "/", jobstate.Digits("$run"), "")


def pane_script(job: Job) -> str:
    """What runs inside the tmux pane: $1 the log, $2 its number, $3 the run (NNNN), $4 "resume".
    When the trainer has marked the run complete, the job state becomes `finished`."""
    q = shlex.quote
    exports = "\n".join(f"export {k}={q(v)}" for k, v in trainer_env(job).items())
    runs = q(jobpaths.runs_dir(job))
    argv = " ".join(q(a) for a in trainer_argv(job)).replace(q(RUN_DIR), '"$out"')
    finished = jobstate.shell_json(
        state=jobstate.FINISHED,
        run=jobstate.Digits("$((10#$run))"),
        run_dir=_run_dir_json(job),
        log=_log_json(job),
        when=jobstate.Digits("$(date +%s)"),
    )
    return f"""log=$1; n=$2; run=$3; mode=$4; shift 4
{exports}
cd {q(job.workdir)}
out={runs}/$run
if [ "$mode" = resume ] && ls -d "$out"/checkpoints/step-* >/dev/null 2>&1; then set -- "$@" --resume; fi
echo "[dflash-ops] $(date -Is) launching run $run:" {argv} "$*" >"$log"
metrics="${{log%{facts.LOG_SUFFIX}}}"{q(_METRICS_OF_LOG)}
{argv} --metrics-file "$metrics" "$@" >>"$log" 2>&1
code=$?
echo "[dflash-ops] $(date -Is) trainer exited with code $code" >>"$log"
if [ -e "$out"/{jobpaths.RUN_FINISHED} ]; then
  {jobstate.write_script(job, finished)}
fi
exit $code
"""


def launch_script(job: Job, resume: bool = True) -> str:
    """Picks the run (the newest unfinished one to resume, else a new one), the next
    train-NNNN.log, creates the cache dir with its marker, starts the session, records the job
    state `running`; prints the log path."""
    q = shlex.quote
    logs, runs = job.log_dir, jobpaths.runs_dir(job)
    legacy = jobpaths.legacy_run_dir(job)
    running = jobstate.shell_json(
        state=jobstate.RUNNING,
        run=jobstate.Digits("$((10#$run))"),
        run_dir=_run_dir_json(job),
        log=_log_json(job),
        pid=jobstate.Digits("$pid"),
        since=jobstate.Digits("$(date +%s)"),
    )
    numbered = "grep -E '^[0-9]{4,}$' | sort -n | tail -n 1"
    return f"""set -eu
if {tmux.has_session(job)}; then echo {q("session " + job.session + " is already running; stop it first")} >&2; exit 3; fi
if [ ! -e {q(runs)} ] && [ -d {q(legacy)}/checkpoints ]; then mv {q(legacy)} {q(runs)}.tmp && mkdir -p {q(runs)} && mv {q(runs)}.tmp {q(runs)}/0001; fi
mkdir -p {q(logs)} {q(runs)}
{cache_dir_script(job)}
mkdir -p {q(jobpaths.inductor_cache(job))} {q(jobpaths.triton_cache(job))}
last=$(ls -1 {q(runs)} | {numbered} || true)
if [ {"1" if resume else "0"} = 1 ] && [ -n "$last" ] && [ ! -e {q(runs)}/"$last"/{jobpaths.RUN_FINISHED} ]; then
  run=$last
else
  run=$(printf '%04d' $(( 10#${{last:-0}} + 1 )))
fi
mkdir -p {q(runs)}/"$run"
last=$(ls -1 {q(logs)} | sed -n {q(_LOG_NUMBER_SED)} | sort -n | tail -n 1)
n=$(printf '%04d' $(( 10#${{last:-0}} + 1 )))
log={q(logs)}/{q(facts.LOG_PREFIX)}$n{q(facts.LOG_SUFFIX)}
: >"$log"
{tmux.new_session(job, pane_script(job), '_ "$log" "$n" "$run" ' + ("resume" if resume else "fresh"))} >/dev/null
pid=$({tmux.pane_pids(job)} | head -n 1 | cut -d' ' -f1)
pid=${{pid:-0}}
{jobstate.write_script(job, running)}
echo "$log"
"""


# What the launcher itself puts into the cache dir, as grep -E sees it.
_LAUNCHER_ENTRIES = "inductor|triton|" + jobpaths.CACHE_MARKER.replace(".", "\\.")


def cache_dir_script(job: Job) -> str:
    """Create the cache dir with its marker. An existing dir is adopted only when it holds nothing
    but what the launcher puts there (inductor/, triton/): a dir of anything else is never marked,
    so purge-cache will never delete it."""
    q = shlex.quote
    cache, marker = q(job.cache_dir), q(jobpaths.cache_marker(job))
    return f"""if [ ! -e {cache} ] || [ -z "$(ls -A {cache} | grep -vxE {q(_LAUNCHER_ENTRIES)} || true)" ]; then
  mkdir -p {cache}
  [ -e {marker} ] || printf '%s\\n' {q(jobpaths.marker_value(job))} > {marker}
fi"""
