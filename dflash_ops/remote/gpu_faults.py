"""GPU faults as the target sees them (ECC, page retirement, row remapping, kernel-log Xids), as raw
answers: dflash_ops.observe.gpu_faults is the one parser. An unreadable kernel log is reported."""

from __future__ import annotations

import time

from dflash_ops.remote import facts
from dflash_ops.remote.bounded import finish, in_thread, start
from dflash_ops.remote.gpu_read import nvml_answer, nvml_text

MAX_XID_LINES = 200  # the newest ones; a flapping GPU can log thousands
KERNEL_LOG_COMMANDS = (("dmesg",), ("journalctl", "-k", "-b", "-o", "short-monotonic", "--no-pager", "-q"))


def nvml_faults():
    """Per GPU: uncorrected ECC, pending retirements, remapped rows (None: unsupported); never raises."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml, or no driver
        return None
    return nvml_answer(pynvml, _nvml_gpus, "NVML fault query")


def _nvml_gpus(pynvml):
    return {"source": "nvml", "gpus": [_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]}


def _nvml_gpu(pynvml, index):
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    remapped = _call(pynvml.nvmlDeviceGetRemappedRows, handle)  # (corr., uncorr., pending, failure)
    ecc = _call(
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    pci = _call(pynvml.nvmlDeviceGetPciInfo, handle)
    pending = _call(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    return {
        "index": index,
        "pci_bus_id": None if pci is None else nvml_text(pci.busId),
        "ecc_uncorrected": None if ecc is None else int(ecc),
        "retired_pending": None if pending is None else int(pending),
        "remap_uncorrectable": None if remapped is None else int(remapped[1]),
        "remap_pending": None if remapped is None else int(remapped[2]),
        "remap_failure": None if remapped is None else int(remapped[3]),
    }


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: the GPU cannot say
        return None


def start_faults(source, deadline):
    """NVML answers in-process, else both nvidia-smi queries start now; the kernel log reader starts too."""
    nvml = in_thread(nvml_faults, deadline) if source in ("auto", "nvml") else None
    smi = None if nvml is not None else (start(facts.fault_query_argv()), start(facts.remap_query_argv()))
    return nvml, smi, start(list(KERNEL_LOG_COMMANDS[0]))


def finish_faults(started, deadline):
    nvml, smi, kernel = started
    if nvml is not None:
        result = dict(nvml)
    else:
        rc, out, err = finish(smi[0], deadline)
        rc2, remap, err2 = finish(smi[1], deadline)
        result = {
            "source": "nvidia-smi",
            "gpu_csv": out if rc == 0 else "",
            "remap_csv": remap if rc2 == 0 else "",
        }
        if rc != 0:
            result["error"] = "nvidia-smi fault query: %s" % _first(out, err, rc)
        if rc2 != 0:  # pre-Ampere GPUs and older drivers have no row remapper: not an error of ours
            result["remap_error"] = _first(remap, err2, rc2)
    result["kernel_log"] = _xid_lines(kernel, deadline)
    return result


def _first(out, err, rc):
    return ((out.strip() or err.strip() or "exit code %d" % rc).splitlines() or [""])[0][:300]


def _xid_lines(started, deadline):
    """The newest Xid lines with their printk clock (CLOCK_MONOTONIC, shared with the host, unlike lxcfs
    uptime), or why no reader could read the kernel log."""
    tried = []
    for position, argv in enumerate(KERNEL_LOG_COMMANDS):
        rc, out, err = finish(started if position == 0 else start(list(argv)), deadline)
        if rc == 0 and not out.strip():  # a kernel log always has boot messages: this one is not readable
            rc, err = 1, "no kernel messages readable"
        if rc == 0:
            lines = [line for line in out.splitlines() if facts.XID_MARK in line]
            return {"source": " ".join(argv), "lines": lines[-MAX_XID_LINES:], "uptime_s": time.monotonic()}
        tried.append("%s: %s" % (argv[0], _first("", err or out, rc)))
    return {"error": "; ".join(tried)}
