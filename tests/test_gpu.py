"""GPU snapshots: CSV parsing, the nvidia-smi simulator's CLI surface, NVML conversion, free-memory
checks and host-pid -> container mapping."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dflash_ops.observe import gpu
from dflash_ops.errors import InputError
from dflash_ops.remote import facts, gpu_read

NVIDIA_SMI = str(Path(__file__).resolve().parent / "sim" / "nvidia-smi")
DRIVER_FAILURE = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                  "Make sure that the latest NVIDIA driver is installed and running.")
UUID0 = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID1 = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def smi(state_file, *args):
    env = dict(os.environ, NVIDIA_SMI_SIM_STATE=str(state_file))
    return subprocess.run([NVIDIA_SMI, *args], capture_output=True, text=True, env=env, timeout=30)


@pytest.fixture
def state_file(tmp_path):
    path = tmp_path / "gpu-state.json"

    def write(state):
        path.write_text(json.dumps(state))
        return path

    write.path = path
    return write


TWO_GPUS = {
    "gpus": [
        {"index": 0, "uuid": UUID0, "name": "NVIDIA H200", "memory_total_mib": 143771, "ghost_memory_mib": 4,
         "utilization_pct": 97},
        {"index": 1, "uuid": UUID1, "name": "NVIDIA H200", "memory_total_mib": 143771},  # util missing
    ],
    "compute_apps": [
        {"pid": 912345, "gpu_uuid": UUID0, "used_memory_mib": 70000, "process_name": "python3"},
    ],
}


# --------------------------------------------------------------------------- parse_nvidia_smi


def test_parse_csv_with_na_fields_blank_lines_and_comma_in_names():
    gpu_csv = ("0, GPU-a, NVIDIA H200, 70004, 143771, 97\n"
               "\n"
               "1, GPU-b, NVIDIA H200, 0, 143771, [N/A]\n"
               "2, GPU-c, Tesla, PG503-216, [N/A], 32768, [Not Supported]\n")
    apps_csv = ("4123, GPU-a, 70000, python3\n"
                "77, GPU-b, [N/A], my, odd, name\n"
                "55, GPU-zz, 10, ignored-unknown-gpu\n")
    snap = gpu.parse_nvidia_smi(gpu_csv, apps_csv)
    assert snap.ok and snap.source == "nvidia-smi"
    g0, g1, g2 = snap.gpus
    assert (g0.index, g0.uuid, g0.memory_used_mib, g0.memory_total_mib, g0.utilization_pct) == (0, "GPU-a", 70004, 143771, 97)
    assert g1.utilization_pct is None
    assert g2.name == "Tesla, PG503-216" and g2.memory_used_mib is None and g2.utilization_pct is None
    assert g0.processes == (gpu.GpuProcess(4123, 0, 70000, "python3"),)
    assert g1.processes == (gpu.GpuProcess(77, 1, None, "my, odd, name"),)
    assert g0.ghost_memory_mib == 4  # 70004 used, 70000 accounted for
    assert g1.ghost_memory_mib == 0


def test_parse_accepts_values_with_units():
    snap = gpu.parse_nvidia_smi("0, GPU-a, NVIDIA H200, 1234 MiB, 143771 MiB, 45 %\n",
                                "9, GPU-a, 1000 MiB, python\n")
    g = snap.gpus[0]
    assert (g.memory_used_mib, g.memory_total_mib, g.utilization_pct) == (1234, 143771, 45)
    assert g.processes[0].used_memory_mib == 1000


def test_parse_apps_without_process_name():
    # `--query-compute-apps=pid,gpu_uuid,used_memory` (three fields) is what the relaunch step asks
    snap = gpu.parse_nvidia_smi("0, GPU-a, NVIDIA H200, 500, 143771, 0\n", "4123, GPU-a, 480\n")
    assert snap.gpus[0].processes == (gpu.GpuProcess(4123, 0, 480, ""),)


def test_parse_driver_failure_text_becomes_no_driver_error():
    snap = gpu.parse_nvidia_smi(DRIVER_FAILURE + "\n\n", "")
    assert not snap.ok and snap.error.startswith("no NVIDIA driver") and snap.gpus == ()
    assert "couldn't communicate" in snap.error


def test_parse_no_gpus_is_empty_not_error():
    snap = gpu.parse_nvidia_smi("", "")
    assert snap.ok and snap.gpus == ()


# --------------------------------------------------------------------------- the simulator


def test_sim_query_gpu_csv_with_header_and_units(state_file):
    result = smi(state_file(TWO_GPUS), "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
                 "--format=csv")
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == [
        "index, uuid, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]",
        f"0, {UUID0}, NVIDIA H200, 70004 MiB, 143771 MiB, 97 %",  # 4 ghost + 70000 of the app
        f"1, {UUID1}, NVIDIA H200, 0 MiB, 143771 MiB, [N/A]",
    ]


def test_sim_noheader_nounits_and_id_selection(state_file):
    result = smi(state_file(TWO_GPUS), "-i", "1", "--query-gpu=index,memory.free,utilization.gpu",
                 "--format=csv,noheader,nounits")
    assert result.returncode == 0
    assert result.stdout == "1, 143771, [N/A]\n"
    result = smi(state_file.path, "--id=1,0", "--query-gpu=index", "--format=csv,noheader")
    assert result.stdout == "1\n0\n"


def test_sim_compute_apps_headers_aliases_and_gpu_filter(state_file):
    state_file(TWO_GPUS)
    result = smi(state_file.path, "--query-compute-apps=pid,gpu_uuid,used_memory,name", "--format=csv")
    assert result.stdout.splitlines() == ["pid, gpu_uuid, used_gpu_memory [MiB], process_name",
                                          f"912345, {UUID0}, 70000 MiB, python3"]
    # the app lives on GPU 0: asking about GPU 1 only lists nothing (not even with noheader)
    result = smi(state_file.path, "-i", "1", "--query-compute-apps=pid", "--format=csv,noheader")
    assert result.returncode == 0 and result.stdout == ""


def test_sim_list_and_summary_table(state_file):
    state_file(TWO_GPUS)
    listing = smi(state_file.path, "-L").stdout.splitlines()
    assert listing == [f"GPU 0: NVIDIA H200 (UUID: {UUID0})", f"GPU 1: NVIDIA H200 (UUID: {UUID1})"]
    table = smi(state_file.path)
    assert table.returncode == 0
    assert "70004MiB / 143771MiB" in table.stdout and "912345" in table.stdout and "Processes:" in table.stdout


def test_sim_invalid_field_unknown_option_and_unknown_gpu(state_file):
    state_file(TWO_GPUS)
    bad = smi(state_file.path, "--query-gpu=index,bogus.field", "--format=csv")
    assert bad.returncode == 2
    assert bad.stdout.strip() == 'Field "bogus.field" is not a valid field to query.'
    assert smi(state_file.path, "--frobnicate").returncode == 2
    assert smi(state_file.path, "--query-gpu=index").returncode == 2  # --format is required
    missing = smi(state_file.path, "-i", "7", "--query-gpu=index", "--format=csv")
    assert missing.returncode == 6 and missing.stdout.strip() == "No devices were found"


@pytest.mark.parametrize("state", [{"driver_error": True}, None])
def test_sim_driver_failure(state_file, tmp_path, state):
    path = state_file(state) if state is not None else tmp_path / "no-such-state.json"
    for args in ([], ["--query-gpu=index", "--format=csv"], ["-L"]):
        result = smi(path, *args)
        assert result.returncode == 9
        assert result.stdout.strip() == DRIVER_FAILURE


def test_sim_frees_memory_when_the_watched_pid_dies_and_keeps_ghost_memory(state_file):
    """LXC: the driver reports a HOST pid (not visible here); the memory drains when the real
    process (watch_pid) exits. Ghost memory stays with no process."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state_file({
            "free_when_pid_dead": True,
            "gpus": [{"index": 0, "uuid": UUID0, "name": "NVIDIA H200", "memory_total_mib": 143771,
                      "ghost_memory_mib": 2048, "utilization_pct": 0}],
            "compute_apps": [{"pid": 4000001, "watch_pid": worker.pid, "gpu_index": 0,
                              "used_memory_mib": 50000, "process_name": "python3"}],
        })
        query, apps = facts.gpu_query_argv()[1:], facts.apps_query_argv()[1:]
        before = gpu.parse_nvidia_smi(smi(state_file.path, *query).stdout, smi(state_file.path, *apps).stdout)
        assert before.gpus[0].memory_used_mib == 52048
        assert [p.pid for p in before.gpus[0].processes] == [4000001]  # the host pid, as LXC shows it
    finally:
        worker.kill()
        worker.wait()
    after = gpu.parse_nvidia_smi(smi(state_file.path, *query).stdout, smi(state_file.path, *apps).stdout)
    assert after.gpus[0].memory_used_mib == 2048
    assert after.gpus[0].processes == ()
    assert after.gpus[0].ghost_memory_mib == 2048


def test_sim_without_free_flag_keeps_dead_pids(state_file):
    state_file({"gpus": [{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 100}],
                "compute_apps": [{"pid": 4000002, "gpu_index": 0, "used_memory_mib": 60}]})
    out = smi(state_file.path, "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout
    assert out == "60\n"


def test_sim_output_parses_back_to_the_state(state_file):
    state_file(TWO_GPUS)
    snap = gpu.parse_nvidia_smi(smi(state_file.path, *facts.gpu_query_argv()[1:]).stdout,
                                smi(state_file.path, *facts.apps_query_argv()[1:]).stdout)
    assert [(g.index, g.uuid, g.memory_used_mib, g.utilization_pct) for g in snap.gpus] == [
        (0, UUID0, 70004, 97), (1, UUID1, 0, None)]
    assert snap.gpus[0].processes == (gpu.GpuProcess(912345, 0, 70000, "python3"),)


# --------------------------------------------------------------------------- NVML


def nvml_snapshot() -> gpu.GpuSnapshot:
    """This machine's GPUs via NVML, as the probe reads them."""
    return gpu.snapshot_from_probe(gpu_read.nvml_query())


def test_nvml_snapshot_without_driver_says_so_and_does_not_raise():
    pytest.importorskip("pynvml")
    snap = nvml_snapshot()
    if snap.ok:  # pragma: no cover - a machine with a real driver
        pytest.skip("this machine has an NVIDIA driver")
    assert snap.error.startswith("no NVIDIA driver") and snap.gpus == ()


def fake_pynvml(monkeypatch):
    """NVML's Python API shape (bytes names in old bindings, NotSupported utilization, pids with
    usedGpuMemory None inside containers) without a driver."""
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetCount = lambda: 2
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 1024 * 1024 * 1000,
                                                                  total=143771 * 1024 * 1024)

    def utilization(h):
        if h == 1:
            raise NVMLError_NotSupported()
        return types.SimpleNamespace(gpu=88)

    mod.nvmlDeviceGetUtilizationRates = utilization
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: (
        [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)] if h == 0 else [])
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def test_nvml_snapshot_converts_the_api(monkeypatch):
    fake_pynvml(monkeypatch)
    snap = nvml_snapshot()
    assert snap.ok and snap.source == "nvml"
    g0, g1 = snap.gpus
    assert (g0.name, g0.uuid, g0.memory_used_mib, g0.memory_total_mib, g0.utilization_pct) == (
        "NVIDIA H200", "GPU-0", 1000, 143771, 88)
    assert g1.memory_used_mib == 2000 and g1.utilization_pct is None
    (proc,) = g0.processes
    assert proc.pid == os.getpid() and proc.used_memory_mib is None
    assert proc.name == Path(f"/proc/{os.getpid()}/comm").read_text().strip()


# --------------------------------------------------------------------------- is it free?


def snapshot(*gpus):
    return gpu.GpuSnapshot(tuple(gpus), "nvidia-smi")


def test_busy_gpus_names_pids_and_ghost_memory():
    held = gpu.Gpu(0, "GPU-a", "H200", 70500, 143771, 90, (gpu.GpuProcess(4123, 0, 70000, "python3"),))
    ghost = gpu.Gpu(1, "GPU-b", "H200", 30000, 143771, 0, ())
    idle = gpu.Gpu(2, "GPU-c", "H200", 4, 143771, 0, ())
    starting = gpu.Gpu(3, "GPU-d", "H200", 300, 143771, 0, (gpu.GpuProcess(5000, 3, None, ""),))
    busy = gpu.busy_gpus(snapshot(held, ghost, idle, starting), [3, 2, 1, 0])
    assert [b.index for b in busy] == [0, 1, 3]
    assert busy[2].describe() == "GPU 3: 300 MiB used by pid 5000"
    assert busy[0].describe() == "GPU 0: 70500 MiB used by pid 4123 (python3) 70000 MiB, 500 MiB ghost memory with no process"
    assert busy[1].describe() == "GPU 1: 30000 MiB used by 30000 MiB ghost memory with no process"
    assert busy[1].ghost_mib == 30000 and busy[1].processes == ()


def test_busy_gpus_min_free_threshold():
    half = gpu.Gpu(0, "GPU-a", "H200", 60000, 143771, 0, ())
    assert gpu.busy_gpus(snapshot(half), [0], min_free_mib=80000) == []  # 83771 free
    assert [b.index for b in gpu.busy_gpus(snapshot(half), [0], min_free_mib=90000)] == [0]


def test_busy_gpus_refuses_unknown_indices_and_missing_data():
    with pytest.raises(InputError, match="target_gpus/drafter_gpus"):
        gpu.busy_gpus(snapshot(gpu.Gpu(0, "GPU-a", "H200", 0, 1, 0)), [0, 5])
    with pytest.raises(gpu.GpuUnavailable, match="no NVIDIA driver"):
        gpu.busy_gpus(gpu.GpuSnapshot((), "nvidia-smi", "no NVIDIA driver (x)"), [0])
    assert gpu.busy_gpus(gpu.GpuSnapshot((), None, "no NVIDIA driver"), []) == []  # a CPU job


# --------------------------------------------------------------------------- host pid -> container


@pytest.mark.parametrize("text, ctid", [
    ("0::/lxc/200/ns/user.slice/user-0.slice/session-3.scope\n", "200"),
    ("0::/lxc/200/ns/init.scope\n", "200"),
    ("12:memory:/lxc/201/ns\n11:cpu,cpuacct:/lxc/201/ns\n", "201"),
    ("0::/lxc.payload.205/system.slice/foo.service\n", "205"),
    ("0::/lxc.monitor/200\n", None),  # the monitor runs on the host, outside the container
    ("0::/user.slice/user-0.slice/session-1.scope\n", None),
    ("0::/system.slice/pve-container@200.service\n", None),
    ("", None),
])
def test_container_of_pid(text, ctid):
    assert gpu.container_of_pid(text) == ctid


def test_nspid_from_status():
    status = "Name:\tpython3\nTgid:\t912345\nPid:\t912345\nNSpid:\t912345\t4242\nPPid:\t1\n"
    assert gpu.nspid_from_status(status) == 4242
    assert gpu.nspid_from_status("Name:\tx\nNSpid:\t77\n") == 77
    assert gpu.nspid_from_status("Name:\tx\n") is None
    # the last NSpid field is the pid in the reader's own namespace, which is what getpid() returns
    assert gpu.nspid_from_status(Path("/proc/self/status").read_text()) == os.getpid()


def test_host_query_maps_pids_into_the_container_and_labels_the_rest():
    from dflash_ops.observe.gpu import parse_host_gpu_query

    out = ("0, GPU-a, NVIDIA H200, 30000, 143771, 90\n1, GPU-b, NVIDIA H200, 5000, 143771, 10\n@@\n"
           "4321, GPU-a, 20000, python3\n999, GPU-b, 5000, python3\n555, GPU-a, 100, Xorg\n777, GPU-b, 10, gone\n@@\n"
           "@pid 4321\n0::/lxc/200/ns/init.scope\nNSpid:\t4321\t17\n"
           "@pid 999\n0::/lxc/201/ns\nNSpid:\t999\t40\n"
           "@pid 555\n0::/user.slice/session-1.scope\nNSpid:\t555\n"
           "@pid 777\n")
    snap = parse_host_gpu_query(out, 200)
    seen = {(p.gpu_index, p.pid, p.owner, p.name) for g in snap.gpus for p in g.processes}
    assert seen == {(0, 17, "", "python3"), (0, 555, "host", "Xorg"), (1, 999, "ct 201", "python3"),
                    (1, 777, "gone", "gone")}
    assert snap.error is None and snap.source == "nvidia-smi on the Proxmox host"


def test_host_query_driver_failure_is_an_error_not_a_crash():
    from dflash_ops.observe.gpu import parse_host_gpu_query

    snap = parse_host_gpu_query("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 200)
    assert snap.gpus == () or not snap.gpus
    assert snap.error


def test_host_query_answers_when_an_app_ends_before_its_proc_read(tmp_path):
    """An app that exits between nvidia-smi's answer and the /proc read is reported as gone; the
    query itself still succeeds."""
    from dflash_ops.transport.local import LocalTransport

    gone = 4194303  # above any pid_max in use: never a live process
    state = tmp_path / "gpu-state.json"
    state.write_text(json.dumps({
        "gpus": [{"index": 0, "uuid": UUID0, "name": "NVIDIA H200", "memory_total_mib": 143771}],
        "compute_apps": [{"pid": os.getpid(), "gpu_uuid": UUID0, "used_memory_mib": 100, "process_name": "py"},
                         {"pid": gone, "gpu_uuid": UUID0, "used_memory_mib": 100, "process_name": "x"}]}))
    env = {"PATH": f"{Path(NVIDIA_SMI).parent}{os.pathsep}{os.environ['PATH']}", "NVIDIA_SMI_SIM_STATE": str(state)}
    script = "".join(f"export {k}={v!r}; " for k, v in env.items()) + gpu.HOST_GPU_QUERY
    with LocalTransport("local") as t:
        result = t.run(script, timeout=30)
    assert result.ok, result
    owners = {p.pid: p.owner for p in gpu.parse_host_gpu_query(result.stdout, 200).gpus[0].processes}
    assert owners == {os.getpid(): "host", gone: "gone"}
