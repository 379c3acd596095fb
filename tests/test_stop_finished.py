"""`stop` after the run finished: the job state stays `finished` (a completed run is not an
interrupted one), and health keeps tau in its perfdata while status shows it. Real tmux and the
stand-in trainer on the local target."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from dflash_ops import commands
from dflash_ops.observe import check as check_lib

from dflash_ops.job import jobpaths

from dflash_ops.observe import status as status_lib, status_output
from trainer import metrics_format

try:
    from tests.ops_helpers import wait_for
    from tests.test_unattended_e2e import finite, job_state
    from tests.test_ops_e2e import cleanup, quick, standin, step  # noqa: F401 (cleanup: a fixture)
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import wait_for
    from test_unattended_e2e import finite, job_state
    from test_ops_e2e import cleanup, quick, standin, step  # noqa: F401


def test_stop_after_the_run_finished_keeps_it_finished_and_tau_stays_in_health(local_target, cleanup):
    target = finite(standin(local_target), 8)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    wait_for(lambda: job_state(target)["state"] == "finished", what="the run to finish")
    metrics = metrics_format.metrics_path_for_log(job_state(target)["log"])
    with open(metrics, "a", encoding="utf-8") as f:  # an evaluation the run wrote at its last step
        f.write(metrics_format.encode("eval", time=time.time(), step=8, tau=2.5, acceptance=[0.8, 0.5],
                                      lossless=True) + "\n")
    before = json.loads(Path(jobpaths.state_file(target.job)).read_text())

    stopped = commands.stop(target)
    assert stopped.ok, stopped.summary()
    assert step(stopped, "mark_stopped").message == "job state kept: the run had finished"
    assert job_state(target) == before  # not rewritten

    checked = check_lib.check(target)
    assert checked.verdict.level == "OK" and checked.verdict.reasons == ("finished at step 8",)
    assert checked.verdict.perfdata["tau"].value == 2.5
    assert checked.status.eval.tau == 2.5 and "tau 2.50" in status_output.target_text(checked.status)
    # one value for the age of the last step: the same number in the training block and in perfdata
    st = checked.status.to_json()
    assert st["training"]["last_update_age_s"] == st["perfdata"]["age_s"]["value"]


def test_a_stopped_job_keeps_tau_and_one_age_in_health_and_status():
    from dflash_ops.observe import health

    try:
        from tests.test_health import JOB, NOW, make_report, steps
    except ImportError:
        from test_health import JOB, NOW, make_report, steps
    records = steps(last_step_age=58.09) + list(metrics_format.parse_lines(metrics_format.encode(
        "eval", time=NOW - 53.0, step=10, tau=3.1, acceptance=[0.9, 0.7], lossless=True)))
    report = dataclasses.replace(make_report(records, running=False),
                                 job_state={"state": "stopped", "by": "dflash-ops stop", "when": NOW - 40})
    verdict = health.evaluate(report, JOB)
    assert verdict.level == "OK" and verdict.reasons[0].startswith("stopped by dflash-ops stop")
    assert verdict.perfdata["tau"].value == 3.1 and "tau=3.1" in health.nagios_line("gpu-box", verdict)
    st = status_lib.build_status("gpu-box", report, JOB, verdict).to_json()
    assert st["eval"]["tau"] == 3.1
    # the eval record is newer than the last step: still one age, the last step's
    assert st["training"]["last_update_age_s"] == st["perfdata"]["age_s"]["value"] == 58.09
