"""`dflash-ops report`: a picture of a job's run(s), in one round trip; remote/report_read.py thins
the metrics there so the answer stays bounded. The answer is untrusted: every field is checked."""

from __future__ import annotations

import dataclasses
import re

from trainer import metrics_history, run_summary

from dflash_ops.job import jobpaths, jobstate
from dflash_ops.errors import DflashOpsError, InputError, RemoteCommandError
from dflash_ops.job.model import Target
from dflash_ops.observe.probe import json_answer
from dflash_ops.remote import bundle, python_command

REPORT_SCRIPT = "report_read.py"
TIMEOUT_S = 120.0
CURRENT, ALL = "current", "all"
_RUN = re.compile(r"^\d{1,9}$")


class ReportError(DflashOpsError):
    """The report script ran but its answer could not be read."""


class NoMetrics(InputError):
    """The run has no step record yet: nothing to draw (exit 2)."""


@dataclasses.dataclass(frozen=True)
class FetchedRun:
    run: str  # "0003"
    launches: tuple[tuple[str, ...], ...]  # each launch's kept metrics lines, oldest launch first
    thinned: bool  # some lines were left out to bound the answer (the picture stays faithful)


@dataclasses.dataclass(frozen=True)
class Report:
    target: str
    histories: tuple[run_summary.RunHistory, ...]
    job_state: str | None  # running / stopped / finished, as the job state says
    path: str | None = None  # where the picture was written
    panels: dict = dataclasses.field(default_factory=dict)  # panel -> pixel box (see report_plot)
    size: tuple[int, int] = (0, 0)


def run_selection(run: str | None, all_runs: bool) -> str:
    """--run NNNN / --all-runs as the script's `run` argument; a run id is digits only."""
    if run is not None and all_runs:
        raise InputError("--run and --all-runs: give one of them")
    if all_runs:
        return ALL
    if run is None:
        return CURRENT
    if not _RUN.match(run):
        raise InputError(
            f"--run {run!r}: a run number is digits only, e.g. --run 0003 (see runs/ in the workdir)"
        )
    return f"{int(run):04d}"


def script_args(target: Target, selection: str, max_step_points: int) -> dict:
    job = target.job
    return {
        "log_dir": job.log_dir,
        "runs_dir": jobpaths.runs_dir(job),
        "legacy_run_dir": jobpaths.legacy_run_dir(job),
        "state_file": jobpaths.state_file(job),
        "run": selection,
        "max_step_points": int(max_step_points),
    }


def parse_answer(stdout: str, target: str) -> tuple[list[FetchedRun], dict | None]:
    data = json_answer(stdout)
    if data is None or "report_version" not in data or not isinstance(data.get("runs"), list):
        shown = stdout.strip()[:300] or "(no output)"
        raise ReportError(f"[{target}] read metrics: the answer is not the report script's JSON: {shown}")
    runs = []
    for entry in data["runs"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("run"), str) and _RUN.match(entry["run"])):
            continue
        files = entry["files"] if isinstance(entry.get("files"), list) else []
        kept = [f for f in files if isinstance(f, dict) and isinstance(f.get("lines"), list)]
        launches = tuple(tuple(line for line in f["lines"] if isinstance(line, str)) for f in kept)
        runs.append(FetchedRun(entry["run"], launches, any(bool(f.get("thinned")) for f in kept)))
    state = data.get("job_state") if isinstance(data.get("job_state"), dict) else None
    return runs, state


def build(target_name: str, runs: list[FetchedRun], state: dict | None) -> Report:
    histories = tuple(
        run_summary.history_from_lines(f"run {r.run}", [list(lines) for lines in r.launches]) for r in runs
    )
    with_steps = tuple(h for h in histories if h.steps)
    if not with_steps:
        which = ", ".join(f"run {r.run}" for r in runs) or "the job"
        raise NoMetrics(f"[{target_name}] {which}: no metrics yet (no step record); nothing to draw")
    parsed = jobstate.JobState.from_dict(state)
    return Report(target_name, with_steps, parsed.state if parsed else None)


def report(target: Target, selection: str, out_path: str) -> Report:
    """Fetch, summarise and draw the selected run(s) of `target` into `out_path` (.png or .html)."""
    from trainer import report_plot

    from dflash_ops.transport.factory import connect

    try:
        report_plot.format_of(out_path)  # before anything is fetched
    except report_plot.UnknownFormat as exc:
        raise InputError(f"-o {exc}") from None
    args = script_args(target, selection, metrics_history.MAX_STEP_POINTS)
    script = python_command(target.job.python, REPORT_SCRIPT, args, who="dflash report")
    with connect(target) as transport:  # the selected runs' thinned metrics and the job state, in ONE run
        result = transport.run(script, timeout=TIMEOUT_S, step="read metrics", stdin=bundle(REPORT_SCRIPT))
        if not result.ok:
            raise RemoteCommandError(transport.name, "read metrics", result)
        runs, state = parse_answer(result.stdout, transport.name)
    built = build(target.name, runs, state)
    title = f"DFlash {target.name}: " + ", ".join(h.name for h in built.histories)
    if built.job_state:
        title += f" ({built.job_state})"
    try:
        picture = report_plot.write(list(built.histories), out_path, title)
    except ImportError as exc:
        raise InputError(str(exc)) from None
    except OSError as exc:
        raise InputError(f"-o {out_path}: cannot write it ({exc.strerror})") from None
    return dataclasses.replace(
        built, path=out_path, panels=picture.panels, size=(picture.width, picture.height)
    )
