"""A multinode job in the inventory (`multinode:`): what it accepts, the one-line refusals, each
node's torchrun line, and how the nodes' verdicts make one (no target is reached here)."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import textwrap

import pytest

from dflash_ops.observe import health, job_check, status as status_lib
from dflash_ops.observe.status import JobProcess, TargetStatus, TmuxSession

from dflash_ops.inventory import target as inventory_target

from dflash_ops import commands
from dflash_ops.observe import check as check_lib
from dflash_ops.errors import InputError
from tests.test_inventory import error_of, load
from dflash_ops.act.launch import trainer_argv

pytestmark = pytest.mark.multinode

BASE = """\
defaults:
  job: {workdir: /srv/dflash, python: /srv/venv/bin/python3, config: /srv/dflash/train.yaml,
        launcher: torchrun, nproc_per_node: 2, drafter_gpus: [0, 1], target_gpus: []}
targets:
  gpu-a: {transport: ssh, host: 10.0.0.7}
  gpu-b: {transport: ssh, host: 10.0.0.8}
  gpu-c: {transport: ssh, host: 10.0.0.9}
"""


@pytest.fixture(autouse=True)
def bundled(monkeypatch):
    monkeypatch.setattr(inventory_target, "bundled_config_names", lambda: ("gpu-paper", "tiny-cpu"))




def with_job(extra: str, targets: str = "") -> str:
    return BASE + targets + "multinode:\n" + textwrap.indent(textwrap.dedent(extra), "  ")


def test_a_two_node_job_and_what_each_node_runs():
    inv = load(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/shared/runs/}\n"))
    job = inv.multinode["pair"]
    assert [n.name for n in job.nodes] == ["gpu-a", "gpu-b"]
    assert (job.rdzv_host, job.rdzv_port, job.endpoint, job.runs_dir) == (
        "10.0.0.7", 29400, "10.0.0.7:29400", "/mnt/shared/runs")  # the first node's host by default
    assert job.world_size == 4
    argv = trainer_argv(job.node_job(1, rdzv_id="pair-0003-abcd"))
    line = " ".join(argv)
    assert "-m torch.distributed.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.7:29400 " \
           "--rdzv-id pair-0003-abcd --nproc-per-node 2 -m trainer" in line
    assert "--node-rank" not in line  # c10d assigns node ranks at the rendezvous (and ignores the flag)
    assert job.node_job(0).runs_dir == "/mnt/shared/runs"
    assert not hasattr(inv.targets["gpu-a"].job, "runs_dir")  # the targets themselves stay single-node jobs
    assert "--nnodes" not in trainer_argv(inv.targets["gpu-a"].job)


def test_other_commands_refuse_the_job_name_and_name_its_nodes():
    inv = load(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs, rdzv_host: head.lan, rdzv_port: 29500}\n"))
    assert inv.multinode["pair"].endpoint == "head.lan:29500"
    with pytest.raises(InputError, match=r"'pair' is a multinode job: .*its nodes' targets \(gpu-a, gpu-b\)"):
        inv.resolve("pair")
    with pytest.raises(InputError, match="multinode jobs: pair"):
        inv.resolve("nope")


@pytest.mark.parametrize("extra,targets,expected", [
    ("pair: {nodes: [gpu-a], runs_dir: /r}\n", "",
     "inv.yaml:9: multinode 'pair': field 'nodes': expected a list of at least two target names"),
    ("pair: {nodes: [gpu-a, ghost], runs_dir: /r}\n", "",
     "field 'nodes': names unknown target 'ghost'"),
    ("pair: {nodes: [gpu-a, gpu-a], runs_dir: /r}\n", "",
     "lists target 'gpu-a' twice"),
    ("pair: {nodes: [gpu-a, gpu-b]}\n", "",
     "inv.yaml:9: multinode 'pair': field 'runs_dir': is required"),
    ("pair: {nodes: [gpu-a, gpu-b], runs_dir: runs}\n", "",
     "field 'runs_dir': must be an absolute path on every node, got 'runs'"),
    ("pair: {nodes: [gpu-a, gpu-b], runs_dir: /r, rdzv_prot: 1}\n", "",
     "field 'rdzv_prot': unknown field; did you mean 'rdzv_port'?"),
    ("pair: {nodes: [gpu-a, gpu-b], runs_dir: /r, rdzv_port: 0}\n", "",
     "field 'rdzv_port': must be between 1 and 65535, got 0"),
    ("gpu-a: {nodes: [gpu-a, gpu-b], runs_dir: /r}\n", "",
     "multinode 'gpu-a': 'gpu-a' is also a target name; give the job another name"),
    ("pair: [gpu-a, gpu-b]\n", "",
     "multinode 'pair': expected a mapping like {nodes: [gpu-a, gpu-b]"),
])
def test_one_line_refusals(extra, targets, expected):
    assert expected in error_of(with_job(extra, targets))


def test_a_node_that_is_not_a_torchrun_target_is_refused():
    message = error_of(with_job("pair: {nodes: [gpu-a, local], runs_dir: /r}\n"))  # local: the threaded tiny job
    assert message.startswith("inv.yaml:9: multinode 'pair': field 'nodes': target 'local' runs launcher threads")
    assert "give it job: {launcher: torchrun, nproc_per_node: N}" in message


@pytest.mark.parametrize("job,fragment", [
    ("{nproc_per_node: 1, drafter_gpus: [0]}", "target 'odd' has job.nproc_per_node 1 but the first node 'gpu-a' has 2"),
    ("{python: /opt/other/bin/python3}", "has job.python '/opt/other/bin/python3' but the first node 'gpu-a' has "
                                         "'/srv/venv/bin/python3'; every node runs the same job"),
    ("{config: /srv/dflash/other.yaml}", "has job.config '/srv/dflash/other.yaml'"),
    ("{train_args: ['--max-steps', '5']}", "has job.train_args ['--max-steps', '5'] but the first node 'gpu-a' has []"),
    ("{nnodes: 2, rdzv_endpoint: '10.0.0.7:29400'}", "sets job.nnodes/rdzv_endpoint itself"),
])
def test_nodes_must_run_the_same_job(job, fragment):
    targets = f"  odd: {{transport: ssh, host: 10.0.0.10, job: {job}}}\n"
    message = error_of(with_job("pair: {nodes: [gpu-a, odd], runs_dir: /r}\n", targets))
    assert "field 'nodes'" in message and fragment in message, message


def test_the_first_node_must_be_reachable_by_address_or_rdzv_host_given():
    targets = ("  box: {transport: pct, host: pve.lan, ctid: 200}\n")
    message = error_of(with_job("pair: {nodes: [box, gpu-b], runs_dir: /r}\n", targets))
    assert "field 'rdzv_host': is required: the first node 'box' is a pct target" in message
    inv = load(with_job("pair: {nodes: [box, gpu-b], runs_dir: /r, rdzv_host: 10.1.0.5}\n", targets))
    assert inv.multinode["pair"].endpoint == "10.1.0.5:29400"


def test_two_nodes_on_one_machine_need_their_own_tmux_socket_or_session():
    # one job (one workdir) twice is not two nodes; two workdirs get two sessions by default
    targets = "  same: {transport: ssh, host: 10.0.0.7}\n"
    message = error_of(with_job("pair: {nodes: [gpu-a, same], runs_dir: /r}\n", targets))
    assert "are the same machine with the same tmux socket and session (dflash/dflash-" in message
    targets = "  same: {transport: ssh, host: 10.0.0.7, job: {workdir: /srv/other}}\n"
    assert load(with_job("pair: {nodes: [gpu-a, same], runs_dir: /r}\n", targets)).multinode["pair"]


def test_the_shared_runs_dir_is_never_a_purged_cache():
    targets = "  cached: {transport: ssh, host: 10.0.0.10, job: {cache_dir: /mnt/shared}}\n"
    message = error_of(with_job("pair: {nodes: [gpu-a, cached], runs_dir: /mnt/shared/runs}\n", targets))
    assert "field 'runs_dir': target 'cached''s cache_dir /mnt/shared contains the shared runs_dir" in message


# ------------------------------------------------------------------ one verdict from every node's


def _job():
    return load(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /r}\n")).multinode["pair"]


def _checked(target, level, reasons, running=True, state="running", run=1, processes=()):
    verdict = health.Verdict(level, tuple(reasons))
    status = TargetStatus(target=target.name, session=TmuxSession("dflash", "dflash", running=running),
                          job_state={"state": state, "run": run}, processes=tuple(processes), verdict=verdict)
    return check_lib.Checked(target, verdict, status)


def test_one_dead_node_makes_the_job_critical_and_names_it():
    job = _job()
    a, b = job.node_targets()
    died = "rank died: rank 3 (local rank 1, pid 4242) exited with code -9 (SIGKILL), the first failure torchrun saw"
    jc = job_check.combine(job, [_checked(a, "OK", ["step 40/100, loss 2.0"]),
                                        _checked(b, "CRITICAL", [died], running=False)])
    assert jc.verdict.level == "CRITICAL"
    assert f"node 1 gpu-b: {died}" in jc.verdict.reasons
    assert health.nagios_line(jc.job.name, jc.verdict).startswith("DFLASH CRITICAL: pair: node 1 gpu-b: rank died: rank 3")


def test_an_unreachable_node_is_unknown_while_the_others_are_still_shown():
    job = _job()
    a, b = job.node_targets()
    jc = job_check.combine(job, [_checked(a, "OK", ["step 40/100"]),
                                        _checked(b, "UNKNOWN", ["no answer within the 10 s budget"], running=None)])
    assert jc.verdict.level == "UNKNOWN"
    assert jc.verdict.reasons == ("node 1 gpu-b: no answer within the 10 s budget",)
    assert [n.status.target for n in jc.status.nodes] == ["gpu-a", "gpu-b"]


def test_all_nodes_stopped_is_ok_but_half_stopped_is_critical():
    job = _job()
    a, b = job.node_targets()
    stopped = "stopped by dflash-ops stop at 2026-12-01 10:00:00 UTC"
    jc = job_check.combine(job, [_checked(a, "OK", [stopped], running=False, state="stopped"),
                                        _checked(b, "OK", [stopped], running=False, state="stopped")])
    assert jc.verdict.level == "OK" and jc.verdict.reasons == (f"{stopped} (2 nodes, world size 4, on every node)",)
    jc = job_check.combine(job, [_checked(a, "OK", ["step 40/100"]),
                                        _checked(b, "OK", [stopped], running=False, state="stopped")])
    assert jc.verdict.level == "CRITICAL"
    assert jc.verdict.reasons[0].startswith("half the job: node 1 gpu-b stopped or finished while node 0 gpu-a did not")


def test_nodes_in_different_runs_and_lost_ranks_are_critical():
    job = _job()
    a, b = job.node_targets()
    jc = job_check.combine(job, [_checked(a, "OK", ["step 4"], run=2), _checked(b, "OK", ["step 4"], run=1)])
    assert jc.verdict.level == "CRITICAL" and "the nodes train different runs" in jc.verdict.reasons[0]
    tree = [JobProcess(9, 1, "bash", "bash -c ... pane.sh LOG python -m torch.distributed.run -m trainer"),
            JobProcess(10, 9, "python", "/v/bin/python -m torch.distributed.run --nnodes 2 -m trainer"),
            JobProcess(11, 10, "python", "/v/bin/python -u -m trainer --config tiny-cpu"),
            JobProcess(12, 10, "python", "/v/bin/python -c from multiprocessing... (not a rank)")]
    jc = job_check.combine(job, [_checked(a, "OK", ["step 4"], processes=tree), _checked(b, "OK", ["step 4"])])
    assert jc.verdict.level == "CRITICAL"
    assert jc.verdict.reasons[0] == "node 0 gpu-a: 1 of 2 local ranks alive (torchrun pid 10): a rank died"
    assert jc.status.to_json()["nodes"][0]["ranks"] == {"torchrun_pid": 10, "alive": [11], "expected": 2}


def test_tail_log_node_choice():
    job = _job()
    assert job.node_named(None).name == "gpu-a"
    assert job.node_named("gpu-b").name == "gpu-b"
    assert job.node_named("1").job.nnodes == 2
    with pytest.raises(InputError, match=r"--node gpu-z: not a node of pair \(nodes: gpu-a, gpu-b, or 0-1\)"):
        job.node_named("gpu-z")
    assert dataclasses.replace(job, rdzv_host="::1").endpoint == "[::1]:29400"


def test_a_job_written_twice_is_named():
    message = error_of(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /r}\npair: {nodes: [gpu-b, gpu-c], runs_dir: /r}\n"))
    assert message.startswith("inv.yaml:10: multinode job 'pair' is defined twice (also on line 9)"), message


# ------------------------------------------------------------------ dry runs: every phase, nothing reached


def test_dry_run_relaunch_and_stop_show_every_node_and_reach_nothing():
    job = _job()  # 10.0.0.7/8: a connection attempt would fail the run
    events = []
    relaunched = commands.relaunch(job, dry_run=True, resume=False, on_progress=events.append)
    assert relaunched.ok and relaunched.dry_run and relaunched.target == "pair", relaunched.summary()
    assert [s.step for s in relaunched.steps] == commands.relaunch_plan(2)
    assert {s.status for s in relaunched.steps} == {"dry-run"}
    by_step = {s.step: s for s in relaunched.steps}
    assert by_step["preflight"].message.splitlines()[1].startswith("node 1 gpu-b: would check python+torch")
    for step in ("preflight", "same_job", "shared_runs_dir", "rendezvous", "launch"):
        ran = by_step[step].commands
        assert ran[0] == "# node 0 gpu-a" and "# node 1 gpu-b" in ran, (step, ran[:1])
        assert any("root@10.0.0.8" in c for c in ran), step
    launch = by_step["launch"].message
    assert launch.startswith("the run chosen in /r (fresh) on 2 nodes, rendezvous 10.0.0.7:29400 id pair-NNNN-")
    assert "--rdzv-id pair-NNNN-" in launch and "--output-dir /r/NNNN" in launch
    assert relaunched.summary().startswith("[pair] relaunch (dry run): ok, 10 of 10 steps run")
    assert [e.step for e in events if e.event == "end"] == commands.relaunch_plan(2)

    skipped = commands.relaunch(job, dry_run=True, purge=False, deploy=False)
    assert [(s.step, s.status) for s in skipped.steps if s.status != "dry-run"] == [
        ("purge_cache", "skipped"), ("deploy", "skipped")]

    stopped = commands.stop(job, dry_run=True)
    assert stopped.ok and [s.step for s in stopped.steps] == commands.stop_plan(2)
    assert "node 1 gpu-b: would record `stopped` in /srv/dflash/job-state.json" in stopped.steps[1].message


@pytest.mark.parametrize("command, phases", [
    ("gpu-clean", ["require_job_stopped", "free_gpus"]), ("purge-cache", ["purge_cache"]), ("deploy", ["deploy"])])
def test_the_other_commands_act_on_the_whole_job_too(tmp_path, command, phases):
    """One engine: every command that acts on a job takes a multinode job's name, every node at once."""
    from test_cli import cli

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs}\n").replace(
        "/srv/dflash/train.yaml", "tiny-cpu"))
    result = cli("--inventory", str(inventory), command, "-t", "pair", "--dry-run")
    assert result.returncode == 0, result
    steps = [line.split(" ... ")[0] for line in result.stdout.splitlines() if line.startswith("[") and " ... " in line]
    assert steps == [f"[{i}/{len(phases)}] {phase}" for i, phase in enumerate(phases, 1)], result.stdout
    assert "      node 1 gpu-b: " in result.stdout or "on every node" in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"[pair] {command} (dry run): ok"), result.stdout


@pytest.mark.parametrize("command", [["relaunch"], ["stop"], ["gpu-clean"]])
def test_acting_on_one_node_alone_is_refused_before_anything_is_reached(tmp_path, command):
    """A relaunch, stop or GPU clean of one node would kill that node's ranks and strand the job on
    the others (a cron `health --auto-relaunch -t gpu-a` too): refused in one line, exit 2."""
    from test_cli import cli

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs}\n").replace(
        "/srv/dflash/train.yaml", "tiny-cpu"))
    result = cli("--inventory", str(inventory), *command, "-t", "gpu-b")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "gpu-b is node 1 of the multinode job 'pair'" in lines[0] and "-t pair" in lines[0]
    assert load(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /r}\n")).node_of("gpu-c") is None


def test_health_auto_relaunch_of_one_node_never_relaunches_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dflash_ops.cli import cli as cli_group

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs}\n").replace(
        "/srv/dflash/train.yaml", "tiny-cpu"))
    dead = health.Verdict("CRITICAL", ("tmux session 'dflash' is gone",))

    def check(target, **_kwargs):
        return check_lib.Checked(target, dead, status_lib.build_status(target.name, None, target.job, dead))

    def relaunch(*_args, **_kwargs):
        raise AssertionError("auto-relaunch relaunched one node of a multinode job")

    monkeypatch.setattr(check_lib, "check", check)
    monkeypatch.setattr(commands, "auto_relaunch", relaunch)
    result = CliRunner().invoke(cli_group, ["--inventory", str(inventory), "health", "--auto-relaunch", "--json",
                                            "-t", "gpu-a"])
    assert result.exit_code == 2, result.output
    assert "not relaunched: gpu-a is node 0 of the multinode job 'pair'" in result.output, result.output


@pytest.mark.parametrize("command", [["status", "--json"], ["health"], ["metrics", "--textfile-dir", "-"]])
@pytest.mark.parametrize("name", ["gpu-a", "pair"])
def test_a_target_and_a_multinode_job_are_checked_by_one_function(tmp_path, monkeypatch, command, name):
    """A target is the one-node job: status, health and metrics check it through the same job check
    as a multinode job (a second path for one target would bypass job_check.check)."""
    from click.testing import CliRunner

    from dflash_ops.cli import cli as cli_group

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs}\n").replace(
        "/srv/dflash/train.yaml", "tiny-cpu"))
    dead = health.Verdict("CRITICAL", ("tmux session 'dflash' is gone",))
    monkeypatch.setattr(check_lib, "check", lambda target, **_kwargs: check_lib.Checked(
        target, dead, status_lib.build_status(target.name, None, target.job, dead)))
    seen, job_check_itself = [], job_check.check
    monkeypatch.setattr(job_check, "check", lambda job, *args: seen.append(job.name) or job_check_itself(job, *args))
    result = CliRunner().invoke(cli_group, ["--inventory", str(inventory), *command, "-t", name])
    assert result.exit_code == (0 if command[0] == "metrics" else 2), result.output
    assert seen == [name], result.output


@pytest.mark.skipif(shutil.which("crontab") is None, reason="cron is not installed (.ci/run installs it)")
def test_cron_install_takes_a_multinode_job_as_one(tmp_path):
    """health and metrics act on a multinode job as one, so cron installs their lines for it by name."""
    from test_cli import cli

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(with_job("pair: {nodes: [gpu-a, gpu-b], runs_dir: /mnt/runs}\n").replace(
        "/srv/dflash/train.yaml", "tiny-cpu"))
    before = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    saved = before.stdout if before.returncode == 0 else None
    try:
        subprocess.run(["crontab", "-r"], capture_output=True)
        for extra in (["--auto-relaunch"], ["--metrics", str(tmp_path)]):
            done = cli("--inventory", str(inventory), "cron", "install", "-t", "pair", "--log",
                       str(tmp_path / "h.log"), *extra)
            assert done.returncode == 0, done.stderr
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout.splitlines()
        assert [line.rsplit("# ", 1)[1] for line in table] == ["dflash-ops-health:pair", "dflash-ops-metrics:pair"]
        assert "health --target pair --auto-relaunch" in table[0]
        assert f"metrics --target pair --textfile-dir {tmp_path}" in table[1]
        unknown = cli("--inventory", str(inventory), "cron", "install", "-t", "pear")
        assert unknown.returncode == 2 and "unknown target or group 'pear'" in unknown.stderr
    finally:
        if saved is None:
            subprocess.run(["crontab", "-r"], capture_output=True)
        else:
            subprocess.run(["crontab", "-"], input=saved, text=True)
