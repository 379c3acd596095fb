"""GPU snapshots and the questions relaunch asks of them; inside LXC the driver reports HOST pids,
which the helpers here map to containers on the Proxmox host."""

from __future__ import annotations

import dataclasses
import re
import shlex

from dflash_ops.errors import DflashOpsError, InputError
from dflash_ops.remote import facts, shell_argv

NOT_AVAILABLE = ("[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "[Insufficient Permissions]", "")
# What counts as "free" by default: an idle H200 shows a few MiB; a CUDA context is ~500 MiB.
IDLE_USED_MIB = 1024
# what a GPU is, as nvidia-smi and NVML describe it (its processes and role come from elsewhere)
GPU_FIELDS = ("index", "uuid", "name", "memory_used_mib", "memory_total_mib", "utilization_pct")


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_index: int
    used_memory_mib: int | None  # None where the driver cannot say (e.g. containerised process)
    name: str = ""
    # Whose process, when the query ran on the Proxmox host: "" (this container; pid is then
    # the pid inside it), "ct 201" (another container; host pid) or "host" (host pid).
    owner: str = ""
    # On a job GPU, as status tells it: another owner's (True), the job's (False), cannot be told
    # (None); None too on a GPU the job does not use
    foreign: bool | None = None


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None  # None when the driver reports [N/A]
    processes: tuple[GpuProcess, ...] = ()
    role: str | None = None  # in the job, as status tells it: "target", "drafter", or None (not the job's)

    @property
    def ghost_memory_mib(self) -> int:
        """Memory in use that no listed process accounts for (host pids, leaked contexts)."""
        if self.memory_used_mib is None or any(p.used_memory_mib is None for p in self.processes):
            return 0  # memory not attributable per process is not evidence of a ghost
        accounted = sum(p.used_memory_mib or 0 for p in self.processes)
        return max(0, self.memory_used_mib - accounted)


@dataclasses.dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[Gpu, ...]
    source: str | None  # "nvidia-smi" | "nvml" | None
    error: str | None = None  # why there are no GPUs to show ("no NVIDIA driver (...)")

    @property
    def ok(self) -> bool:
        return self.error is None

    def by_index(self, index: int) -> Gpu | None:
        return next((gpu for gpu in self.gpus if gpu.index == index), None)


class GpuUnavailable(DflashOpsError):
    """The GPU state could not be read (no driver, nvidia-smi failed)."""


def _smi_int(text: str) -> int | None:
    """'1234' or '1234 MiB' or '45 %' -> int; '[N/A]' and friends -> None."""
    text = text.strip()
    if text in NOT_AVAILABLE:
        return None
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*(?:MiB|%|W|C)?", text)
    if not match:
        raise ValueError(f"not a number: {text!r}")
    return int(round(float(match.group(1))))


def _split(line: str, left: int, right: int) -> list[str]:
    parts = line.split(",")
    if len(parts) < left + right + 1:
        raise ValueError(f"expected at least {left + right + 1} fields: {line!r}")
    middle = ",".join(parts[left : len(parts) - right])
    return [*map(str.strip, parts[:left]), middle.strip(), *map(str.strip, parts[len(parts) - right :])]


def parse_nvidia_smi(gpu_csv: str, apps_csv: str = "", source: str = "nvidia-smi") -> GpuSnapshot:
    """Snapshot from the CSV of remote/facts.py's queries; anything else (an error message) is `error`."""
    gpus: list[dict] = []
    try:
        for line in gpu_csv.splitlines():
            if not line.strip():
                continue
            index, uuid, name, used, total, util = _split(line, 2, 3)
            values = (int(index), uuid, name, _smi_int(used), _smi_int(total), _smi_int(util))
            gpus.append(dict(zip(GPU_FIELDS, values, strict=True)))
    except ValueError:
        text = gpu_csv.strip().splitlines()[0] if gpu_csv.strip() else "unreadable output"
        if "couldn't communicate with the NVIDIA driver" in text:
            text = f"no NVIDIA driver ({text})"
        return GpuSnapshot((), source, text)
    index_of = {g["uuid"]: g["index"] for g in gpus}
    processes: list[GpuProcess] = []
    for line in apps_csv.splitlines():
        if not line.strip():
            continue
        try:
            # process_name (4th, free text) is optional: `pid,gpu_uuid,used_memory` is parsed too
            pid, uuid, used, name = _split(line, 3, 0) if line.count(",") >= 3 else _split(line, 2, 0) + [""]
            if uuid in index_of:
                processes.append(GpuProcess(int(pid), index_of[uuid], _smi_int(used), name))
        except ValueError:
            continue  # one odd row (a process name nvidia-smi mangled) must not hide the GPUs
    return _snapshot(gpus, processes, source)


def _snapshot(gpus: list[dict], processes: list[GpuProcess], source: str | None) -> GpuSnapshot:
    built = (
        Gpu(
            **{k: g[k] for k in GPU_FIELDS},
            processes=tuple(p for p in processes if p.gpu_index == g["index"]),
        )
        for g in gpus
    )
    return GpuSnapshot(tuple(built), source, None)


def snapshot_from_probe(gpu: dict | None) -> GpuSnapshot:
    """The probe's `gpu` section (raw nvidia-smi CSV, or NVML dicts) as a snapshot."""
    if not isinstance(gpu, dict):
        return GpuSnapshot((), None, "the probe returned no GPU section")
    source = gpu.get("source")
    if gpu.get("error"):
        return GpuSnapshot((), source, str(gpu["error"]))
    if source == "nvidia-smi":
        return parse_nvidia_smi(gpu.get("gpu_csv", ""), gpu.get("apps_csv", ""), source)
    processes = [
        GpuProcess(int(p["pid"]), int(p["gpu_index"]), p.get("used_memory_mib"), p.get("name", ""))
        for p in gpu.get("processes", [])
    ]
    return _snapshot(gpu.get("gpus", []), processes, source)


@dataclasses.dataclass(frozen=True)
class BusyGpu:
    """A GPU that still holds memory, and who holds it."""

    index: int
    memory_used_mib: int | None
    memory_total_mib: int | None
    processes: tuple[GpuProcess, ...]
    ghost_mib: int

    def describe(self) -> str:
        holders = [
            f"pid {p.pid}"
            + (f" ({p.name})" if p.name else "")
            + (f" [{p.owner}]" if p.owner else "")
            + (f" {p.used_memory_mib} MiB" if p.used_memory_mib is not None else "")
            for p in self.processes
        ]
        if self.ghost_mib or not holders:
            holders.append(f"{self.ghost_mib} MiB ghost memory with no process")
        used = "?" if self.memory_used_mib is None else self.memory_used_mib
        return f"GPU {self.index}: {used} MiB used by " + ", ".join(holders)


def busy_gpus(
    snapshot: GpuSnapshot, indices, min_free_mib: int | None = None, max_used_mib: int = IDLE_USED_MIB
) -> list[BusyGpu]:
    """GPUs among `indices` not free yet: free is `min_free_mib` unused, or by default no compute process
    and at most `max_used_mib` used. GpuUnavailable without GPU data; InputError for an unknown index."""
    indices = sorted({int(i) for i in indices})
    if not indices:
        return []
    if not snapshot.ok:
        raise GpuUnavailable(f"cannot check GPUs {_list(indices)}: {snapshot.error}")
    present = [g.index for g in snapshot.gpus]
    missing = [i for i in indices if i not in present]
    if missing:
        raise InputError(
            f"job GPUs {_list(missing)} do not exist on this machine (it has GPUs "
            f"{_list(present) or 'none'}); fix target_gpus/drafter_gpus in the inventory"
        )
    busy = []
    for index in indices:
        gpu = snapshot.by_index(index)
        assert gpu is not None  # missing GPUs were refused above
        used = gpu.memory_used_mib
        if used is None:
            is_busy = bool(gpu.processes)
        elif min_free_mib is None:
            is_busy = used > max_used_mib or bool(gpu.processes)  # any listed process still holds it
        else:
            is_busy = (gpu.memory_total_mib or 0) - used < min_free_mib
        if is_busy:
            busy.append(BusyGpu(index, used, gpu.memory_total_mib, gpu.processes, gpu.ghost_memory_mib))
    return busy


def _list(indices) -> str:
    return ",".join(str(i) for i in indices)


def container_of_pid(cgroup_text: str) -> str | None:
    """Container id (as text) a process belongs to, from /proc/PID/cgroup: cgroup v2, v1 and
    `lxc.payload.N`; the LXC monitor (`/lxc.monitor/N`) is NOT in the container."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)[-1].split("/")
        for i, part in enumerate(parts):
            if part.startswith("lxc.payload."):
                return part[len("lxc.payload.") :] or None
            if part == "lxc" and i + 1 < len(parts) and parts[i + 1]:
                return parts[i + 1]
    return None


# Run on the Proxmox host: GPUs, compute apps (host pids), then each app's cgroup and NSpid.
HOST_GPU_QUERY_ARGV = shell_argv("host_gpu_query.sh", *facts.gpu_query_argv(), "--", *facts.apps_query_argv())
HOST_GPU_QUERY = shlex.join(HOST_GPU_QUERY_ARGV)


def parse_host_gpu_query(stdout: str, ctid) -> GpuSnapshot:
    """HOST_GPU_QUERY's output as container `ctid` sees it: its processes with their in-container pids."""
    gpu_csv, _, rest = stdout.partition("@@")
    apps_csv, _, procs = rest.partition("@@")
    snapshot = parse_nvidia_smi(gpu_csv, apps_csv, "nvidia-smi on the Proxmox host")
    chunks = (chunk.partition("\n") for chunk in procs.split("@pid ")[1:])
    about = {int(head): text for head, _, text in chunks if head.strip().isdigit()}
    return dataclasses.replace(
        snapshot,
        gpus=tuple(
            dataclasses.replace(
                g, processes=tuple(_as_seen_from(p, about.get(p.pid), ctid) for p in g.processes)
            )
            for g in snapshot.gpus
        ),
    )


def _as_seen_from(process: GpuProcess, proc_text: str | None, ctid) -> GpuProcess:
    if not proc_text:
        return dataclasses.replace(process, owner="gone")  # exited between the queries: no /proc entry
    container = container_of_pid(proc_text)
    if container == str(ctid):
        inside = nspid_from_status(proc_text)
        return dataclasses.replace(process, pid=inside if inside is not None else process.pid)
    return dataclasses.replace(process, owner=f"ct {container}" if container else "host")


def nspid_from_status(status_text: str) -> int | None:
    """The pid as seen inside the process's innermost pid namespace (last NSpid field)."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields else None
    return None
