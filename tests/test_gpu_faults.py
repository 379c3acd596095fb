"""GPU faults in health and metrics: ECC / page retirement / row remapping from nvidia-smi (the
simulator in tests/sim learns the fields) and Xid events from the kernel log (tests/sim/dmesg), read
by the real probe over a real sshd, next to a live stand-in job on the GPUs."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.observe import gpu_faults
from dflash_ops.job.model import Health
from dflash_ops.observe import prometheus
from dflash_ops.remote import facts

try:
    from tests.test_metrics import samples, value
    from tests.test_ops_e2e import cleanup, quick, standin  # noqa: F401 (cleanup: a fixture)
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_metrics import samples, value
    from test_ops_e2e import cleanup, quick, standin  # noqa: F401


def xid_79(seconds_ago: float) -> str:
    """A kernel log line stamped `seconds_ago` on the kernel's clock (CLOCK_MONOTONIC, as printk)."""
    stamp = time.monotonic() - seconds_ago
    return (
        f"[{stamp:12.6f}] NVRM: Xid (PCI:0000:19:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    )


def test_parse_reads_na_as_absent_and_maps_xids_to_gpus():
    section = {
        "source": "nvidia-smi",
        "gpu_csv": "0, 00000000:18:00.0, [N/A], [N/A]\n1, 00000000:19:00.0, 2, Yes\n",
        "remap_csv": "00000000:19:00.0, 1, Yes, No\n",
        "kernel_log": {
            "source": "journalctl -k",
            "uptime_s": 10000.0,
            "lines": [
                "[ 9990.5] host kernel: NVRM: Xid (PCI:0000:19:00): 13, pid=7, Graphics Exception",
                "[ 1000.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.",
                "[ 9999.0] NVRM: Xid (PCI:0000:af:00): 48, an unknown GPU",
                "not an xid line",
            ],
        },
    }
    faults = gpu_faults.parse(section)
    zero, one = faults.gpus
    assert (zero.ecc_uncorrected, zero.retired_pages_pending, zero.remapped_rows_pending) == (
        None,
        None,
        None,
    )
    assert (one.ecc_uncorrected, one.retired_pages_pending, one.remapped_rows_uncorrectable) == (2, True, 1)
    assert (one.remapped_rows_pending, one.remap_failure) == (True, False)
    assert [(x.code, x.gpu, x.age_s) for x in faults.xids] == [(13, 1, 9.5), (79, 0, 9000.0), (48, None, 1.0)]
    assert faults.kernel_log == "journalctl -k"
    critical, warning = gpu_faults.problems(faults, [0, 1])
    assert critical == ["GPU 1: 2 uncorrected ECC error(s) since the driver loaded"]  # Xid 79 is 2.5 h old
    assert warning == [
        "GPU 1: row remapping pending (takes effect at the next GPU reset)",
        "GPU 1: page retirement pending (takes effect at the next GPU reset)",
        "Xid 13 on GPU 1 (10 s ago): pid=7, Graphics Exception",
    ]
    assert gpu_faults.problems(faults, [0]) == ([], [])  # GPU 1's faults are not this job's
    assert gpu_faults.problems(gpu_faults.parse(None), [0]) == ([], [])


def _machine(path, **extra):
    gpus = [
        {
            "index": 0,
            "utilization_pct": 90,
            "ecc_uncorrected": 0,
            "retired_pages_pending": False,
            "remapped_rows": {"uncorrectable": 0, "pending": False, "failure": False},
        },
        {
            "index": 1,
            "utilization_pct": 80,
            "ecc_uncorrected": 3,
            "retired_pages_pending": False,
            "remapped_rows": {"uncorrectable": 2, "pending": True, "failure": False},
        },
        {"index": 2},
    ]  # an older GPU: every fault field [N/A]
    state = {"free_when_pid_dead": True, "gpus": gpus, "compute_apps": [], **extra}
    path.write_text(json.dumps(state))


def _add_app(path, app):
    state = json.loads(path.read_text())
    state["compute_apps"].append(app)
    path.write_text(json.dumps(state))


def test_health_and_metrics_name_the_faulty_gpu(ssh_target, gpu_state_path, cleanup, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    _machine(gpu_state_path, kernel_log=["[    1.000000] Linux version 6.1", xid_79(60)])
    target = standin(ssh_target, gpus=((0,), (1,)), health=Health(stall_seconds=60))
    cleanup(target)
    other = subprocess.Popen(["sleep", "300"])  # someone else's process on the job's GPU 0
    try:
        assert commands.relaunch(target, **quick()).ok
        _add_app(
            gpu_state_path,
            {"pid": other.pid, "gpu_index": 0, "used_memory_mib": 1000, "process_name": "sleep"},
        )
        checked = check_lib.check(target)
        assert checked.verdict.level == "CRITICAL", checked.verdict
        reasons = checked.verdict.reasons
        assert "GPU 1: 3 uncorrected ECC error(s) since the driver loaded" in reasons
        assert "GPU 1: row remapping pending (takes effect at the next GPU reset)" in reasons
        assert any(
            re.fullmatch(
                r"Xid 79 on GPU 1 \(6\d s ago\): pid=1234, name=python3, GPU has fallen off the bus\.", r
            )
            for r in reasons
        ), reasons
        assert not any(r.startswith("GPU 0:") or r.startswith("GPU 2:") for r in reasons), reasons
        assert checked.report.gpu_faults.kernel_log == "dmesg"

        found = samples(prometheus.render([checked]))
        base = {"target": target.name}
        assert value(found, "dflash_gpu_ecc_uncorrected_errors", gpu="1", **base) == 3
        assert value(found, "dflash_gpu_ecc_uncorrected_errors", gpu="0", **base) == 0
        assert value(found, "dflash_gpu_remapped_rows_pending", gpu="1", **base) == 1
        assert value(found, "dflash_gpu_remapped_rows_uncorrectable", gpu="1", **base) == 2
        faults = (
            "dflash_gpu_ecc_uncorrected_errors",
            "dflash_gpu_retired_pages_pending",
            "dflash_gpu_remapped_rows_uncorrectable",
            "dflash_gpu_remapped_rows_pending",
            "dflash_gpu_remap_failure",
        )
        assert all(any(k[0] == f and ("gpu", "0") in k[1] for k in found) for f in faults)
        assert not [k for k in found if k[0] in faults and ("gpu", "2") in k[1]]  # [N/A]: absent, not 0
        assert value(found, "dflash_gpu_xid_events", gpu="1", xid="79", **base) == 1
        assert value(found, "dflash_kernel_log_readable", **base) == 1
        assert value(found, "dflash_health_status", **base) == 2
        mib = 1024 * 1024
        assert value(found, "dflash_gpu_memory_used_bytes", gpu="1", owner="job", **base) == 20000 * mib
        assert value(found, "dflash_gpu_memory_used_bytes", gpu="0", owner="foreign", **base) == 1000 * mib
        assert value(found, "dflash_gpu_utilization_ratio", gpu="0", **base) == 0.9
        assert value(found, "dflash_gpu_info", gpu="0", role="target", **base) == 1

        # a kernel log that cannot be read (an unprivileged container) is said, never taken for "no Xid"
        state = json.loads(gpu_state_path.read_text())
        state.update(kernel_log_denied=True, gpus=state["gpus"][:1] + [{"index": 1, "utilization_pct": 80}])
        gpu_state_path.write_text(json.dumps(state))
        denied = check_lib.check(target)
        assert denied.report.gpu_faults.kernel_log_error.startswith(
            "dmesg: dmesg: read kernel buffer failed: Operation not permitted; journalctl: "
        )
        assert not any("Xid" in r or "GPU 1:" in r for r in denied.verdict.reasons), denied.verdict
        assert (
            value(samples(prometheus.render([denied])), "dflash_kernel_log_readable", target=target.name) == 0
        )
    finally:
        other.kill()
        other.wait()
        gpu_state_path.unlink(missing_ok=True)


def _host_answer(*groups: list[str]) -> str:
    """host_gpu_faults.sh run for real over stand-in commands, one argv per group."""
    words = [word for group in groups for word in ("--", *group)][1:]
    argv = gpu_faults.host_faults_argv()[:4] + [facts.XID_MARK, "2", *words]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


def test_the_proxmox_hosts_answer_names_each_failure_and_keeps_the_newest_xids():
    sh = ["sh", "-c"]
    xid = "[ {}.0] NVRM: Xid (PCI:0000:18:00): {}, pid=1, it's a \"quoted\" $(fault)"
    log = "\n".join(["[ 1.0] Linux", xid.format(10, 13), xid.format(20, 31), xid.format(30, 79)])
    answer = gpu_faults.parse_host_answer(_host_answer(
        [*sh, "echo '0, 00000000:18:00.0, 4, Yes'"],
        [*sh, "echo 'Not supported on this GPU'; exit 3"],
        [*sh, "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1"],
        [*sh, f"printf '%s\\n' {shlex.quote(log)}"],
    ))
    assert answer.error is None and answer.source == "nvidia-smi"
    assert [(g.index, g.ecc_uncorrected, g.retired_pages_pending, g.remapped_rows_pending) for g in answer.gpus] == [
        (0, 4, True, None)]
    assert answer.kernel_log_error is None and answer.kernel_log == "journalctl -k -b -o short-monotonic --no-pager -q"
    assert [(x.code, x.gpu, x.text) for x in answer.xids] == [
        (31, 0, 'pid=1, it\'s a "quoted" $(fault)'), (79, 0, 'pid=1, it\'s a "quoted" $(fault)')]
    failed = gpu_faults.parse_host_answer(_host_answer(
        [*sh, "echo 'NVIDIA-SMI has failed because it couldn'\\''t communicate with the driver'; exit 9"],
        ["true"], [*sh, "echo denied >&2; exit 1"], ["true"]))  # the second reader answers nothing
    assert failed.gpus == () and failed.error == (
        "nvidia-smi fault query on the Proxmox host: NVIDIA-SMI has failed because it couldn't communicate with the driver")
    assert failed.kernel_log is None and failed.kernel_log_error == "dmesg: denied; journalctl: no kernel messages readable"
    assert gpu_faults.parse_host_answer("").error == "nvidia-smi fault query on the Proxmox host: no answer"


def test_a_host_fault_query_out_of_time_or_without_a_temp_file_says_so():
    from dflash_ops.observe.probe import _host_faults
    assert _host_faults("124 ", 2.0).error == "the fault query on the Proxmox host gave no answer within 2.0 s"
    assert _host_faults("- -", None).error == "no temporary file on the Proxmox host for the fault query"
    assert _host_faults("0 %%%", None).error.startswith("unreadable fault answer from the Proxmox host")
