"""The Prometheus text format (0.0.4) for checked targets: each family defined here once, labelled
`target`, `job` and `node`. Unknown values are left out, never NaN, so `absent` alerts stay true."""

from __future__ import annotations

import dataclasses
import math

from dflash_ops.job import jobpaths
from dflash_ops.job.relaunch_guard import RelaunchGuard
from dflash_ops.observe import health, job_phase

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    help: str
    type: str = "gauge"  # or "counter"


FAMILIES = {
    f.name: f
    for f in (
        Family("dflash_up", "1 when the target answered the probe, 0 when it could not be checked."),
        Family("dflash_state", "1 for the job's state (running, stopped, finished, down, unknown)."),
        Family(
            "dflash_health_status",
            "The health verdict as its Nagios exit code: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.",
        ),
        Family("dflash_step", "The last training step the metrics file recorded."),
        Family("dflash_total_steps", "The run's planned number of steps."),
        Family("dflash_loss", "Training loss at the last step."),
        Family("dflash_tokens_per_second", "Training throughput at the last step, tokens per second."),
        Family("dflash_eta_seconds", "Estimated seconds until the run's last step."),
        Family(
            "dflash_last_step_age_seconds",
            "Seconds since the last step when the file was written (before the first step: since start).",
        ),
        Family(
            "dflash_last_step_timestamp_seconds",
            "Unix time of the last step (target clock); time() minus this is the age at query time.",
        ),
        Family("dflash_tau", "Acceptance length tau of the latest evaluation, pooled over rounds."),
        Family(
            "dflash_tau_expected",
            "Acceptance length tau that training accuracy predicts, 1 + sum_k prod_{j<=k} acc_j.",
        ),
        Family(
            "dflash_relaunches_total",
            "Launches of the job: the number of its current train-NNNN.log (each relaunch writes the next).",
            "counter",
        ),
        Family(
            "dflash_auto_relaunches_last_hour",
            "Relaunches by health --auto-relaunch in the last hour (its budget: max_relaunches_per_hour).",
        ),
        Family("dflash_probe_duration_seconds", "Seconds the probe's round trip took."),
        Family("dflash_gpu_info", "1 per GPU, with its name, uuid and role in the job."),
        Family("dflash_gpu_utilization_ratio", "GPU utilization, 0 to 1."),
        Family("dflash_gpu_memory_total_bytes", "GPU memory, total."),
        Family(
            "dflash_gpu_memory_used_bytes",
            "GPU memory in use by owner: job, foreign (another owner on a job GPU), unknown (cannot be "
            "told, e.g. a host pid inside LXC), other (on a GPU the job does not use), unattributed "
            "(no process accounts for it).",
        ),
        Family(
            "dflash_gpu_ecc_uncorrected_errors",
            "Uncorrected ECC errors since the driver loaded (volatile count).",
        ),
        Family("dflash_gpu_retired_pages_pending", "1 when pages wait to be retired at the next reset."),
        Family("dflash_gpu_remapped_rows_uncorrectable", "Rows remapped for uncorrectable errors."),
        Family("dflash_gpu_remapped_rows_pending", "1 when a row remap waits for the next GPU reset."),
        Family("dflash_gpu_remap_failure", "1 when a row remapping has failed on this GPU."),
        Family(
            "dflash_gpu_xid_events",
            "Xid events per GPU and code in the readable kernel log (since boot, as far as it reaches).",
        ),
        Family("dflash_gpu_xid_last_age_seconds", "Seconds since the newest Xid event of this GPU and code."),
        Family("dflash_kernel_log_readable", "1 when the kernel log (Xid events) could be read."),
    )
}


def escape_label(value: str) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


class Exposition:
    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[dict, float]]] = {name: [] for name in FAMILIES}

    def add(self, name: str, labels: dict, value) -> None:
        if value is None or isinstance(value, str):
            return
        self.samples[name].append((labels, float(value)))

    def text(self) -> str:
        out = []
        for name, family in FAMILIES.items():
            if not self.samples[name]:
                continue
            out.append(f"# HELP {name} {_escape_help(family.help)}")
            out.append(f"# TYPE {name} {family.type}")
            for labels, value in self.samples[name]:
                pairs = ",".join(f'{key}="{escape_label(str(val))}"' for key, val in labels.items())
                out.append(f"{name}{{{pairs}}} {_number(value)}")
        return "\n".join(out) + "\n" if out else ""


def render(checked) -> str:
    exposition = Exposition()
    for c in checked:
        add_target(exposition, c)
    return exposition.text()


def add_target(out: Exposition, checked) -> None:
    status, target = checked.status, checked.target
    base = {"target": target.name, "job": jobpaths.marker_value(target.job), "node": status.hostname or ""}
    out.add("dflash_up", base, 1 if status.probed else 0)
    now = job_phase.phase(status)
    for phase in job_phase.PHASES:
        out.add("dflash_state", {**base, "state": phase}, 1 if phase == now else 0)
    out.add("dflash_health_status", base, health.EXIT_CODES[checked.verdict.level])
    auto = RelaunchGuard(target.name, target.job.health.max_relaunches_per_hour).recent()
    out.add("dflash_auto_relaunches_last_hour", base, len(auto))
    if not status.probed:
        return
    training = status.training
    out.add("dflash_step", base, training.step)
    out.add("dflash_total_steps", base, training.total_steps)
    out.add("dflash_loss", base, training.loss)
    out.add("dflash_tokens_per_second", base, training.tokens_per_s)
    out.add("dflash_eta_seconds", base, training.eta_s)
    age = training.last_update_age_s
    out.add("dflash_last_step_age_seconds", base, age)
    if age is not None and status.time is not None:
        out.add("dflash_last_step_timestamp_seconds", base, round(status.time - age, 3))
    if status.eval is not None:
        out.add("dflash_tau", base, status.eval.tau)
        out.add("dflash_tau_expected", base, status.eval.expected_tau)
    out.add("dflash_relaunches_total", base, job_phase.launch_number(status))
    out.add("dflash_probe_duration_seconds", base, status.probe_seconds)
    for gpu in status.gpus:
        _add_gpu(out, base, gpu)
    if checked.report is not None:
        _add_faults(out, base, checked.report.gpu_faults)


def _add_gpu(out: Exposition, base: dict, gpu) -> None:
    labels = {**base, "gpu": str(gpu.index)}
    out.add("dflash_gpu_info", {**labels, "name": gpu.name, "uuid": gpu.uuid, "role": gpu.role or "none"}, 1)
    if gpu.utilization_pct is not None:
        out.add("dflash_gpu_utilization_ratio", labels, gpu.utilization_pct / 100)
    if gpu.memory_total_mib is not None:
        out.add("dflash_gpu_memory_total_bytes", labels, gpu.memory_total_mib * MIB)
    used = {"job": 0, "foreign": 0, "unknown": 0, "other": 0, "unattributed": gpu.ghost_memory_mib or 0}
    for p in gpu.processes:
        owner = "other" if gpu.role is None else {True: "foreign", False: "job", None: "unknown"}[p.foreign]
        used[owner] += p.used_memory_mib or 0
    if gpu.memory_used_mib is not None:
        for owner, mib in used.items():
            out.add("dflash_gpu_memory_used_bytes", {**labels, "owner": owner}, mib * MIB)


def _add_faults(out: Exposition, base: dict, faults) -> None:
    for g in faults.gpus:
        labels = {**base, "gpu": str(g.index)}
        out.add("dflash_gpu_ecc_uncorrected_errors", labels, g.ecc_uncorrected)
        out.add("dflash_gpu_retired_pages_pending", labels, g.retired_pages_pending)
        out.add("dflash_gpu_remapped_rows_uncorrectable", labels, g.remapped_rows_uncorrectable)
        out.add("dflash_gpu_remapped_rows_pending", labels, g.remapped_rows_pending)
        out.add("dflash_gpu_remap_failure", labels, g.remap_failure)
    if faults.kernel_log is None and faults.kernel_log_error is None:
        return  # not queried (the GPUs are asked on the Proxmox host)
    out.add("dflash_kernel_log_readable", base, 1 if faults.kernel_log else 0)
    seen: dict[tuple[str, int], list] = {}
    for x in faults.xids:
        gpu = str(x.gpu) if x.gpu is not None else f"pci:{x.pci}"
        seen.setdefault((gpu, x.code), []).append(x)
    for (gpu, code), events in sorted(seen.items()):
        labels = {**base, "gpu": gpu, "xid": str(code)}
        out.add("dflash_gpu_xid_events", labels, len(events))
        ages = [x.age_s for x in events if x.age_s is not None]
        out.add("dflash_gpu_xid_last_age_seconds", labels, min(ages) if ages else None)
