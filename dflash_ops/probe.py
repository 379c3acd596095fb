"""One round trip: run remote/probe_script.py on the target and read its JSON into a ProbeReport.

`status` and `health` cost exactly one `transport.run` (one ssh session, one `pct exec`).
"""
from __future__ import annotations

import dataclasses
import json
import shlex

from trainer import metrics_format

from .errors import DflashOpsError, RemoteCommandError
from .gpu import GpuSnapshot, snapshot_from_probe
from .model import Job
from .remote import pick_python, script_source

PROBE_SCRIPT = "probe_script.py"
DEFAULT_LOG_LINES = 200
DEFAULT_METRICS_LINES = 400
DEFAULT_TIMEOUT_S = 45.0


class ProbeError(DflashOpsError):
    """The probe ran but its answer could not be read."""


@dataclasses.dataclass(frozen=True)
class SessionState:
    name: str
    socket: str
    exists: bool  # tmux knows the session (its pane may be dead with remain-on-exit)
    running: bool  # the pane's process is alive
    pane_pid: int | None = None
    exit_status: int | None = None  # of a dead pane
    error: str | None = None  # tmux itself could not be asked


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    name: str
    state: str
    cmdline: str


@dataclasses.dataclass(frozen=True)
class FileTail:
    path: str
    size: int
    mtime: float
    lines: tuple[str, ...]
    first_line: str | None = None  # set when `lines` does not reach back to the start

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    target: str
    time: float  # the target's clock: compare with mtimes and metrics times, not the local clock
    hostname: str
    gpu: GpuSnapshot
    session: SessionState
    processes: tuple[ProcessInfo, ...]  # the tmux session's process tree
    log_dir: str
    log: FileTail | None
    metrics: FileTail | None
    records: tuple[dict, ...]  # parsed metrics records, oldest first (the start record included)
    errors: tuple[str, ...] = ()  # probe sections that failed
    seconds: float | None = None  # round trip, when run through run_probe
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


def probe_args(job: Job, log_lines: int = DEFAULT_LOG_LINES, metrics_lines: int = DEFAULT_METRICS_LINES,
               gpu_source: str = "auto", nvidia_smi: str = "nvidia-smi") -> dict:
    return {"log_dir": job.log_dir, "session": job.session, "socket": job.tmux_socket,
            "log_lines": int(log_lines), "metrics_lines": int(metrics_lines), "gpu_source": gpu_source,
            "nvidia_smi": nvidia_smi}


def probe_script_for(job: Job, log_lines: int = DEFAULT_LOG_LINES, metrics_lines: int = DEFAULT_METRICS_LINES,
                     gpu_source: str = "auto", nvidia_smi: str = "nvidia-smi") -> str:
    """The bash script for `transport.run`: the job's python (python3 when that is not installed
    yet, e.g. before the first deploy) runs the probe passed with `-c`; every word is quoted."""
    args = json.dumps(probe_args(job, log_lines, metrics_lines, gpu_source, nvidia_smi))
    return (pick_python(job.python, "dflash probe")
            + f'exec "$py" -c {shlex.quote(script_source(PROBE_SCRIPT))} {shlex.quote(args)}\n')


def run_probe(transport, job: Job, timeout: float = DEFAULT_TIMEOUT_S, log_lines: int = DEFAULT_LOG_LINES,
              metrics_lines: int = DEFAULT_METRICS_LINES, gpu_source: str = "auto",
              nvidia_smi: str = "nvidia-smi") -> ProbeReport:
    """Everything status/health need, in exactly ONE transport.run call.

    Raises the transport's TransportError when the target cannot be reached, RemoteCommandError
    when the probe could not start, ProbeError when its output is unreadable.
    """
    script = probe_script_for(job, log_lines, metrics_lines, gpu_source, nvidia_smi)
    result = transport.run(script, timeout=timeout, step="probe")
    if not result.ok:
        raise RemoteCommandError(transport.name, "probe", result)
    report = parse_probe_output(result.stdout, target=transport.name)
    return dataclasses.replace(report, seconds=result.seconds)


def _json_object(stdout: str) -> dict | None:
    # Login scripts on some hosts print banners; the probe's answer is its last line.
    candidates = [stdout] + [line for line in reversed(stdout.splitlines()) if line.startswith("{")][:1]
    for text in candidates:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def parse_probe_output(stdout: str, target: str = "target") -> ProbeReport:
    data = _json_object(stdout)
    if data is None or "probe_version" not in data or "time" not in data:
        shown = stdout.strip()[:300] or "(no output)"
        raise ProbeError(f"[{target}] probe: the answer is not the probe's JSON: {shown}")
    try:
        session = data.get("session") or {}
        state = SessionState(
            name=str(session.get("name", "")), socket=str(session.get("socket", "")),
            exists=bool(session.get("exists")), running=bool(session.get("running")),
            pane_pid=session.get("pane_pid"), exit_status=session.get("exit_status"),
            error=session.get("error"))
        processes = tuple(ProcessInfo(int(p["pid"]), int(p["ppid"]), str(p["name"]), str(p["state"]),
                                      str(p.get("cmdline", ""))) for p in data.get("processes") or [])
        log = _tail(data.get("log"))
        metrics = _tail(data.get("metrics"))
    except (KeyError, TypeError, ValueError) as e:
        raise ProbeError(f"[{target}] probe: malformed answer ({type(e).__name__}: {e})") from e
    return ProbeReport(
        target=target, time=float(data["time"]), hostname=str(data.get("hostname", "")),
        gpu=snapshot_from_probe(data.get("gpu")), session=state, processes=processes,
        log_dir=str(data.get("log_dir", "")), log=log, metrics=metrics, records=_records(metrics),
        errors=tuple(str(e) for e in data.get("errors") or []), raw=data)


def _tail(value) -> FileTail | None:
    if not value:
        return None
    return FileTail(path=str(value["path"]), size=int(value["size"]), mtime=float(value["mtime"]),
                    lines=tuple(str(line) for line in value.get("lines") or []), first_line=value.get("first_line"))


def _records(metrics: FileTail | None) -> tuple[dict, ...]:
    if metrics is None:
        return ()
    records = metrics_format.parse_lines(metrics.text)
    first = metrics_format.parse_line(metrics.first_line or "")
    # The run's `start` record is the first line; keep it even when the tail is far past it.
    if first is not None and (not records or records[0] != first):
        records.insert(0, first)
    return tuple(records)
