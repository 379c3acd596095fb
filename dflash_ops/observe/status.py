"""One target's TargetStatus from its probe report, the job and the verdict."""

from __future__ import annotations

from trainer import metrics_format
from trainer.typed_yaml import finite

from dflash_ops.observe import acceptance, logs

from dflash_ops.job import jobstate
from dflash_ops.observe import gpu_rows
from dflash_ops.observe.health import Verdict, progress_age
from dflash_ops.observe.session_status import JobProcess, TmuxSession
from dflash_ops.observe.target_status import TargetStatus
from dflash_ops.observe.training_status import EvalStatus, Training


def build_status(target_name: str, report, job, verdict: Verdict) -> TargetStatus:
    """The status of one target. `report` may be None when the probe could not run; the job's
    identity and the (UNKNOWN) verdict are still reported."""
    if report is None:
        return TargetStatus(
            target=target_name, session=TmuxSession(job.session, job.tmux_socket), verdict=verdict
        )
    return TargetStatus(
        target=target_name,
        hostname=report.hostname,
        time=report.time,
        probe_seconds=report.seconds,
        gpu_source=report.gpu.source,
        gpu_error=report.gpu.error,
        gpus=gpu_rows.with_roles(report, job),
        session=_session(report.session, job),
        processes=tuple(JobProcess(p.pid, p.ppid, p.name, p.cmdline) for p in report.processes),
        log=report.log.path if report.log else None,
        metrics=report.metrics.path if report.metrics else None,
        data_source=data_source(report.records),
        job_state=report.job_state,
        job_state_error=report.job_state_error,
        log_missing=report.log_missing,
        training=_training(report, verdict),
        eval=_eval_status(acceptance.latest(list(report.records)), report.time),
        verdict=verdict,
        eval_search=report.eval_scan,
    )


def data_source(records) -> str | None:
    """`features /data/cache`, `jsonl /data/train.jsonl` or `synthetic`: from the run's start record."""
    start = metrics_format.last_of(list(records), "start")
    data = ((start or {}).get("config") or {}).get("data") or {}
    if not isinstance(data, dict) or not data.get("source"):
        return None
    return str(data["source"]) + (
        f" {data['path']}" if data.get("path") and data["source"] != "synthetic" else ""
    )


def _session(s, job) -> TmuxSession:
    return TmuxSession(
        name=s.name or job.session,
        socket=s.socket or job.tmux_socket,
        running=s.running,
        exists=s.exists,
        pane_pid=s.pane_pid,
        exit_status=s.exit_status,
    )


def _ended(report, progress) -> bool:
    """A stopped or finished job has no time left to estimate (its last step record still carries one)."""
    state = (report.job_state or {}).get("state")
    return state in jobstate.NOT_TO_RESTART or progress.done_reason is not None


def _training(report, verdict: Verdict) -> Training:
    progress = logs.progress(list(report.records))
    # the age the verdict judged, so `status --json` carries one value for it (perfdata.age_s too)
    judged = verdict.perfdata.get("age_s")
    age = judged.value if judged is not None else progress_age(report, progress, report.time)
    # JSON has no NaN: a non-finite number becomes null (the verdict's reasons say what it was).
    return Training(
        step=progress.step,
        total_steps=progress.total_steps,
        loss=finite(progress.loss),
        tokens_per_s=finite(progress.tokens_per_s),
        eta_s=None if _ended(report, progress) else finite(progress.eta_s),
        last_update_age_s=age,
        finished=progress.done_reason == "max_steps",
    )


def _eval_status(accept, now: float) -> EvalStatus | None:
    """The latest speculative-decoding evaluation (tau) and how old it is."""
    if accept is None:
        return None
    return EvalStatus(
        step=accept.step,
        tau=accept.tau,
        acceptance=tuple(accept.acceptance),
        lossless=accept.lossless,
        expected_tau=finite(accept.expected_tau),
        age_s=None if accept.time is None else max(0.0, round(now - accept.time, 1)),
    )
