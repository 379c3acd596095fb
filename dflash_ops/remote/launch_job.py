"""Run ON THE TARGET: start the trainer in a detached tmux session, record `running`, print the log's
path. Every value stays data (one JSON argument). Exit 3: already running; 2: `run` is no NNNN."""

import json
import os
import shutil
import subprocess
import sys

from dflash_ops.remote import facts, procs, runs, state_write
from trainer import metrics_format

# train-0007.log -> train-0007.metrics.jsonl: what the trainer's rule appends to a log's stem
METRICS_SUFFIX = metrics_format.metrics_path_for_log(facts.LOG_SUFFIX)


class LaunchError(Exception):
    """The launch stops with this exit code (and message, when there is one to add)."""

    def __init__(self, code, message=""):
        super().__init__(message)
        self.code = code


def main():
    args = json.loads(sys.argv[1])
    try:
        log = launch(args)
    except LaunchError as exc:
        if str(exc):
            print(exc, file=sys.stderr)
        sys.exit(exc.code)
    except OSError as exc:
        print("launch: %s" % exc, file=sys.stderr)
        sys.exit(1)
    sys.stdout.buffer.write(os.fsencode(log) + b"\n")


def launch(args):
    """Start the session; the log's path."""
    socket, target = args["socket"], args["target"]
    if tmux(socket, ["has-session", "-t", target], stderr=subprocess.DEVNULL).returncode == 0:
        raise LaunchError(3, session_taken(args))
    move_legacy_run(args["runs"], args["legacy_run"])
    os.makedirs(args["logs"], exist_ok=True)
    os.makedirs(args["runs"], exist_ok=True)
    prepare_cache(args["cache"], args["cache_marker"], args["marker"], args["cache_entries"])
    for path in args["compiler_caches"]:
        os.makedirs(path, exist_ok=True)

    run, resume = args.get("run"), args["resume"]
    if run is None:
        run = runs.choose(args["runs"], resume)
    elif runs.is_run_name(run):
        os.makedirs(args["runs"] + "/" + run, exist_ok=True)
        resume = True  # the pane resumes the run the caller chose, as it resumes its own choice
    else:
        raise LaunchError(2, "run %s is not a run number (NNNN)" % run)
    name = facts.LOG_PREFIX + next_log_number(args["logs"]) + facts.LOG_SUFFIX
    log = args["logs"] + "/" + name
    open(log, "w").close()

    out = args["runs"] + "/" + run
    in_state = {"run": int(run), "run_dir": out, "log": args["logs"].rstrip("/") + "/" + name}
    in_state[facts.STATE_JOB_KEY] = args["marker"]
    finished = dict({"state": "finished"}, **in_state)
    # One tmux invocation, so remain-on-exit is set before the server can reap a pane that fails at
    # once; it keeps a crashed pane (and its exit status) visible to status and health. The tmux
    # server daemonizes, so the session outlives this ssh / pct exec call.
    started = tmux(
        socket,
        ["new-session", "-d", "-s", args["session"], "-x", "200", "-y", "50"]
        + pane_command(args, log, run, resume, out, finished),
        ["set-option", "-w", "-t", target + ":", "remain-on-exit", "on"],
        stdout=subprocess.DEVNULL,
    )
    if started.returncode != 0:
        raise LaunchError(started.returncode)
    running = dict({"state": "running"}, **in_state, pid=pane_pid(socket, target))
    state_write.write(args["state_file"], state_write.stamped(running, "since"))
    return log


def session_taken(args):
    """Why the session cannot start: it runs, this job's or another job's (stopping us would never end it)."""
    listed = tmux_answer(args["socket"], procs.pane_command(args["socket"], args["session"])[3:])
    marker = ("%s=%s" % (args["marker_env"], args["marker"])).encode()
    others = [p["pid"] for p in procs.parse_panes(listed) if procs.has_other_marker(p["pid"], marker)]
    if others:
        return (
            f"session {args['session']} (tmux -L {args['socket']}) runs another job (pane pid {others[0]}); "
            "give this job another job.session"
        )
    return "session %s is already running; stop it first" % args["session"]


def tmux(socket, *commands, **options):
    """The tmux commands (each a list of words) as one invocation on the job's tmux server."""
    words = []
    for command in commands:
        words += [";"] if words else []
        words += [procs.tmux_word(word) for word in command]
    return subprocess.run(["tmux", "-L", socket] + words, stdin=subprocess.DEVNULL, **options)


def tmux_answer(socket, command):
    listed = tmux(socket, command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True)
    return listed.stdout


def pane_pid(socket, target):
    listed = tmux_answer(socket, ["list-panes", "-s", "-t", target + ":", "-F", "#{pane_pid}"])
    first = (listed.splitlines() or [""])[0].strip()
    return int(first) if first.isdigit() and first.isascii() else 0


def pane_command(args, log, run, resume, out, finished):
    """argv of the pane: pane.sh under the job's marker, with the trainer's environment and argv."""
    argv = [word.replace(args["run_dir_word"], out) for word in args["argv"]]
    env = ["%s=%s" % item for item in args["env"].items()]
    return [
        "env",
        "%s=%s" % (args["marker_env"], args["marker"]),
        "bash",
        "-c",
        args["pane_script"],
        "pane.sh",
        log,
        run,
        "resume" if resume else "fresh",
        metrics_format.metrics_path_for_log(log),
        out,
        out + "/" + metrics_format.RUN_FINISHED,
        args["state_file"],
        json.dumps(finished),
        # the pane writes the finished state with the interpreter running this launch
        sys.executable or args["python"],
        args["state_writer"],
        args["workdir"],
        *env,
        "--",
        *argv,
    ]


def move_legacy_run(runs_dir, legacy):
    """The single run dir of earlier versions becomes run 0001, once: while there is no runs dir."""
    if not os.path.exists(runs_dir) and os.path.isdir(os.path.join(legacy, "checkpoints")):
        shutil.move(legacy, runs_dir + ".tmp")
        os.makedirs(runs_dir, exist_ok=True)
        shutil.move(runs_dir + ".tmp", runs_dir + "/0001")


def prepare_cache(cache, marker, marker_value, entries):
    """The cache dir with its marker; an existing dir is adopted only when it holds nothing but `entries`,
    so purge-cache never deletes anything else."""
    if os.path.exists(cache) and not holds_only(cache, entries):
        return
    os.makedirs(cache, exist_ok=True)
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(marker_value + "\n")


def holds_only(path, names):
    try:
        return set(os.listdir(path)) <= set(names)
    except NotADirectoryError:
        return False


def next_log_number(logs):
    """NNNN after every numbered log AND every metrics file: a deleted log's metrics keep its number."""
    last = 0
    for name in os.listdir(logs):
        if name.startswith(facts.LOG_PREFIX):
            number = _without(_without(name[len(facts.LOG_PREFIX) :], facts.LOG_SUFFIX), METRICS_SUFFIX)
            if number.isdigit() and number.isascii():
                last = max(last, int(number))
    return "%04d" % (last + 1)


def _without(text, suffix):
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


if __name__ == "__main__":
    main()
