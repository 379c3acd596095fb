"""What `status` shows: one JSON-ready dict per target, and a dense gpustat-like table of it."""

from __future__ import annotations

from trainer import metrics_format
from trainer.typed_yaml import finite

from dflash_ops.observe import acceptance, gpu_owners, logs

from dflash_ops.act import jobstate
from dflash_ops.gpu import IDLE_USED_MIB
from dflash_ops.observe.health import Verdict, progress_age

COLORS = {"OK": "32", "WARNING": "33", "CRITICAL": "31", "UNKNOWN": "35"}


def _roles(job) -> dict:
    roles = {i: "target" for i in job.target_gpus}
    roles.update({i: "drafter" for i in job.drafter_gpus})
    return roles


def data_source(records) -> str | None:
    """`features /data/cache`, `jsonl /data/train.jsonl` or `synthetic`: from the run's start record."""
    start = metrics_format.last_of(list(records), "start")
    data = ((start or {}).get("config") or {}).get("data") or {}
    if not isinstance(data, dict) or not data.get("source"):
        return None
    return str(data["source"]) + (
        f" {data['path']}" if data.get("path") and data["source"] != "synthetic" else ""
    )


def _ended(report, progress) -> bool:
    """A stopped or finished job has no time left to estimate (its last step record still carries one)."""
    state = (report.job_state or {}).get("state")
    return state in (jobstate.STOPPED, jobstate.FINISHED) or progress.done_reason is not None


def build_status(target_name: str, report, job, verdict: Verdict) -> dict:
    """The status of one target. `report` may be None when the probe could not run; the job's
    identity and the (UNKNOWN) verdict are still reported."""
    status = {
        "target": target_name,
        "hostname": None,
        "time": None,
        "probe_seconds": None,
        "gpu_source": None,
        "gpu_error": None,
        "gpus": [],
        "session": {
            "name": job.session,
            "socket": job.tmux_socket,
            "running": None,
            "exists": None,
            "pane_pid": None,
            "exit_status": None,
        },
        "processes": [],
        "log": None,
        "metrics": None,
        "data_source": None,
        "job_state": None,
        "job_state_error": None,
        "log_missing": None,
        "training": {
            "step": None,
            "total_steps": None,
            "loss": None,
            "tokens_per_s": None,
            "eta_s": None,
            "last_update_age_s": None,
            "finished": False,
        },
        "eval": None,
        "verdict": verdict.level,
        "reasons": list(verdict.reasons),
        "perfdata": verdict.to_dict()["perfdata"],
    }
    if report is None:
        return status
    status.update(
        hostname=report.hostname,
        time=report.time,
        probe_seconds=report.seconds,
        gpu_source=report.gpu.source,
        gpu_error=report.gpu.error,
        log=report.log.path if report.log else None,
        job_state=report.job_state,
        job_state_error=report.job_state_error,
        log_missing=report.log_missing,
        metrics=report.metrics.path if report.metrics else None,
        gpus=_gpus(report, job),
        session=_session(report.session, job),
        processes=[
            {"pid": p.pid, "ppid": p.ppid, "name": p.name, "cmdline": p.cmdline} for p in report.processes
        ],
        data_source=data_source(report.records),
        training=_training(report, verdict),
        eval=_eval_status(acceptance.latest(list(report.records)), report.time),
        eval_search=report.eval_scan,
    )
    return status


def _gpus(report, job) -> list[dict]:
    roles = _roles(job)
    return [
        {
            "index": g.index,
            "name": g.name,
            "uuid": g.uuid,
            "memory_used_mib": g.memory_used_mib,
            "memory_total_mib": g.memory_total_mib,
            "utilization_pct": g.utilization_pct,
            "role": roles.get(g.index),
            "ghost_memory_mib": g.ghost_memory_mib,
            "processes": [
                {
                    "pid": p.pid,
                    "used_memory_mib": p.used_memory_mib,
                    "name": p.name,
                    "owner": p.owner or None,
                    "foreign": gpu_owners.is_foreign(report, p) if roles.get(g.index) else None,
                }
                for p in g.processes
            ],
        }
        for g in report.gpu.gpus
    ]


def _session(s, job) -> dict:
    return {
        "name": s.name or job.session,
        "socket": s.socket or job.tmux_socket,
        "running": s.running,
        "exists": s.exists,
        "pane_pid": s.pane_pid,
        "exit_status": s.exit_status,
    }


def _training(report, verdict: Verdict) -> dict:
    progress = logs.progress(list(report.records))
    # the age the verdict judged, so `status --json` carries one value for it (perfdata.age_s too)
    judged = verdict.perfdata.get("age_s")
    age = judged.value if judged is not None else progress_age(report, progress, report.time)
    # JSON has no NaN: a non-finite number becomes null (the verdict's reasons say what it was).
    return {
        "step": progress.step,
        "total_steps": progress.total_steps,
        "loss": finite(progress.loss),
        "tokens_per_s": finite(progress.tokens_per_s),
        "eta_s": None if _ended(report, progress) else finite(progress.eta_s),
        "last_update_age_s": age,
        "finished": progress.done_reason == "max_steps",
    }


def _eval_status(accept, now: float) -> dict | None:
    """The latest speculative-decoding evaluation (tau) and how old it is."""
    if accept is None:
        return None
    return {
        "step": accept.step,
        "tau": accept.tau,
        "acceptance": list(accept.acceptance),
        "lossless": accept.lossless,
        "expected_tau": finite(accept.expected_tau),
        "age_s": None if accept.time is None else max(0.0, round(now - accept.time, 1)),
    }


# --------------------------------------------------------------------------- table


def _paint(text: str, code: str, color: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if color else text


def format_eta(seconds) -> str:
    """`22 s`, `12m05s` under an hour (where h:mm would show 0:00), else h:mm (hours may exceed 24)."""
    if seconds is None:
        return "-"
    if seconds < 59.5:
        return f"{max(0, round(seconds))} s"
    if seconds < 3599.5:
        whole = int(round(seconds))
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = int(round(seconds / 60))
    return f"{minutes // 60}:{minutes % 60:02d}"


def format_age(seconds) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _gpu_line(gpu: dict, name_width: int, color: bool) -> str:
    used, total, util = gpu["memory_used_mib"], gpu["memory_total_mib"], gpu["utilization_pct"]
    util_text = "N/A" if util is None else f"{util:>3} %"
    mem = f"{'?' if used is None else used:>6} / {'?' if total is None else total:>6} MiB"
    pids = " ".join(
        f"{p['name'] or '?'}/{p['pid']}"
        + (f"({p['used_memory_mib']}M)" if p["used_memory_mib"] is not None else "")
        + (f"[{p['owner']}]" if p.get("owner") else "")
        + ("[foreign]" if p.get("foreign") else "")
        for p in gpu["processes"]
    )
    # small differences between used and per-process memory are the driver's own; name big ones
    if (gpu.get("ghost_memory_mib") or 0) > IDLE_USED_MIB:
        pids = (pids + " " if pids else "") + f"ghost({gpu['ghost_memory_mib']}M)"
    role = gpu.get("role") or "-"
    index = _paint(f"[{gpu['index']}]", "1", color)
    return f"{index} {gpu['name']:<{name_width}} | {util_text:>5} | {mem} | {role:<7} | {pids or '-'}"


def render_table(status: dict, color: bool = False) -> str:
    """Dense text for people: one line per GPU, then session, progress and the verdict."""
    head = status["target"]
    if status.get("hostname"):
        head += f" ({status['hostname']})"
    if status.get("probe_seconds") is not None:
        head += f"  probe {status['probe_seconds']:.2f} s"
    lines = [_paint(head, "1", color)]
    if status.get("gpu_error"):
        lines.append(f"GPUs: {status['gpu_error']}")
    elif status.get("time") is not None:
        if not status["gpus"]:
            lines.append("GPUs: none")
        width = max((len(g["name"]) for g in status["gpus"]), default=0)
        lines += [_gpu_line(g, width, color) for g in status["gpus"]]
    s = status["session"]
    if s["running"] is None:
        state = "unknown"
    elif s["running"]:
        state = "running" + (f", pane pid {s['pane_pid']}" if s["pane_pid"] else "")
    elif s["exists"]:
        state = "exited" + (f" with status {s['exit_status']}" if s["exit_status"] is not None else "")
    else:
        state = "not running"
    lines.append(f"session {s['name']} (tmux -L {s['socket']}): {state}")
    if status.get("job_state"):
        lines.append(describe_job_state(status["job_state"], status.get("log_missing")))
    if status.get("job_state_error"):
        lines.append(f"job state: unusable ({status['job_state_error']})")
    t = status["training"]
    step = "-" if t["step"] is None else str(t["step"]) + (f"/{t['total_steps']}" if t["total_steps"] else "")
    loss = "-" if t["loss"] is None else f"{t['loss']:.4f}"
    speed = "-" if t["tokens_per_s"] is None else f"{t['tokens_per_s'] / 1000:.1f}"
    age = t["last_update_age_s"]
    freshness = "no metrics yet" if age is None else f"last metrics {format_age(age)} ago"
    source = f"  data {status['data_source']}" if status.get("data_source") else ""
    ev = status.get("eval")
    tau = "" if not ev or ev["tau"] is None else f"  tau {ev['tau']:.2f} ({format_age(ev['age_s'])} ago)"
    lines.append(
        f"step {step}  loss {loss}  {speed} Ktok/s{tau}  ETA {format_eta(t['eta_s'])}  {freshness}{source}"
    )
    level = status["verdict"]
    lines.append(_paint(level, COLORS.get(level, "0"), color) + ": " + "; ".join(status["reasons"]))
    return "\n".join(lines) + "\n"


def describe_job_state(state: dict, log_missing: str | None = None) -> str:
    """`job: stopped by dflash-ops stop, run 0003, log …/train-0007.log` (what dflash-ops recorded)."""
    parts = [f"job: {state.get('state')}" + (f" by {state['by']}" if state.get("by") else "")]
    if isinstance(state.get("run"), int):
        parts.append(f"run {state['run']:04d}")
    if state.get("log"):
        parts.append(f"log {state['log']}" + (" (MISSING)" if log_missing else ""))
    return ", ".join(parts)
