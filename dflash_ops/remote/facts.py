"""Facts the local side and the remote scripts share, defined once (stdlib only; bundle() sends it)."""

import re

# nvidia-smi queries, in the order their CSV columns are parsed (dflash_ops.observe.gpu.parse_nvidia_smi)
GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory", "process_name")
CSV_FORMAT = "--format=csv,noheader,nounits"

# The launcher numbers each run's log: <log_dir>/train-NNNN.log (at least four digits)
LOG_PREFIX = "train-"
LOG_SUFFIX = ".log"
LOG_NAME = re.compile(r"^" + re.escape(LOG_PREFIX) + r"(\d{4,})" + re.escape(LOG_SUFFIX) + r"$")

# The job state file (dflash_ops.job.jobstate) is a few hundred bytes: a reader takes no more than this
STATE_MAX_BYTES = 64 * 1024
# The state names the job it records under this key (the value of its processes' marker); a state
# written by an earlier version names none, and its job runs under the earlier identity.
STATE_JOB_KEY = "job"
STATE_NOT_A_FILE = "not a regular file"  # what a reader says of a directory (or socket …) in its place


def newest_log_name(names):
    numbered = [(int(m.group(1)), name) for name in names for m in [LOG_NAME.match(name)] if m]
    return max(numbered)[1] if numbered else None


def gpu_query_argv(fields=GPU_FIELDS):
    return ["nvidia-smi", "--query-gpu=" + ",".join(fields), CSV_FORMAT]


def apps_query_argv(fields=APP_FIELDS):
    return ["nvidia-smi", "--query-compute-apps=" + ",".join(fields), CSV_FORMAT]


# GPU faults (dflash_ops.observe.gpu_faults parses these): ECC and page retirement from --query-gpu, row
# remapping from --query-remapped-rows (nvidia-smi --help-query-remapped-rows; Ampere and newer),
# rows matched by PCI bus id. Unsupported fields print [N/A] and read as absent.
FAULT_GPU_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending")
REMAP_FIELDS = ("gpu_bus_id", "remapped_rows.uncorrectable", "remapped_rows.pending", "remapped_rows.failure")
# The kernel's line for an Xid event: `NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off the bus.`
XID_MARK = "NVRM: Xid"


def fault_query_argv():
    return gpu_query_argv(FAULT_GPU_FIELDS)


def remap_query_argv():
    return ["nvidia-smi", "--query-remapped-rows=" + ",".join(REMAP_FIELDS), CSV_FORMAT]
