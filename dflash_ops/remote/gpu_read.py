"""The GPUs and their compute processes via NVML or nvidia-smi's CSV (parsed by dflash_ops.observe.gpu)."""

from __future__ import annotations

import contextlib

from dflash_ops.remote import facts, procs
from dflash_ops.remote.bounded import finish, in_thread, out_of_time, start

MIB = 1024 * 1024


def nvml_text(value):
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def nvml_query():
    """GPUs and compute processes through NVML; never raises."""
    try:
        import pynvml
    except ImportError:
        return {"source": "nvml", "error": "pynvml is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / anything else
        name = type(e).__name__
        if name in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"):
            return {"source": "nvml", "error": "no NVIDIA driver (%s: %s)" % (name, e)}
        return {"source": "nvml", "error": "NVML failed: %s: %s" % (name, e)}
    return nvml_answer(pynvml, _nvml_read, "NVML query")


def nvml_answer(pynvml, read, what):
    """read(pynvml), or `WHAT failed: …`; NVML is shut down after, whatever happened."""
    try:
        return read(pynvml)
    except Exception as e:
        return {"source": "nvml", "error": "%s failed: %s: %s" % (what, type(e).__name__, e)}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_read(pynvml):
    gpus, processes = [], []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError:  # not supported (MIG, some vGPUs)
            utilization = None
        uuid = nvml_text(pynvml.nvmlDeviceGetUUID(handle))
        gpus.append(
            {
                "index": index,
                "uuid": uuid,
                "name": nvml_text(pynvml.nvmlDeviceGetName(handle)),
                "memory_used_mib": int(memory.used // MIB),
                "memory_total_mib": int(memory.total // MIB),
                "utilization_pct": utilization,
            }
        )
        try:
            running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError:
            running = []
        for proc in running:
            used = getattr(proc, "usedGpuMemory", None)
            processes.append(
                {
                    "pid": int(proc.pid),
                    "gpu_index": index,
                    "used_memory_mib": None if used is None else int(used // MIB),
                    "name": procs.comm(int(proc.pid)),
                }
            )
    return {"source": "nvml", "error": None, "gpus": gpus, "processes": processes}


def finish_nvidia_smi(started, deadline, part_s):
    """Raw CSV from nvidia-smi (parsed by dflash_ops.observe.gpu, so there is one parser)."""
    rc, out, err = finish(started[0], deadline)
    rc2, apps, err2 = finish(started[1], deadline)
    if 124 in (rc, rc2):
        return dict(out_of_time("nvidia-smi", part_s), source="nvidia-smi")
    if rc != 0:
        message = (out.strip() or err.strip() or "exit code %d" % rc).splitlines()[0]
        if rc in (9, 127) or "couldn't communicate with the NVIDIA driver" in message:
            message = "no NVIDIA driver (%s)" % message
        return {"source": "nvidia-smi", "error": message}
    result = {"source": "nvidia-smi", "error": None, "gpu_csv": out, "apps_csv": apps if rc2 == 0 else ""}
    if rc2 != 0:
        result["apps_error"] = (apps.strip() or err2.strip() or "exit code %d" % rc2).splitlines()[0]
    return result


def start_gpu_state(source, deadline, part_s):
    """NVML answers in-process; nvidia-smi (when chosen, or when NVML fails) is started."""
    nvml = None
    if source in ("auto", "nvml"):
        nvml = in_thread(nvml_query, deadline) or dict(out_of_time("NVML", part_s), source="nvml")
    if source == "nvml" or (nvml is not None and (not nvml.get("error") or nvml.get("out_of_time"))):
        return nvml, None
    return nvml, (start(facts.gpu_query_argv()), start(facts.apps_query_argv()))


def finish_gpu_state(started, deadline, part_s):
    nvml, smi_started = started
    if smi_started is None:
        return nvml
    smi = finish_nvidia_smi(smi_started, deadline, part_s)
    if smi.get("error") and nvml is not None:
        smi["nvml_error"] = nvml["error"]
    return smi
