"""One target's status: the object `status` prints as a table for people and as JSON for scripts,
and that `health --json` prints too."""

from __future__ import annotations

import dataclasses

from dflash_ops.observe import gpu_rows
from dflash_ops.observe.gpu import Gpu
from dflash_ops.observe.health import Perf, Verdict
from dflash_ops.observe.session_status import JobProcess, TmuxSession
from dflash_ops.observe.text_style import BOLD, LEVEL_COLORS, inert, paint
from dflash_ops.observe.training_status import EvalStatus, Training, progress_line


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetStatus:
    """`time` is None when the probe could not run: the job's identity and the verdict remain."""

    target: str
    hostname: str | None = None
    time: float | None = None  # the target's clock at probe time
    probe_seconds: float | None = None
    gpu_source: str | None = None
    gpu_error: str | None = None
    gpus: tuple[Gpu, ...] = ()  # with their roles in the job (observe.gpu_rows.with_roles)
    session: TmuxSession
    processes: tuple[JobProcess, ...] = ()
    log: str | None = None
    metrics: str | None = None
    data_source: str | None = None
    job_state: dict | None = None  # what dflash-ops recorded on the target
    job_state_error: str | None = None
    log_missing: str | None = None
    training: Training = Training()
    eval: EvalStatus | None = None
    verdict: Verdict
    eval_search: dict | None = None  # how far the probe looked back for `eval`

    @property
    def name(self) -> str:
        return self.target

    @property
    def probed(self) -> bool:
        return self.time is not None

    def to_json(self) -> dict:
        data = {
            "target": self.target,
            "hostname": self.hostname,
            "time": self.time,
            "probe_seconds": self.probe_seconds,
            "gpu_source": self.gpu_source,
            "gpu_error": self.gpu_error,
            "gpus": [gpu_rows.to_json(g) for g in self.gpus],
            "session": self.session.to_json(),
            "processes": [p.to_json() for p in self.processes],
            "log": self.log,
            "metrics": self.metrics,
            "data_source": self.data_source,
            "job_state": self.job_state,
            "job_state_error": self.job_state_error,
            "log_missing": self.log_missing,
            "training": self.training.to_json(),
            "eval": None if self.eval is None else self.eval.to_json(),
            **verdict_json(self.verdict),
        }
        if self.probed:
            data["eval_search"] = self.eval_search
        return data

    @classmethod
    def from_json(cls, data: dict) -> TargetStatus:
        """The status `to_json` gave (a recorded `status --json`, say; keys it lacks are None)."""
        return cls(
            target=data["target"],
            hostname=data.get("hostname"),
            time=data.get("time"),
            probe_seconds=data.get("probe_seconds"),
            gpu_source=data.get("gpu_source"),
            gpu_error=data.get("gpu_error"),
            gpus=tuple(gpu_rows.from_json(g) for g in data["gpus"]),
            session=TmuxSession.from_json(data["session"]),
            processes=tuple(JobProcess.from_json(p) for p in data["processes"]),
            log=data.get("log"),
            metrics=data.get("metrics"),
            data_source=data.get("data_source"),
            job_state=data.get("job_state"),
            job_state_error=data.get("job_state_error"),
            log_missing=data.get("log_missing"),
            training=Training.from_json(data["training"]),
            eval=None if data.get("eval") is None else EvalStatus.from_json(data["eval"]),
            verdict=verdict_from_json(data),
            eval_search=data.get("eval_search"),
        )

    def to_text(self, color: bool = False) -> str:
        """Dense text for people: one line per GPU, then session, progress and the verdict. What
        the target sent (its hostname, names, paths, the job state) is shown inert."""
        lines = [paint(inert(self._head()), BOLD, color)]
        if self.gpu_error:
            lines.append(inert(f"GPUs: {self.gpu_error}"))
        elif self.probed:
            if not self.gpus:
                lines.append("GPUs: none")
            width = max((len(g.name) for g in self.gpus), default=0)
            lines += [gpu_rows.line(g, width, color) for g in self.gpus]
        lines.append(inert(self.session.line()))
        if self.job_state:
            lines.append(inert(describe_job_state(self.job_state, self.log_missing)))
        if self.job_state_error:
            lines.append(inert(f"job state: unusable ({self.job_state_error})"))
        lines.append(inert(progress_line(self.training, self.eval, self.data_source)))
        level = self.verdict.level
        lines.append(paint(level, LEVEL_COLORS.get(level, "0"), color) + ": " + inert(self.verdict.summary))
        return "\n".join(lines) + "\n"

    def _head(self) -> str:
        head = self.target
        if self.hostname:
            head += f" ({self.hostname})"
        if self.probe_seconds is not None:
            head += f"  probe {self.probe_seconds:.2f} s"
        return head


def verdict_json(verdict: Verdict) -> dict:
    """The verdict as status --json shows it: its level, reasons and perfdata."""
    return {
        "verdict": verdict.level,
        "reasons": list(verdict.reasons),
        "perfdata": verdict.to_dict()["perfdata"],
    }


def verdict_from_json(data: dict) -> Verdict:
    perfdata = {label: Perf(**perf) for label, perf in data["perfdata"].items()}
    return Verdict(data["verdict"], tuple(data["reasons"]), perfdata)


def describe_job_state(state: dict, log_missing: str | None = None) -> str:
    """`job: stopped by dflash-ops stop, run 0003, log …/train-0007.log` (what dflash-ops recorded)."""
    parts = [f"job: {state.get('state')}" + (f" by {state['by']}" if state.get("by") else "")]
    if isinstance(state.get("run"), int):
        parts.append(f"run {state['run']:04d}")
    if state.get("log"):
        parts.append(f"log {state['log']}" + (" (MISSING)" if log_missing else ""))
    return ", ".join(parts)
