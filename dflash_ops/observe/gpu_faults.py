"""GPU faults from the probe's `gpu_faults` section, parsed here once: uncorrected ECC errors, a failed
row remap or a fatal Xid are CRITICAL (the GPU cannot be trusted until reset or replaced); pending
retirements or remaps and other recent Xids are WARNINGs. Only the job's GPUs count for its verdict."""

from __future__ import annotations

import dataclasses
import re

from dflash_ops.remote import facts, shell_argv
from dflash_ops.remote.gpu_faults import KERNEL_LOG_COMMANDS, MAX_XID_LINES

# Xids after which the GPU needs a reset or replacement (48 double-bit ECC, 63/64 page retirement
# failed, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained
# ECC, 119/120 GSP, 140 unrecovered ECC); any other Xid (13 graphics exception, 31 MMU fault, 43
# app stopped …) is usually the application's and counts as a WARNING.
FATAL_XIDS = frozenset({48, 64, 74, 79, 94, 95, 119, 120, 140})
XID_WINDOW_S = 3600.0  # an Xid older than this no longer colours the verdict (metrics still count it)
_XID_LINE = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\].*?NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\):\s*(\d+)(?:,\s*(.*))?")
_YES = ("yes", "1", "true", "enabled")
_NO = ("no", "0", "false", "disabled")


@dataclasses.dataclass(frozen=True)
class GpuFaults:
    """One GPU's counters; None where the GPU or the driver cannot say ([N/A], not supported)."""

    index: int
    pci_bus_id: str | None = None
    ecc_uncorrected: int | None = None  # since the driver loaded (volatile)
    retired_pages_pending: bool | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remap_failure: bool | None = None


@dataclasses.dataclass(frozen=True)
class XidEvent:
    code: int
    pci: str
    gpu: int | None  # the GPU index the PCI address belongs to, None when no GPU has it
    age_s: float | None  # seconds before the probe, None when the stamp cannot be placed
    text: str

    def describe(self) -> str:
        where = f"GPU {self.gpu}" if self.gpu is not None else f"PCI {self.pci}"
        if self.age_s is None:
            ago = ""
        else:
            ago = f" ({self.age_s / 60:.0f} min ago)" if self.age_s >= 120 else f" ({self.age_s:.0f} s ago)"
        return f"Xid {self.code} on {where}{ago}" + (f": {self.text}" if self.text else "")


@dataclasses.dataclass(frozen=True)
class FaultReport:
    source: str | None  # "nvml" | "nvidia-smi" | None (not queried)
    gpus: tuple[GpuFaults, ...] = ()
    error: str | None = None  # the fault counters could not be read
    xids: tuple[XidEvent, ...] = ()
    kernel_log: str | None = None  # what was read: "dmesg", "journalctl -k …"
    kernel_log_error: str | None = None  # why no kernel log could be read


NOT_QUERIED = FaultReport(None, error="not queried")


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:  # [N/A], [Not Supported] and the like
        return None


def _flag(text) -> bool | None:
    """Yes/No (nvidia-smi) or 1/0 (NVML, some drivers); anything else ([N/A]) is absent."""
    if isinstance(text, bool) or text is None:
        return text
    word = str(text).strip().lower()
    return True if word in _YES else False if word in _NO else None


def bus_key(pci: str | None) -> str | None:
    """`00000000:18:00.0`, `0000:18:00` and `18:00.0` all name bus 18, device 00: `18:00`."""
    if not pci:
        return None
    parts = pci.strip().lower().split(":")
    if len(parts) < 2:
        return None
    return f"{parts[-2].lstrip('0') or '0'}:{parts[-1].split('.')[0]}"


def parse(section) -> FaultReport:
    """The probe's `gpu_faults` section as a FaultReport (never raises on odd input)."""
    if not isinstance(section, dict):
        return NOT_QUERIED
    gpus = _counters(section)
    by_bus = {bus_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
    raw_log = section.get("kernel_log")
    log: dict = raw_log if isinstance(raw_log, dict) else {}
    return FaultReport(
        source=str(section.get("source") or "") or None,
        gpus=gpus,
        error=None if not section.get("error") else str(section["error"])[:300],
        xids=tuple(_xids(log.get("lines") or [], log.get("uptime_s"), by_bus)),
        kernel_log=None if log.get("error") else (str(log.get("source") or "") or None),
        kernel_log_error=None if not log.get("error") else str(log["error"])[:300],
    )


def host_faults_argv() -> list[str]:
    """The fault query on the Proxmox host, answered in remote/host_gpu_faults.sh's text."""
    readers = [word for argv in KERNEL_LOG_COMMANDS for word in ("--", *argv)]
    return shell_argv(
        "host_gpu_faults.sh",
        facts.XID_MARK,
        str(MAX_XID_LINES),
        *facts.fault_query_argv(),
        "--",
        *facts.remap_query_argv(),
        *readers,
    )


def parse_host_answer(text: str) -> FaultReport:
    parts: dict[str, list[str]] = {}
    marks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        word, _, value = line.partition(" ")
        if word in ("@fault", "@remap", "@uptime", "@kernel"):
            current = word if word != "@kernel" else f"@kernel {value}"
            marks[current] = value.split()
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    section: dict = {"source": "nvidia-smi", "kernel_log": _host_kernel_log(parts, marks)}
    for mark, key, error_key, label in (
        ("@fault", "gpu_csv", "error", "nvidia-smi fault query on the Proxmox host: "),
        ("@remap", "remap_csv", "remap_error", ""),
    ):
        rc = (marks.get(mark) or [""])[0]
        out = "\n".join(parts.get(mark, []))
        if rc == "0":
            section[key] = out
        else:
            section[error_key] = label + (_first_line(out, rc) if rc else "no answer")
    return parse(section)


def _host_kernel_log(parts: dict[str, list[str]], marks: dict[str, list[str]]) -> dict:
    tried = []
    for mark, words in marks.items():
        if not mark.startswith("@kernel") or len(words) != 2 or not words[1].isdigit():
            continue
        argv = KERNEL_LOG_COMMANDS[int(words[1])] if int(words[1]) < len(KERNEL_LOG_COMMANDS) else ("?",)
        if words[0] == "0":
            uptime = (marks.get("@uptime") or [""])[0]
            try:
                now: float | None = float(uptime)
            except ValueError:
                now = None
            return {"source": " ".join(argv), "lines": parts[mark], "uptime_s": now}
        tried.append(f"{argv[0]}: {_first_line(chr(10).join(parts[mark]), words[0])}")
    return {"error": "; ".join(tried) or "the Proxmox host gave no kernel log answer"}


def _first_line(out: str, rc: str) -> str:
    return (out.strip().splitlines() or [f"exit code {rc}"])[0][:300]


def _counters(section: dict) -> tuple[GpuFaults, ...]:
    if section.get("source") == "nvml":
        rows = [
            r for r in section.get("gpus") or [] if isinstance(r, dict) and isinstance(r.get("index"), int)
        ]
        return tuple(
            GpuFaults(
                index=r["index"],
                pci_bus_id=r.get("pci_bus_id"),
                ecc_uncorrected=r.get("ecc_uncorrected"),
                retired_pages_pending=_flag(r.get("retired_pending")),
                remapped_rows_uncorrectable=r.get("remap_uncorrectable"),
                remapped_rows_pending=_flag(r.get("remap_pending")),
                remap_failure=_flag(r.get("remap_failure")),
            )
            for r in rows
        )
    remaps = {}
    for line in str(section.get("remap_csv") or "").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and bus_key(fields[0]):
            remaps[bus_key(fields[0])] = fields[1:]
    gpus = []
    for line in str(section.get("gpu_csv") or "").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4 or _int(fields[0]) is None:
            continue
        uncorrectable, pending, failure = remaps.get(bus_key(fields[1]), ("", "", ""))
        gpus.append(
            GpuFaults(
                index=int(fields[0]),
                pci_bus_id=fields[1],
                ecc_uncorrected=_int(fields[2]),
                retired_pages_pending=_flag(fields[3]),
                remapped_rows_uncorrectable=_int(uncorrectable),
                remapped_rows_pending=_flag(pending),
                remap_failure=_flag(failure),
            )
        )
    return tuple(gpus)


def _xids(lines, now, by_bus: dict) -> list[XidEvent]:
    events = []
    for line in lines:
        match = _XID_LINE.match(str(line))
        if not match:
            continue
        stamp, pci, code, text = match.groups()
        age = None if not isinstance(now, (int, float)) else max(0.0, round(now - float(stamp), 1))
        events.append(XidEvent(int(code), pci, by_bus.get(bus_key(pci)), age, (text or "").strip()[:200]))
    return events


def problems(faults: FaultReport, job_gpus) -> tuple[list[str], list[str]]:
    """(critical, warning) reasons about the job's GPUs, each naming the GPU and the error."""
    mine = set(job_gpus)
    critical: list[str] = []
    warning: list[str] = []
    for g in faults.gpus:
        if g.index not in mine:
            continue
        if g.ecc_uncorrected:
            critical.append(
                f"GPU {g.index}: {g.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded"
            )
        if g.remap_failure:
            critical.append(f"GPU {g.index}: a row remapping failed (the GPU needs replacing)")
        if g.remapped_rows_pending:
            warning.append(f"GPU {g.index}: row remapping pending (takes effect at the next GPU reset)")
        if g.retired_pages_pending:
            warning.append(f"GPU {g.index}: page retirement pending (takes effect at the next GPU reset)")
    # an Xid whose GPU cannot be told (no counters to map its PCI address) may be on the job's
    mappable = bool(faults.gpus)
    recent = [
        x
        for x in faults.xids
        if mine
        and (x.gpu in mine or (x.gpu is None and not mappable))
        and (x.age_s is None or x.age_s <= XID_WINDOW_S)
    ]
    for code in sorted({x.code for x in recent}):
        same = [x for x in recent if x.code == code]
        newest = min(same, key=lambda x: x.age_s if x.age_s is not None else float("inf"))
        count = f" ({len(same)} times in the last hour)" if len(same) > 1 else ""
        (critical if code in FATAL_XIDS else warning).append(newest.describe() + count)
    return critical, warning
