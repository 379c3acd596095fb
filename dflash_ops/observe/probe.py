"""One round trip (one ssh session, one `pct exec`): run remote/probe_script.py, read its JSON."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import shlex
from collections.abc import Sequence

from trainer import metrics_format

from dflash_ops.observe import acceptance, gpu_faults
from dflash_ops.job import jobpaths, jobstate
from dflash_ops.errors import DflashOpsError, RemoteCommandError
from dflash_ops.observe.gpu import HOST_GPU_QUERY_ARGV, GpuSnapshot, parse_host_gpu_query, snapshot_from_probe
from dflash_ops.job.model import Job
from dflash_ops.remote import bundle, python_command, shell_command

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
    exists: bool | None  # tmux knows the session (its pane may be dead); None: tmux gave no answer in time
    running: bool | None  # the pane's process is alive; None: tmux gave no answer in time
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
    out_of_time: tuple[str, ...] = ()  # parts ("gpu", "session") that ran out of their time
    job_state: dict | None = None  # what dflash-ops recorded on the target (see jobstate), checked
    job_state_error: str | None = None  # the state file exists but holds no usable state: why
    log_missing: str | None = None  # the job state's log, when it no longer exists
    marked_pids: tuple[int, ...] = ()  # processes carrying the launcher's marker
    gpu_pids_visible: tuple[int, ...] = ()  # GPU process pids that exist where the probe ran
    seconds: float | None = None  # round trip, when run through run_probe
    gpu_faults: gpu_faults.FaultReport = gpu_faults.NOT_QUERIED  # ECC, row remapping, Xid events
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def eval_scan(self) -> dict | None:
        """How far back the probe looked for the newest eval; None when the tail held it."""
        scan = (self.raw.get("metrics") or {}).get("eval_scan")
        return scan if isinstance(scan, dict) else None


def probe_script_for(
    job: Job,
    log_lines: int = DEFAULT_LOG_LINES,
    metrics_lines: int = DEFAULT_METRICS_LINES,
    gpu_source: str = "auto",
    part_s: float | None = None,
) -> str:
    """The bash script running the probe with the job's python (python3 before the first deploy)."""
    args = {
        **jobpaths.identity_args(job),
        "log_dir": job.log_dir,
        "log_lines": int(log_lines),
        "metrics_lines": int(metrics_lines),
        "gpu_source": gpu_source,
        "eval_context_steps": acceptance.ACC_WINDOW,
    }
    if part_s is not None:
        args["part_s"] = round(float(part_s), 2)
    return python_command(job.python, PROBE_SCRIPT, args, who="dflash probe")


def run_probe(
    transport,
    job: Job,
    timeout: float = DEFAULT_TIMEOUT_S,
    log_lines: int = DEFAULT_LOG_LINES,
    metrics_lines: int = DEFAULT_METRICS_LINES,
    gpu_on_host: int | None = None,
    part_s: float | None = None,
) -> ProbeReport:
    """Everything status/health need, in ONE transport.run; `gpu_on_host=CTID` asks the Proxmox host for
    the GPUs in the same round trip. Raises TransportError, RemoteCommandError or ProbeError."""
    if gpu_on_host is not None:
        inside = probe_script_for(job, log_lines, metrics_lines, gpu_source="none", part_s=part_s)
        return _run_probe_gpu_on_host(transport, inside, timeout, gpu_on_host, part_s)
    script = probe_script_for(job, log_lines, metrics_lines, part_s=part_s)
    result = transport.run(script, timeout=timeout, step="probe", stdin=bundle(PROBE_SCRIPT))
    if not result.ok:
        raise RemoteCommandError(transport.name, "probe", result)
    report = parse_probe_output(result.stdout, target=transport.name)
    return dataclasses.replace(report, seconds=result.seconds)


def _run_probe_gpu_on_host(
    transport, inside: str, timeout: float, ctid: int, part_s: float | None
) -> ProbeReport:
    """The Proxmox host answers for the GPUs (real pids), then the probe `inside` runs in the container."""
    query = limited(HOST_GPU_QUERY_ARGV, part_s)
    faults = limited(gpu_faults.host_faults_argv(), part_s)
    container = transport.in_container(inside, timeout if part_s is None else max(1.0, timeout - part_s))
    script = shell_command("probe_on_host.sh", container, shlex.join(faults), *query)
    # the container's run comes after the host's GPU query, inside this one's limit
    result = transport.run_on_host(
        script, timeout=timeout + 10 if part_s is None else timeout, step="probe", stdin=bundle(PROBE_SCRIPT)
    )
    first, _, rest = result.stdout.partition("\n")
    faults_line, _, rest = rest.partition("\n")
    if not result.ok:
        raise RemoteCommandError(transport.name, "probe", dataclasses.replace(result, stdout=rest))
    report = parse_probe_output(rest, target=transport.name)
    report = dataclasses.replace(report, gpu_faults=_host_faults(faults_line, part_s))
    gpu, late = _host_gpu(first, ctid, part_s, transport.name)
    if late:
        report = dataclasses.replace(report, out_of_time=tuple(sorted(set(report.out_of_time) | {"gpu"})))
    return dataclasses.replace(report, gpu=gpu, seconds=result.seconds)


def _host_gpu(line: str, ctid: int, part_s: float | None, target: str) -> tuple[GpuSnapshot, bool]:
    """The Proxmox host's line of its GPU query as container `ctid` sees the GPUs; whether it ran late."""
    rc, host_out = _host_answer(line, validate=False)
    if host_out is None:
        raise ProbeError(f"[{target}] probe: unreadable GPU answer from the Proxmox host: {line[:200]!r}")
    if part_s is not None and rc.strip() in ("124", "137"):
        error = (
            f"nvidia-smi on the Proxmox host gave no answer within {part_s:.1f} s "
            "(a wedged driver or a hung command)"
        )
        return GpuSnapshot(gpus=(), source="nvidia-smi", error=error), True
    gpu = parse_host_gpu_query(host_out, ctid)
    if rc.strip() != "0" and gpu.error is None:
        gpu = dataclasses.replace(
            gpu, error=f"nvidia-smi on the Proxmox host failed ({rc}): {host_out.strip()[-300:]}"
        )
    return gpu, False


def limited(argv: Sequence[str], part_s: float | None) -> list[str]:
    """argv under coreutils `timeout`, killed 1 s after TERM; as it is without a limit."""
    return list(argv) if part_s is None else ["timeout", "-k", "1", f"{part_s:.2f}s", *argv]


def _host_answer(line: str, validate: bool = True) -> tuple[str, str | None]:
    """A probe_on_host.sh line `<exit code> <answer, base64>`: (the code, the answer or None)."""
    rc, _, encoded = line.partition(" ")
    try:
        return rc, base64.b64decode(encoded, validate=validate).decode("utf-8", "replace")
    except (ValueError, binascii.Error):
        return rc, None


def _host_faults(line: str, part_s: float | None) -> gpu_faults.FaultReport:
    rc, text = _host_answer(line)
    if rc == "-":
        error = "no temporary file on the Proxmox host for the fault query"
    elif part_s is not None and rc in ("124", "137"):
        error = f"the fault query on the Proxmox host gave no answer within {part_s:.1f} s"
    elif text is None:
        error = f"unreadable fault answer from the Proxmox host: {line[:200]!r}"
    else:
        return gpu_faults.parse_host_answer(text)
    return gpu_faults.FaultReport(None, error=error)


def json_answer(stdout: str) -> dict | None:
    """A remote script's JSON object: its output, or its last line starting one (hosts print banners)."""
    candidates = [stdout] + [line for line in reversed(stdout.splitlines()) if line.startswith("{")][:1]
    for text in candidates:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def parse_probe_output(stdout: str, target: str = "target") -> ProbeReport:
    data = json_answer(stdout)
    if data is None or "probe_version" not in data or "time" not in data:
        shown = stdout.strip()[:300] or "(no output)"
        raise ProbeError(f"[{target}] probe: the answer is not the probe's JSON: {shown}")
    try:
        session = data.get("session") or {}
        unanswered = session.get("out_of_time") is True  # neither alive nor gone: unknown
        state = SessionState(
            name=str(session.get("name", "")),
            socket=str(session.get("socket", "")),
            exists=None if unanswered else bool(session.get("exists")),
            running=None if unanswered else bool(session.get("running")),
            pane_pid=_whole(session.get("pane_pid")),
            exit_status=_whole(session.get("exit_status"), signed=True),
            error=None if session.get("error") is None else str(session.get("error"))[:500],
        )
        processes = tuple(
            ProcessInfo(
                int(p["pid"]), int(p["ppid"]), str(p["name"]), str(p["state"]), str(p.get("cmdline", ""))
            )
            for p in data.get("processes") or []
        )
        log = _tail(data.get("log"))
        metrics = _tail(data.get("metrics"))
        eval_lines = [str(line) for line in (data.get("metrics") or {}).get("eval_lines") or []]
        clock = float(data["time"])
        marked = tuple(int(p) for p in data.get("marked_pids") or [])
        visible = tuple(int(p) for p in data.get("gpu_pids_visible") or [])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProbeError(f"[{target}] probe: malformed answer ({type(e).__name__}: {e})") from e
    state_record = jobstate.JobState.from_dict(data.get("job_state"))
    return ProbeReport(
        target=target,
        time=clock,
        hostname=str(data.get("hostname", "")),
        gpu=snapshot_from_probe(data.get("gpu")),
        session=state,
        processes=processes,
        log_dir=str(data.get("log_dir", "")),
        log=log,
        metrics=metrics,
        records=tuple(
            # metrics from before the launch that wrote the job state are an older trainer's
            metrics_format.current_run(
                list(_records(metrics, eval_lines)), state_record.since if state_record is not None else None
            )
        ),
        errors=tuple(str(e) for e in data.get("errors") or []),
        out_of_time=tuple(str(p) for p in data.get("out_of_time") or []),
        job_state=state_record.to_dict() if state_record else None,
        job_state_error=_state_error(data, state_record),
        log_missing=data.get("log_missing") or None,
        marked_pids=marked,
        gpu_pids_visible=visible,
        gpu_faults=gpu_faults.parse(data.get("gpu_faults")),
        raw=data,
    )


def _state_error(data: dict, record) -> str | None:
    """What is wrong with the job state file, or None when it is absent or fine."""
    error = data.get("job_state_error")
    if error:
        return str(error)[:200]
    if record is None and data.get("job_state") is not None:
        return "not a dflash-ops job state (no state running/stopped/finished)"
    return None


def _whole(value, signed: bool = False) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if signed or value >= 0 else None


def _tail(value) -> FileTail | None:
    if not value:
        return None
    return FileTail(
        path=str(value["path"]),
        size=int(value["size"]),
        mtime=float(value["mtime"]),
        lines=tuple(str(line) for line in value.get("lines") or []),
        first_line=value.get("first_line"),
    )


def _records(metrics: FileTail | None, eval_lines: Sequence[str] = ()) -> tuple[dict, ...]:
    if metrics is None:
        return ()
    records = metrics_format.parse_lines(metrics.text)
    # The newest eval found before the tail (with the step records just before it) precedes the tail.
    records[:0] = metrics_format.parse_lines("\n".join(eval_lines))
    first = metrics_format.parse_line(metrics.first_line or "")
    # The run's `start` record is the first line; keep it even when the tail is far past it.
    if first is not None and (not records or records[0] != first):
        records.insert(0, first)
    return tuple(records)
