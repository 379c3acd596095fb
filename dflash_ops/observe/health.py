"""Health verdicts and the Nagios line: CRITICAL means not training, WARNING training badly, UNKNOWN
only when the check itself could not run (the caller decides)."""

from __future__ import annotations

import dataclasses
import math
import posixpath
import re

from dflash_ops.observe import acceptance, gpu_faults, logs, unattended
from dflash_ops.observe.text_style import inert
from dflash_ops.job.model import Job
from dflash_ops.remote import facts

# The Nagios levels in the order of their plugin exit codes: OK exits 0, ..., UNKNOWN 3.
LEVELS = ("OK", "WARNING", "CRITICAL", "UNKNOWN")
EXIT_CODES = {level: code for code, level in enumerate(LEVELS)}
# For several targets the worst wins; a job known to be down outranks one we could not check.
SEVERITY = {"OK": 0, "WARNING": 1, "UNKNOWN": 2, "CRITICAL": 3}


@dataclasses.dataclass(frozen=True)
class Perf:
    """One Nagios performance value; thresholds use Nagios range syntax ("5000:" = alert below 5000)."""

    value: float | None  # None is printed as U (undetermined)
    warn: str = ""
    crit: str = ""
    uom: str = ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    level: str
    reasons: tuple[str, ...]
    perfdata: dict = dataclasses.field(default_factory=dict)  # label -> Perf

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.level]

    @property
    def summary(self) -> str:
        return "; ".join(self.reasons)


def unknown(reason: str) -> Verdict:
    """The verdict for a check that could not run (unreachable host, bad inventory, bad probe)."""
    return Verdict("UNKNOWN", (reason,))


def worst(levels) -> str:
    return max(levels, key=SEVERITY.__getitem__, default="UNKNOWN")


def _seconds(value: float) -> str:
    return f"{int(round(value))} s"


PART_NAMES = {"gpu": "GPUs", "session": "tmux session"}


def evaluate(report, job: Job, now: float | None = None) -> Verdict:
    """Verdict for a ProbeReport at the target's clock; a part that ran out of time is UNKNOWN unless what
    was seen is worse, and a silent tmux counts as possibly running."""
    verdict = _judged(report, job, report.time if now is None else now)
    unknown = [
        f"{PART_NAMES.get(part, part)} UNKNOWN: "
        f"{(report.gpu.error if part == 'gpu' else report.session.error) or 'no answer in time'}"
        for part in report.out_of_time
    ]
    if not unknown:
        return verdict
    level = verdict.level if SEVERITY[verdict.level] > SEVERITY["UNKNOWN"] else "UNKNOWN"
    return dataclasses.replace(verdict, level=level, reasons=tuple(unknown) + verdict.reasons)


def _judged(report, job: Job, now: float) -> Verdict:
    progress = logs.progress(list(report.records))
    finished = progress.done_reason == "max_steps"
    age = progress_age(report, progress, now)
    accept = acceptance.latest(list(report.records))
    unusable = unattended.unusable_state(report, job)
    if unusable and report.session.running is False:  # maybe an operator's stop: never CRITICAL
        return Verdict("UNKNOWN", (unusable,), _perfdata(progress, age, {}, job, accept))
    parked = unattended.parked(report, progress)
    if parked:  # an operator's stop or a finished run: like scheduled downtime, nothing to alert on
        return Verdict("OK", (parked,), _perfdata(progress, age, {}, job, accept))
    never = unattended.never_launched(report)
    critical = (
        [unattended.NEVER_LAUNCHED] if never else _session_problems(report.session, finished)
    ) + _failures(report)
    if not progress.loss_is_finite:
        critical.append(f"loss is {progress.loss} at step {progress.step}")
    stall, warning = _stall(report, progress, age, job.health.stall_seconds, finished)
    critical += stall
    faulty, suspect = gpu_faults.problems(report.gpu_faults, job.gpus)
    critical += faulty
    warning += suspect
    training = (
        report.session.running is not False and progress.step is not None and not stall and not finished
    )
    drafter_util: dict = {}
    if report.gpu.ok:
        gpus = [report.gpu.by_index(i) for i in job.drafter_gpus]
        drafter_util = {g.index: g.utilization_pct for g in gpus if g is not None}
    if training:
        speed, floor = progress.tokens_per_s, job.health.min_tokens_per_s
        if floor > 0 and speed is not None and speed < floor:
            warning.append(
                f"{speed:.0f} tokens/s is below the {floor:.0f} minimum: "
                "the eager-fallback signature (compiled attention not in use)"
            )
        warning += _idle_drafters(report.gpu, job, drafter_util)
    warning += acceptance.problems(accept, job.health.min_tau)
    # a part of the probe that failed (an unreadable log, say) leaves a blind spot: say so
    warning += [f"probe could not read part of the target: {error}" for error in report.errors]
    warning += unattended.warnings(report, job)
    warning += [unusable] if unusable else []
    level = "CRITICAL" if critical else "WARNING" if warning else "OK"
    reasons = critical + warning or [_ok_summary(progress, age, finished)]
    return Verdict(level, tuple(reasons), _perfdata(progress, age, drafter_util, job, accept))


def progress_age(report, progress: logs.TrainingProgress, now: float) -> float | None:
    """Seconds since the last sign of progress, never negative (the clock is read before the files)."""
    if progress.last_step_time is not None:
        since = progress.last_step_time
    elif progress.start_time is not None:
        since = progress.start_time  # startup grace: the first step may wait for a compile
    elif report.log is not None:
        since = report.log.mtime  # no metrics at all: time since the log last changed
    else:
        return None
    return max(0.0, round(now - since, 2))


def _session_problems(session, finished: bool) -> list[str]:
    if session.running is None:  # tmux gave no answer in time: reported as UNKNOWN by evaluate
        return []
    if session.error:
        return [f"cannot see tmux session '{session.name}': {session.error}"]
    if session.running or finished:
        return []
    if session.exists:
        status = "" if session.exit_status is None else f" with status {session.exit_status}"
        return [f"trainer in tmux session '{session.name}' exited{status}"]
    return [f"tmux session '{session.name}' is gone (socket {session.socket})"]


def _failures(report) -> list[str]:
    """Known failure signatures in the log tail and error events in the metrics, one per kind."""
    log_name = posixpath.basename(report.log.path) if report.log else "log"
    text = report.log.text if report.log else ""
    first: dict[str, logs.Failure] = {}
    for failure in logs.find_failures(text) + logs.failures_from_records(list(report.records)):
        first.setdefault(failure.name, failure)
    return [f"{failure.describe()} (in {log_name})" for failure in first.values()]


def _stall(
    report, progress: logs.TrainingProgress, age: float | None, stall_seconds: float, finished: bool
) -> tuple[list[str], list[str]]:
    """(critical, warning) about progress over time; only a live, unfinished job can stall."""
    if report.session.running is False or finished:
        return [], []
    if age is None:  # a log named by the job state but missing is reported by unattended.warnings
        return [], [] if getattr(report, "log_missing", None) else [
            f"no {facts.LOG_PREFIX}NNNN{facts.LOG_SUFFIX} in {report.log_dir}"
        ]
    if age <= stall_seconds:
        return [], []
    what = (
        f"no new step for {_seconds(age)} (last step {progress.step})"
        if progress.step is not None
        else f"no first step {_seconds(age)} after start"
    )
    return [f"{what}; stall threshold {_seconds(stall_seconds)}"], []


def _idle_drafters(snapshot, job: Job, drafter_util: dict) -> list[str]:
    floor = job.health.min_drafter_util_pct
    if floor <= 0 or not job.drafter_gpus or not snapshot.ok:  # a failed query: unattended.warnings says so
        return []
    reasons = []
    missing = [i for i in job.drafter_gpus if snapshot.by_index(i) is None]
    if missing:
        reasons.append("drafter GPUs " + ",".join(map(str, missing)) + " not present on the target")
    low = [(i, u) for i, u in drafter_util.items() if u is not None and u < floor]
    if low:
        listed = ", ".join(f"GPU {i} at {u}%" for i, u in low)
        reasons.append(f"drafter {listed}: under the {floor:g}% utilization floor")
    return reasons


def _perfdata(
    progress: logs.TrainingProgress, age: float | None, drafter_util: dict, job: Job, accept
) -> dict:
    """The Nagios perfdata, `tau` when the run evaluates it whatever the job's state (status shows it too)."""
    thresholds = job.health
    perfdata = {
        "step": Perf(progress.step),
        "loss": Perf(progress.loss if progress.loss_is_finite else None),
        "tokens_per_s": Perf(progress.tokens_per_s, warn=_below(thresholds.min_tokens_per_s)),
        "age_s": Perf(age, crit=_perfdata_number(thresholds.stall_seconds)),
    }
    if job.drafter_gpus:
        known = [u for u in drafter_util.values() if u is not None]
        perfdata["drafter_util_pct"] = Perf(
            min(known) if known else None, warn=_below(thresholds.min_drafter_util_pct), uom="%"
        )
    if accept is not None or thresholds.min_tau > 0:  # runs without tau evaluation keep their line
        perfdata["tau"] = Perf(accept.tau if accept else None, warn=_below(thresholds.min_tau))
    return perfdata


def _below(floor: float) -> str:
    return f"{_perfdata_number(floor)}:" if floor > 0 else ""


def _ok_summary(progress: logs.TrainingProgress, age: float | None, finished: bool) -> str:
    if finished:
        return f"finished at step {progress.step}"
    if progress.step is None:
        return "starting: no step yet" + (f" ({_seconds(age)} since start)" if age is not None else "")
    parts = [f"step {progress.step}" + (f"/{progress.total_steps}" if progress.total_steps else "")]
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.4f}")
    if progress.tokens_per_s is not None:
        parts.append(f"{progress.tokens_per_s / 1000:.1f} Ktok/s")
    if age is not None:
        parts.append(f"last step {_seconds(age)} ago")
    return ", ".join(parts)


def _perfdata_number(value: float) -> str:
    """Plain decimal (perfdata allows no exponent), at most 4 decimals."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return ("%.4f" % value).rstrip("0").rstrip(".")


def _label(label: str) -> str:
    return label if re.fullmatch(r"[A-Za-z0-9_.:-]+", label) else "'" + label.replace("'", "''") + "'"


def perfdata_text(perfdata: dict, prefix: str = "") -> str:
    items = []
    for label, perf in perfdata.items():
        finite = perf.value is not None and math.isfinite(perf.value)
        value = (_perfdata_number(perf.value) + perf.uom) if finite else "U"
        items.append(f"{_label(prefix + label)}={value};{perf.warn};{perf.crit}")
    return " ".join(items)


def _clean(text: str) -> str:
    # The first "|" starts perfdata and a plugin's first line is all that counts; what the target
    # sent (a path, a name) is shown inert.
    return " ".join(inert(" ".join(text.split())).replace("|", "/").split())


def nagios_line(target_name: str, verdict: Verdict) -> str:
    """`DFLASH LEVEL: target: reasons | perfdata` (exit with verdict.exit_code)."""
    line = f"DFLASH {verdict.level}: {_clean(target_name)}: {_clean(verdict.summary)}"
    perf = perfdata_text(verdict.perfdata)
    return f"{line} | {perf}" if perf else line


def nagios_line_many(results) -> tuple[str, int]:
    """(one line for several (target, Verdict) pairs at the worst level, its exit code)."""
    results = list(results)
    level = worst(v.level for _, v in results)
    text = "; ".join(f"{_clean(name)} {v.level}: {_clean(v.summary)}" for name, v in results)
    perf = " ".join(p for p in (perfdata_text(v.perfdata, prefix=f"{name}_") for name, v in results) if p)
    line = f"DFLASH {level}: {text}"
    return (f"{line} | {perf}" if perf else line), EXIT_CODES[level]
