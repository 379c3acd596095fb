"""Drafter quality in `status` and `health`: the latest tau, its age, and the rules on it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from dflash_ops.observe import acceptance, health, probe, status, status_output
from dflash_ops.observe.gpu import GpuSnapshot
from dflash_ops.job.model import Health, Job
from trainer import metrics_format

NOW = 80_000.0
ACC = [0.8, 0.7, 0.6]  # expected tau = 1 + .8 + .56 + .336 = 2.696


def job(**health_fields):
    return Job(workdir="/srv/dflash", python="/usr/bin/python3", config="tiny-cpu", session="dflash",
               health=Health(stall_seconds=900, **health_fields))


def metrics(tau=2.5, lossless=True, acc=ACC, eval_time=NOW - 90, with_eval=True, split=None) -> str:
    text = metrics_format.encode("start", time=NOW - 900, total_steps=1000, config={}, devices=[],
                                 compile_lock="lock", pid=1)
    for step in range(191, 201):
        text += metrics_format.encode("step", time=NOW - 300 + step, step=step, total_steps=1000, loss=2.0,
                                      acc=acc, tokens_per_s=40000.0, eta_s=600.0, lr=1e-4, grad_norm=1.0)
    if with_eval:
        extra = {} if split is None else {"split": split}
        text += metrics_format.encode("eval", time=eval_time, step=200, tau=tau, acceptance=[0.7, 0.5, 0.3],
                                      lossless=lossless, prompts=8, new_tokens=512, seconds=3.2, **extra)
    text += metrics_format.encode("step", time=NOW - 5, step=201, total_steps=1000, loss=2.0, acc=[0.1, 0.1, 0.1],
                                  tokens_per_s=40000.0, eta_s=600.0, lr=1e-4, grad_norm=1.0)
    return text


def report(text: str) -> probe.ProbeReport:
    return probe.ProbeReport(
        target="box", time=NOW, hostname="ct200", gpu=GpuSnapshot((), "nvidia-smi"),
        session=probe.SessionState("dflash", "dflash", True, True, 4100), processes=(),
        log_dir="/srv/dflash/logs", log=probe.FileTail("/srv/dflash/logs/train-0001.log", 10, NOW - 5, ("step",)),
        metrics=probe.FileTail("/srv/dflash/logs/train-0001.metrics.jsonl", 10, NOW - 5, ()),
        records=tuple(metrics_format.parse_lines(text)))


def test_expected_tau_is_the_acceptance_length_accuracy_predicts():
    assert metrics_format.expected_tau([]) == 1.0
    assert metrics_format.expected_tau(ACC) == pytest.approx(2.696)
    assert metrics_format.expected_tau([1.0] * 15) == 16.0  # a perfect drafter at block 16


def test_latest_eval_uses_the_accuracy_up_to_its_step_and_ignores_earlier_runs():
    accept = acceptance.latest(list(report(metrics()).records))
    assert (accept.step, accept.tau, accept.lossless) == (200, 2.5, True)
    assert accept.acceptance == (0.7, 0.5, 0.3)
    assert accept.expected_tau == pytest.approx(2.696)  # step 201's low accuracy comes after the eval
    newer_run = metrics() + metrics_format.encode("start", time=NOW, total_steps=5, config={}, devices=[],
                                                  compile_lock="lock", pid=2)
    assert acceptance.latest(metrics_format.parse_lines(newer_run)) is None


def test_status_json_and_table_show_tau_and_its_age():
    r = report(metrics())
    target_status = status.build_status("box", r, job(), health.evaluate(r, job()))
    st = target_status.to_json()
    json.dumps(st, allow_nan=False)
    assert st["eval"] == {"step": 200, "tau": 2.5, "acceptance": [0.7, 0.5, 0.3], "lossless": True,
                          "expected_tau": pytest.approx(2.696), "age_s": 90.0}
    assert "40.0 Ktok/s  tau 2.50 (90 s ago)" in status_output.target_text(target_status)
    assert st["verdict"] == "OK", st["reasons"]
    assert st["perfdata"]["tau"]["value"] == 2.5


def test_no_eval_yet_keeps_status_and_the_nagios_line_as_they_were():
    r = report(metrics(with_eval=False))
    verdict = health.evaluate(r, job())
    st = status.build_status("box", r, job(), verdict)
    assert st.eval is None and "tau" not in status_output.target_text(st)
    assert "tau" not in health.nagios_line("box", verdict)


def test_min_tau_warns_and_sets_the_perfdata_threshold():
    verdict = health.evaluate(report(metrics(tau=2.5)), job(min_tau=3.0))
    assert verdict.level == "WARNING"
    assert "measured tau 2.50 at step 200 is below the 3 minimum (health.min_tau)" in verdict.reasons
    assert "tau=2.5;3:;" in health.nagios_line("box", verdict)
    assert health.evaluate(report(metrics(tau=3.2)), job(min_tau=3.0)).level == "OK"
    # with a floor set but no eval yet, the value is undetermined, not an alarm
    quiet = health.evaluate(report(metrics(with_eval=False)), job(min_tau=3.0))
    assert quiet.level == "OK" and "tau=U;3:;" in health.nagios_line("box", quiet)


def test_tau_far_below_what_training_accuracy_predicts_warns_naming_both_numbers():
    verdict = health.evaluate(report(metrics(tau=1.3)), job())
    assert verdict.level == "WARNING"
    (reason,) = verdict.reasons
    assert "measured tau 1.30 at step 200" in reason and "0.7 x the 2.70 that training accuracy predicts" in reason
    # 0.7 x 2.696 = 1.887: just above it is fine
    assert health.evaluate(report(metrics(tau=1.9)), job()).level == "OK"


def test_a_held_out_gap_is_not_called_a_mismatch():
    """eval.path prompts are another distribution: a gap there may be over-fitting, not a mismatch."""
    (held_in,) = health.evaluate(report(metrics(tau=1.3, split="held-in")), job()).reasons
    (held_out,) = health.evaluate(report(metrics(tau=1.3, split="held-out")), job()).reasons
    assert "mismatch:" in held_in and "held-out" not in held_in
    assert "held-out tau 1.30" in held_out and "over-fit or a mismatch" in held_out
    assert "mismatch:" not in held_out


def test_a_lossless_failure_warns():
    verdict = health.evaluate(report(metrics(lossless=False)), job())
    assert verdict.level == "WARNING"
    assert any("did not reproduce the target's greedy output" in r for r in verdict.reasons)


def metrics_now(tau, eval_time_ago) -> tuple[str, float]:
    """metrics() with the records' times relative to the real clock (for the real probe)."""
    global NOW
    t = time.time()
    saved, NOW = NOW, t
    try:
        return metrics(tau=tau, eval_time=t - eval_time_ago), t
    finally:
        NOW = saved


def status_json_through_cli(tmp_path, metrics_text: str, with_health: bool = False):
    """`dflash-ops status --json` over the real probe, with a live tmux session and this metrics file
    (and `health`'s Nagios line with it when asked)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "train-0001.log").write_text("starting\n")
    (logs / "train-0001.metrics.jsonl").write_text(metrics_text)
    socket = f"dflash-tau-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "targets:\n  box:\n    transport: local\n    job:\n"
        f"      workdir: {json.dumps(str(tmp_path))}\n      python: {json.dumps(sys.executable)}\n"
        f"      config: tiny-cpu\n      session: dflash\n      tmux_socket: {socket}\n"
        "      health: {min_tau: 2}\n")
    subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-s", "dflash", "sleep 120"], check=True, timeout=30)
    cli = [sys.executable, "-m", "dflash_ops", "--inventory", str(inventory)]
    try:
        out = subprocess.run(cli + ["status", "--json", "-t", "box"], capture_output=True, text=True, timeout=120)
        nagios = (subprocess.run(cli + ["health", "-t", "box"], capture_output=True, text=True, timeout=120)
                  if with_health else None)
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    st = st[0] if isinstance(st, list) else st
    return (st, nagios) if with_health else st


def test_eval_event_reaches_status_json_through_the_real_probe_and_cli(tmp_path):
    st = status_json_through_cli(tmp_path, metrics_now(tau=2.75, eval_time_ago=40)[0])
    assert st["eval"]["tau"] == 2.75 and st["eval"]["step"] == 200
    assert 30 <= st["eval"]["age_s"] < 120
    assert st["perfdata"]["tau"]["value"] == 2.75 and st["perfdata"]["tau"]["warn"] == "2:"


def test_an_eval_far_behind_the_metrics_tail_still_reaches_status_and_health(tmp_path):
    # eval.every 1000 with a record per step: the newest eval lies far before the probe's tail
    text, t = metrics_now(tau=2.75, eval_time_ago=1500)
    for step in range(202, 1702):
        text += metrics_format.encode("step", time=t - 1500 + step - 202, step=step, total_steps=5000, loss=1.5,
                                      acc=[0.1, 0.1, 0.1], tokens_per_s=40000.0, eta_s=600.0, lr=1e-4,
                                      grad_norm=1.0)
    st, nagios = status_json_through_cli(tmp_path, text, with_health=True)
    assert st["training"]["step"] == 1701
    assert st["eval"]["step"] == 200 and st["eval"]["tau"] == 2.75
    assert 1490 <= st["eval"]["age_s"] < 1600
    # the accuracy before the eval came along: expected tau is from it, not from the later steps
    assert st["eval"]["expected_tau"] == pytest.approx(2.696)
    assert st["eval_search"]["found"] and not st["eval_search"]["cap_hit"]
    assert st["perfdata"]["tau"]["value"] == 2.75 and st["perfdata"]["tau"]["warn"] == "2:"
    assert nagios.returncode == 0 and nagios.stdout.startswith("DFLASH OK"), nagios.stdout + nagios.stderr
    assert "tau=2.75;2:;" in nagios.stdout
