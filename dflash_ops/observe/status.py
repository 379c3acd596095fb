"""One target's status (what `status` and `health --json` print), its JSON, and how it is built."""

from __future__ import annotations

import dataclasses

from trainer import metrics_format
from trainer.typed_yaml import finite

from dflash_ops.job import jobstate
from dflash_ops.observe import acceptance, gpu_owners, logs
from dflash_ops.observe.gpu import GPU_FIELDS, Gpu, GpuProcess
from dflash_ops.observe.health import Perf, Verdict, progress_age


class _FieldsAsJson:
    """A dataclass whose JSON object is its fields, in their order."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, data: dict):
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class TmuxSession(_FieldsAsJson):
    name: str
    socket: str
    running: bool | None = None  # None where tmux gave no answer
    exists: bool | None = None
    pane_pid: int | None = None
    exit_status: int | None = None


@dataclasses.dataclass(frozen=True)
class JobProcess(_FieldsAsJson):
    pid: int
    ppid: int | None
    name: str | None
    cmdline: str | None

    def runs_module(self, module: str) -> bool:
        """`python -m MODULE ...` (not the pane's shell, whose arguments carry the same words)."""
        words = (self.cmdline or "").split()
        if "-m" not in words[1:3]:
            return False
        at = words.index("-m", 1)
        return words[at + 1 : at + 2] == [module]


@dataclasses.dataclass(frozen=True)
class Training(_FieldsAsJson):  # a number JSON cannot hold (NaN) is None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_update_age_s: float | None = None
    finished: bool = False


@dataclasses.dataclass(frozen=True)
class EvalStatus:
    step: int | None
    tau: float | None
    acceptance: tuple[float, ...]
    lossless: bool | None
    expected_tau: float | None
    age_s: float | None

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), acceptance=list(self.acceptance))

    @classmethod
    def from_json(cls, data: dict) -> EvalStatus:
        return cls(**{**data, "acceptance": tuple(data["acceptance"])})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetStatus:
    """`time` is None when the probe could not run: the job's identity and the verdict remain."""

    target: str
    hostname: str | None = None
    time: float | None = None  # the target's clock at probe time
    probe_seconds: float | None = None
    gpu_source: str | None = None
    gpu_error: str | None = None
    gpus: tuple[Gpu, ...] = ()  # with their roles in the job (_with_roles)
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
        """Its fields in their order, the verdict as verdict_json's keys; eval_search once probed."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "eval_search"}
        data.update(
            gpus=[_gpu_json(g) for g in self.gpus],
            session=self.session.to_json(),
            processes=[p.to_json() for p in self.processes],
            training=self.training.to_json(),
            eval=None if self.eval is None else self.eval.to_json(),
            **verdict_json(data.pop("verdict")),
        )
        if self.probed:
            data["eval_search"] = self.eval_search
        return data

    @classmethod
    def from_json(cls, data: dict) -> TargetStatus:
        """The status `to_json` gave (a recorded `status --json`, say; keys it lacks are None)."""
        plain = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        return cls(
            **{
                **plain,
                "target": data["target"],
                "gpus": tuple(_gpu_from_json(g) for g in data["gpus"]),
                "session": TmuxSession.from_json(data["session"]),
                "processes": tuple(JobProcess.from_json(p) for p in data["processes"]),
                "training": Training.from_json(data["training"]),
                "eval": None if data.get("eval") is None else EvalStatus.from_json(data["eval"]),
                "verdict": Verdict(
                    data["verdict"],
                    tuple(data["reasons"]),
                    {label: Perf(**perf) for label, perf in data["perfdata"].items()},
                ),
            }
        )


def verdict_json(verdict: Verdict) -> dict:
    """The verdict as status --json shows it: its level, reasons and perfdata."""
    return {
        "verdict": verdict.level,
        "reasons": list(verdict.reasons),
        "perfdata": {label: dataclasses.asdict(perf) for label, perf in verdict.perfdata.items()},
    }


def build_status(target_name: str, report, job, verdict: Verdict) -> TargetStatus:
    """The status of one target; without a report the job's identity and UNKNOWN are still reported."""
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
        gpus=_with_roles(report, job),
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
    path = f" {data['path']}" if data.get("path") and data["source"] != "synthetic" else ""
    return str(data["source"]) + path


def _session(s, job) -> TmuxSession:
    as_probed = {key: getattr(s, key) for key in ("running", "exists", "pane_pid", "exit_status")}
    return TmuxSession(name=s.name or job.session, socket=s.socket or job.tmux_socket, **as_probed)


def _training(report, verdict: Verdict) -> Training:
    progress = logs.progress(list(report.records))
    # the age the verdict judged, so `status --json` carries one value for it (perfdata.age_s too)
    judged = verdict.perfdata.get("age_s")
    age = judged.value if judged is not None else progress_age(report, progress, report.time)
    # a stopped or finished job has no time left to estimate (its last step record still carries one)
    state = (report.job_state or {}).get("state")
    ended = state in jobstate.NOT_TO_RESTART or progress.done_reason is not None
    # JSON has no NaN: a non-finite number becomes null (the verdict's reasons say what it was).
    return Training(
        step=progress.step,
        total_steps=progress.total_steps,
        loss=finite(progress.loss),
        tokens_per_s=finite(progress.tokens_per_s),
        eta_s=None if ended else finite(progress.eta_s),
        last_update_age_s=age,
        finished=progress.done_reason == "max_steps",
    )


def _eval_status(accept, now: float) -> EvalStatus | None:
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


def _with_roles(report, job) -> tuple[Gpu, ...]:
    roles = {i: "target" for i in job.target_gpus}
    roles.update({i: "drafter" for i in job.drafter_gpus})
    return tuple(
        dataclasses.replace(
            g,
            role=roles.get(g.index),
            processes=tuple(
                dataclasses.replace(p, foreign=gpu_owners.is_foreign(report, p) if g.index in roles else None)
                for p in g.processes
            ),
        )
        for g in report.gpu.gpus
    )


# a GPU's plain keys in `status --json`, in their order; its ghost memory and processes follow
_GPU_JSON = ("index", "name", "uuid", "memory_used_mib", "memory_total_mib", "utilization_pct", "role")


def _gpu_json(g: Gpu) -> dict:
    return {
        **{key: getattr(g, key) for key in _GPU_JSON},
        "ghost_memory_mib": g.ghost_memory_mib,
        "processes": [
            {
                "pid": p.pid,
                "used_memory_mib": p.used_memory_mib,
                "name": p.name,
                "owner": p.owner or None,
                "foreign": p.foreign,
            }
            for p in g.processes
        ],
    }


def _gpu_from_json(data: dict) -> Gpu:
    """_gpu_json's object as the Gpu it was made from (the ghost memory follows from the rest)."""
    processes = tuple(
        GpuProcess(p["pid"], data["index"], p["used_memory_mib"], p["name"], p["owner"] or "", p["foreign"])
        for p in data["processes"]
    )
    return Gpu(**{k: data[k] for k in GPU_FIELDS}, role=data["role"], processes=processes)
