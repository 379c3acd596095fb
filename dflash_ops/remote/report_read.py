"""Read a job's run metrics for `dflash-ops report`, thinned on the target; print ONE JSON object.

A launch's metrics file belongs to the run its `start` record names, or (no `start` yet) to the run
the job state names with its log. "current" is the state's run, else the newest; the answer holds
at most MAX_OUTPUT_BYTES of lines."""

from __future__ import annotations

import json
import os
import re
import sys
import time

from dflash_ops.remote import facts, procs
from trainer import metrics_format, metrics_history

REPORT_VERSION = 1
MAX_FILES = 256  # the newest launches, when a job has had more
MAX_OUTPUT_BYTES = 8 * 1024 * 1024
METRICS_SUFFIX = metrics_format.metrics_path_for_log(facts.LOG_SUFFIX)
METRICS_NAME = re.compile(r"^" + re.escape(facts.LOG_PREFIX) + r"(\d{4,})" + re.escape(METRICS_SUFFIX) + r"$")
RUN_NUMBER = re.compile(r"^\d{1,9}$")


def run_of(path, runs_dir, legacy_run_dir):
    """The run number (str) the file's start record names as its output dir, or None."""
    with open(path, "rb") as f:
        record = metrics_format.parse_line(
            f.readline(metrics_history.MAX_FIRST_LINE_BYTES).decode("utf-8", "replace")
        )
    if record is None or record.get("event") != "start" or not isinstance(record.get("config"), dict):
        return None
    run = record["config"].get("run")
    output_dir = run.get("output_dir") if isinstance(run, dict) else None
    if not isinstance(output_dir, str):
        return None
    output_dir = os.path.normpath(output_dir)
    if legacy_run_dir and output_dir == os.path.normpath(legacy_run_dir):
        return "0001"  # the launch moved the run dir of earlier versions to runs/0001
    parent, name = os.path.split(output_dir)
    return name if parent == os.path.normpath(runs_dir) and RUN_NUMBER.match(name) else None


def launches(log_dir, runs_dir, legacy_run_dir, state, errors):
    try:
        names = os.listdir(log_dir)
    except OSError as e:
        errors.append("log dir %s: %s" % (log_dir, e.strerror))
        return []
    numbered = sorted((int(m.group(1)), name) for name in names for m in [METRICS_NAME.match(name)] if m)
    state_log = state.get("log") if state else None
    state_metrics = metrics_format.metrics_path_for_log(state_log) if isinstance(state_log, str) else None
    state_run = state.get("run") if state else None
    found = []
    for _number, name in numbered[-MAX_FILES:]:
        path = os.path.join(log_dir, name)
        try:
            run = run_of(path, runs_dir, legacy_run_dir)
        except OSError:
            continue  # rotated away meanwhile
        if run is None and path == state_metrics and type(state_run) is int:  # (a bool is no run)
            run = "%04d" % state_run  # its trainer is still starting
        found.append((run, path))
    return found


def selected(found, wanted, state):
    if wanted == "all":
        return sorted({run for run, _ in found if run is not None}, key=int)
    if wanted == "current":
        run = (state or {}).get("run")
        if isinstance(run, int) and not isinstance(run, bool):
            return ["%04d" % run]
        known = [r for r, _ in found if r is not None]
        return [max(known, key=int)] if known else []
    return [wanted]


def shrink(runs):
    """Halve the largest file's lines (its first and last kept) until the answer fits."""
    files = [f for run in runs for f in run["files"]]

    def size():
        return sum(len(line) for f in files for line in f["lines"])

    while files and size() > MAX_OUTPUT_BYTES:
        largest = max(files, key=lambda f: sum(len(line) for line in f["lines"]))
        lines = largest["lines"]
        largest["lines"] = [lines[0]] + lines[1:-1][::2] + [lines[-1]] if len(lines) > 2 else []
        largest["thinned"] = True


def main(argv):
    try:
        args = json.loads(argv[1])
        log_dir, runs_dir = str(args["log_dir"]), str(args["runs_dir"])
        wanted = str(args.get("run", "current"))
        if wanted not in ("current", "all") and not RUN_NUMBER.match(wanted):
            raise ValueError("run must be current, all or a run number")
    except (IndexError, ValueError, KeyError, TypeError) as e:
        sys.stderr.write("dflash report: needs one JSON argument with log_dir, runs_dir, run (%s)\n" % e)
        return 2
    errors = []
    state = procs.job_state_or_none(str(args.get("state_file") or ""))
    found = launches(log_dir, runs_dir, str(args.get("legacy_run_dir") or ""), state, errors)
    names = selected(found, wanted, state)
    numbers = {int(name) for name in names}
    paths = [(int(run), path) for run, path in found if run is not None and int(run) in numbers]
    points = max(
        100, int(args.get("max_step_points") or metrics_history.MAX_STEP_POINTS) // max(1, len(paths))
    )
    runs = []
    for name in names:
        files = []
        for path in (path for run, path in paths if run == int(name)):
            try:
                files.append(metrics_history.read_thinned(path, max_steps=points))
            except OSError as e:
                errors.append("%s: %s" % (path, e.strerror))
        runs.append({"run": "%04d" % int(name), "files": files})
    shrink(runs)
    report = {
        "report_version": REPORT_VERSION,
        "time": time.time(),
        "job_state": state,
        "runs": runs,
        "errors": errors,
    }
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
