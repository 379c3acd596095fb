"""`health --on-change CMD` through the real CLI: the hook runs once per change of a job's verdict
(never on a repeat), with what changed in its environment; a hook that hangs never holds health past
its budget nor changes its verdict."""

from __future__ import annotations

import json
import os
import time

from dflash_ops import commands
from dflash_ops.job import jobpaths
from dflash_ops.job.model import Health

try:
    from tests.test_metrics import dflash_ops, inventory_file
    from tests.test_ops_e2e import cleanup, quick, standin  # noqa: F401 (cleanup: a fixture)
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_metrics import dflash_ops, inventory_file
    from test_ops_e2e import cleanup, quick, standin  # noqa: F401

RECORD = (
    "python3 -c 'import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    'if k.startswith("DFLASH_")}))\' >> "$CALLS"'
)


def calls(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_hook_runs_once_per_change_with_what_changed(local_target, cleanup, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(state))
    target = standin(local_target, health=Health(stall_seconds=60))
    cleanup(target)
    inventory = inventory_file(tmp_path, target)
    log = tmp_path / "calls.jsonl"
    env = {"CALLS": str(log), "DFLASH_OPS_STATE_DIR": str(state)}

    def health():
        done = dflash_ops(inventory, "health", "-t", target.name, "--on-change", RECORD, env=env)
        assert done.stderr == "", done.stderr
        return done

    first = health()  # never launched: CRITICAL, and the first sight of a job that is not OK is news
    assert first.returncode == 2 and first.stdout.startswith("DFLASH CRITICAL: local: no job launched here yet")
    assert len(calls(log)) == 1
    health()  # the same verdict again: no call
    assert len(calls(log)) == 1
    assert commands.relaunch(target, **quick()).ok
    assert health().returncode == 0
    health()
    assert commands.stop(target).ok
    health()
    health()
    assert commands.relaunch(target, **quick()).ok
    health()
    seen = [
        (c["DFLASH_EVENT"], c["DFLASH_OLD_STATE"], c["DFLASH_NEW_STATE"], c["DFLASH_NEW_LAUNCH"])
        for c in calls(log)
    ]
    assert seen == [
        ("changed", "none", "CRITICAL", ""),
        ("changed", "CRITICAL", "OK", "1"),
        ("changed", "OK", "stopped", "1"),
        ("relaunched", "stopped", "OK", "2"),
    ]
    crit, ok = calls(log)[0], calls(log)[1]
    assert crit["DFLASH_REASON"].startswith("no job launched here yet") and crit["DFLASH_EXIT_CODE"] == "2"
    assert (
        crit["DFLASH_TARGET"] == "local"
        and crit["DFLASH_JOB"] == jobpaths.marker_value(target.job)
    )
    assert ok["DFLASH_PERFDATA"].startswith("step=") and ok["DFLASH_LEVEL"] == "OK"
    remembered = json.loads(next(state.glob("local-*.verdict.json")).read_text())
    assert remembered["state"] == "OK" and remembered["launch"] == 2


def test_a_hanging_hook_never_holds_health_past_its_budget(local_target, tmp_path):
    target = standin(local_target)
    inventory = inventory_file(tmp_path, target)
    env = {"DFLASH_OPS_STATE_DIR": str(tmp_path / "state")}
    plain = dflash_ops(inventory, "health", "-t", target.name, "--timeout", "4", env=env)
    pid_file = tmp_path / "hook.pid"
    started = time.monotonic()
    hung = dflash_ops(
        inventory,
        "health",
        "-t",
        target.name,
        "--timeout",
        "4",
        "--on-change",
        f"sleep 300 & echo $! > {pid_file}; sleep 300",
        env=env,
    )
    took = time.monotonic() - started
    assert took < 4 + 1.5, f"health took {took:.1f} s with a 4 s budget"  # + the interpreter's start
    assert hung.returncode == plain.returncode == 2
    assert hung.stdout == plain.stdout  # the verdict, unchanged
    assert hung.stderr == "local: on-change hook still running at the end of the time budget: killed\n"
    child = int(pid_file.read_text())
    for _ in range(20):  # the hook's whole process group was killed, its background child too
        if (
            not os.path.exists(f"/proc/{child}")
            or open(f"/proc/{child}/stat").read().split(")")[1].split()[0] == "Z"
        ):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hook's child {child} outlived health")
