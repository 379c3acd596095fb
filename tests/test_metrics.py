"""`dflash-ops metrics` with the real parts: Debian's prometheus-node-exporter reading the file the
command writes into its textfile directory, scraped over HTTP; `promtool check metrics` on the file;
a live stand-in job (tests/sim/standin-trainer) on the local target, relaunched and observed by the
real CLI. Also the exposition's own rules (label escaping, family grouping, absent values), the
cron line, and --serve through prometheus-client."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_ops import commands
from dflash_ops.job import jobpaths
from dflash_ops.job.model import Health
from dflash_ops.observe import check as check_lib
from dflash_ops.observe import prometheus, textfile

try:
    from tests.ops_helpers import ops_argv
    from tests.test_ops_e2e import STANDIN, cleanup, quick, standin  # noqa: F401 (cleanup: a fixture)
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import ops_argv
    from test_ops_e2e import STANDIN, cleanup, quick, standin  # noqa: F401

NODE_EXPORTERS = ("prometheus-node-exporter", "node_exporter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} of an exposition, read with prometheus-client's parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, frozenset(s.labels.items()))] = s.value
    return found


def value(found: dict, name: str, **labels):
    matches = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} series"
    return matches[0]


@pytest.fixture
def node_exporter(tmp_path):
    binary = next((shutil.which(b) for b in NODE_EXPORTERS if shutil.which(b)), None)
    if binary is None:
        pytest.skip(
            "prometheus-node-exporter is not installed (.ci/run installs it: apt-get install prometheus-node-exporter)"
        )
    directory = tmp_path / "textfile"
    directory.mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--web.listen-address=127.0.0.1:{port}",
            "--collector.disable-defaults",
            "--collector.textfile",
            f"--collector.textfile.directory={directory}",
            "--web.disable-exporter-metrics",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"node_exporter did not start: {proc.communicate()[1].decode()[-500:]}")
            time.sleep(0.1)
    yield directory, url
    proc.terminate()
    proc.wait(timeout=10)


def inventory_file(tmp_path: Path, target) -> Path:
    job = target.job
    data = {
        "targets": {
            target.name: {
                "transport": "local",
                "job": {
                    "workdir": job.workdir,
                    "python": job.python,
                    "config": job.config,
                    "session": job.session,
                    "tmux_socket": job.tmux_socket,
                    "env": dict(job.env),
                    "health": dataclasses.asdict(job.health),
                },
            }
        }
    }
    path = tmp_path / "inventory.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def idle_local_inventory(path: Path, name: str) -> Path:
    """An inventory at `path` of one local target `name` where no job was ever launched."""
    job = {"workdir": str(path.parent / "w"), "python": sys.executable, "config": "tiny-cpu", "tmux_socket": "none-here"}
    path.write_text(json.dumps({"targets": {name: {"transport": "local", "job": job}}}))
    return path


def dflash_ops(inventory: Path, *args: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ops_argv(inventory, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def live_job(local_target, tmp_path):
    target = standin(local_target, health=Health(stall_seconds=60))
    return dataclasses.replace(
        target,
        name="box-1",
        job=dataclasses.replace(
            target.job, env=target.job.env + (("STANDIN_EVAL_EVERY", "2"), ("STANDIN_TAU", "1.4"))
        ),
    )


def test_node_exporter_serves_the_metrics_of_a_live_job(
    local_target, node_exporter, cleanup, tmp_path, monkeypatch
):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    directory, url = node_exporter
    target = live_job(local_target, tmp_path)
    cleanup(target)
    assert commands.relaunch(target, **quick()).ok
    deadline = time.monotonic() + 30
    while check_lib.check(target).status.eval is None:  # the stand-in evaluates every 2 steps
        assert time.monotonic() < deadline, "no eval record"
        time.sleep(0.3)
    inventory = inventory_file(tmp_path, target)

    done = dflash_ops(inventory, "metrics", "-t", "box-1", "--textfile-dir", str(directory))
    assert done.returncode == 0, done.stderr
    path = directory / "dflash-ops-box-1.prom"
    assert done.stdout.strip() == f"wrote {path}"
    assert not [p for p in directory.iterdir() if p.name != path.name], "a temp file was left behind"
    scraped = urllib.request.urlopen(url, timeout=5).read().decode()
    found = samples(scraped)
    assert value(found, "node_textfile_scrape_error") == 0
    job = jobpaths.marker_value(target.job)
    base = {"target": "box-1", "job": job, "node": socket.gethostname()}
    assert value(found, "dflash_up", **base) == 1
    assert value(found, "dflash_state", state="running", **base) == 1
    assert value(found, "dflash_state", state="down", **base) == 0
    assert value(found, "dflash_health_status", **base) == 0
    assert value(found, "dflash_step", **base) >= 2
    assert value(found, "dflash_tokens_per_second", **base) == 50000
    assert value(found, "dflash_tau", **base) == 1.4
    assert value(found, "dflash_tau_expected", **base) == 1.5  # 1 + acc 0.5 of the stand-in's steps
    assert value(found, "dflash_relaunches_total", **base) == 1  # train-0001.log
    assert 0 <= value(found, "dflash_last_step_age_seconds", **base) < 30
    stamp = value(found, "dflash_last_step_timestamp_seconds", **base)
    assert abs(time.time() - stamp) < 30
    assert value(found, "dflash_auto_relaunches_last_hour", **base) == 0

    promtool = shutil.which("promtool")
    if promtool:  # Debian's `prometheus` package; .ci/run installs it
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=path.read_text(), capture_output=True, text=True
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr

    # a relaunch is the next launch; a stop is the state `stopped`, rewritten in place
    assert commands.relaunch(target, **quick()).ok
    assert commands.stop(target).ok
    assert dflash_ops(inventory, "metrics", "-t", "box-1", "--textfile-dir", str(directory)).returncode == 0
    found = samples(urllib.request.urlopen(url, timeout=5).read().decode())
    assert value(found, "dflash_relaunches_total", **base) == 2
    assert value(found, "dflash_state", state="stopped", **base) == 1
    assert value(found, "dflash_state", state="running", **base) == 0


def _checked(name, status_kwargs=None, level="OK"):
    """An check_lib.Checked for a target the probe could not reach (no report): the shape metrics get."""
    from dflash_ops.job.model import Job, Target
    from dflash_ops.observe import health, status as status_lib

    target = Target(name=name, transport="local", job=Job(workdir="/w", python="/p", config="tiny-cpu"))
    verdict = health.unknown("no answer") if level == "UNKNOWN" else health.Verdict(level, ("fine",))
    return check_lib.Checked(target, verdict, status_lib.build_status(name, None, target.job, verdict))


def test_label_values_are_escaped_and_families_grouped(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    hostile = 'box "1"\\\n$(touch /tmp/pwned)'
    text = prometheus.render([_checked(hostile, level="UNKNOWN"), _checked("plain", level="UNKNOWN")])
    assert 'target="box \\"1\\"\\\\\\n$(touch /tmp/pwned)"' in text
    found = samples(text)
    assert value(found, "dflash_up", target=hostile) == 0  # read back exactly
    assert value(found, "dflash_health_status", target="plain") == 3
    assert value(found, "dflash_state", target=hostile, state="unknown") == 1
    assert not any(n == "dflash_step" for n, _ in found)  # not measured: absent, never NaN
    heads = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(heads) == len(set(heads)), "a family must appear once, whichever target its samples come from"
    promtool = shutil.which("promtool")
    if promtool:
        lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_textfile_write_is_atomic_and_names_a_missing_directory(tmp_path):
    path = textfile.write(str(tmp_path), "x.prom", "a 1\n")
    assert Path(path).read_text() == "a 1\n" and os.listdir(tmp_path) == ["x.prom"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("targets: {}\n")
    bad = dflash_ops(inventory, "metrics", "--textfile-dir", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        f"dflash-ops: --textfile-dir {tmp_path / 'nope'}: no such directory; give the "
        "directory node_exporter reads (its --collector.textfile.directory)"
    )


def test_serve_answers_scrapes_with_the_same_families(tmp_path):
    inventory = idle_local_inventory(tmp_path / "inv.yaml", "gone")
    port = free_port()
    proc = subprocess.Popen(
        ops_argv(inventory, "metrics", "-t", "gone", "--serve", str(port), "--timeout", "5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "DFLASH_OPS_STATE_DIR": str(tmp_path / "state")},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    found = samples(body)
    assert value(found, "dflash_up", target="gone") == 1
    assert value(found, "dflash_state", target="gone", state="down") == 1  # never launched: not running
    assert value(found, "dflash_health_status", target="gone") == 2
    assert f"# HELP dflash_up {prometheus.FAMILIES['dflash_up'].help}" in body  # our help text, served as is


def test_the_cron_metrics_line_writes_the_file_as_cron_runs_it(tmp_path):
    from dflash_ops import cron

    try:
        from tests.test_cron import REPO, as_cron_runs_it
    except ImportError:
        from test_cron import REPO, as_cron_runs_it
    inventory = idle_local_inventory(tmp_path / "inv%d.yaml", "t1")
    directory = tmp_path / "text 50%"
    directory.mkdir()
    argv = ops_argv(inventory, "metrics", "--target", "t1", "--textfile-dir", str(directory))
    line = cron.health_line("* * * * *", argv, str(tmp_path / "m.log"), "t1", cron.METRICS_TAG)
    assert line.endswith("# dflash-ops-metrics:t1") and cron.ours([line, "0 3 * * * true"], "t1") == [line]
    command, stdin = as_cron_runs_it(line)
    assert stdin == ""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(REPO),
        "SHELL": "/bin/sh",
        "DFLASH_OPS_STATE_DIR": str(tmp_path / "state"),
    }
    subprocess.run(["/bin/sh", "-c", command], env=env, cwd=str(tmp_path), timeout=60)
    written = (directory / "dflash-ops-t1.prom").read_text()
    assert value(samples(written), "dflash_up", target="t1") == 1


@pytest.mark.skipif(shutil.which("crontab") is None, reason="cron is not installed (.ci/run installs it)")
def test_cron_install_metrics_sits_beside_the_health_line(tmp_path):
    before = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    saved = before.stdout if before.returncode == 0 else None
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("targets: {}\n")
    try:
        subprocess.run(["crontab", "-"], input="0 3 * * * /bin/true\n", text=True, check=True)
        assert dflash_ops(inventory, "cron", "install", "--log", str(tmp_path / "h.log")).returncode == 0
        for schedule in ("*/2 * * * *", "* * * * *"):  # installed twice: replaced, never doubled
            done = dflash_ops(
                inventory,
                "cron",
                "install",
                "--metrics",
                str(tmp_path),
                "--schedule",
                schedule,
                "--log",
                str(tmp_path / "m.log"),
            )
            assert done.returncode == 0, done.stderr
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout.splitlines()
        metrics = [line for line in table if line.endswith("# dflash-ops-metrics:local")]
        assert len(metrics) == 1 and metrics[0].startswith("* * * * * ")
        assert f"metrics --target local --textfile-dir {tmp_path}" in metrics[0]
        assert len([line for line in table if line.endswith("# dflash-ops-health:local")]) == 1
        assert len(dflash_ops(inventory, "cron", "show").stdout.splitlines()) == 2
        bad = dflash_ops(inventory, "cron", "install", "--metrics", str(tmp_path / "nope"))
        assert bad.returncode == 2 and bad.stderr.startswith(
            f"dflash-ops: --metrics {tmp_path / 'nope'}: no such"
        )
        assert dflash_ops(inventory, "cron", "remove").stdout.strip() == "removed 2 line(s)"
        left = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout
        assert left.strip() == "0 3 * * * /bin/true"
    finally:
        if saved is None:
            subprocess.run(["crontab", "-r"], capture_output=True)
        else:
            subprocess.run(["crontab", "-"], input=saved, text=True)
