"""A multinode job end to end: two ssh targets on this machine (two real sshds, their own workdirs
and tmux sockets, one shared runs dir) run ONE torchrun job of the REAL tiny trainer, 1 gloo rank
each (world size 2), meeting at a c10d rendezvous on loopback.

relaunch reaches the first step with world size 2 and the loss trajectory of the threaded
2-replica run; status/health/tail-log see one job; stop ends both nodes and records the stop on
both; a relaunch resumes the same run on both; a rank killed on one node makes the job CRITICAL
naming that node and rank, and `health --auto-relaunch` relaunches every node. The refusals: a
node with another trainer release, a runs dir that is not shared (a third sshd whose sessions see
their own tmpfs there) and an unresolvable rendezvous host stop nothing anywhere.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.transport.factory import connect

from dflash_ops.job import jobpaths

from dflash_ops.observe import job_check
from dflash_ops.inventory.load import load_inventory

try:
    from tests import sshd as sshd_helpers
    from tests.ops_helpers import ops_argv, wait_for
    from tests.test_on_change import RECORD, calls
    from tests.test_ops_torchrun import marked_python_processes
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import sshd as sshd_helpers
    from ops_helpers import ops_argv, wait_for
    from test_on_change import RECORD, calls
    from test_ops_torchrun import marked_python_processes

pytestmark = [pytest.mark.multinode, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
# test_distributed's tiny shapes; enough epochs that the job is still training when stopped or killed
SMALL = {"data.seq_len": 32, "data.synthetic.num_samples": 16, "train.epochs": 2000, "train.batch_size": 2,
         "train.num_anchors": 6, "run.torch_threads": 1, "run.log_every": 25, "run.checkpoint_every": 1000,
         "eval.every": 0}  # 16 records over 2000 epochs are memorised: an eval would rightly warn
TRAIN_ARGS = [word for key, value in SMALL.items() for word in ("--set", f"{key}={value}")]
COMPARED_STEPS = 6


def free_port() -> int:
    return sshd_helpers.free_port()


def node_yaml(name: str, port: int, client_key: Path, known_hosts: Path, workdir: Path, tag: str) -> str:
    return textwrap.dedent(f"""\
      {name}:
        transport: ssh
        host: 127.0.0.1
        port: {port}
        identity_file: {client_key}
        known_hosts_file: {known_hosts}
        connect_timeout_s: 5
        job:
          workdir: {workdir}
          python: {sys.executable}
          config: tiny-cpu
          launcher: torchrun
          nproc_per_node: 1
          tmux_socket: mn-{name}-{tag}
          session: mn-{tag}
          train_args: {json.dumps(TRAIN_ARGS)}
          health: {{stall_seconds: 120}}
    """)


def write_inventory(path: Path, nodes: list[str], jobs: dict[str, str]) -> Path:
    text = "targets:\n" + textwrap.indent("".join(nodes), "  ") + "multinode:\n"
    text += "".join(f"  {name}: {spec}\n" for name, spec in jobs.items())
    path.write_text(text)
    return path


def processes_of(job) -> dict[int, dict]:
    """pid -> {RANK, WORLD_SIZE} of every python process carrying the node's job marker."""
    return {pid: {"RANK": env.get("RANK", ""), "WORLD_SIZE": env.get("WORLD_SIZE", "")}
            for pid, env in marked_python_processes(job).items()}


def ranks_of(job) -> dict[int, dict]:
    return {pid: env for pid, env in processes_of(job).items() if env["RANK"]}


def state_of(job) -> dict:
    return json.loads(Path(jobpaths.state_file(job)).read_text())


def steps_in(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("event") == "step"]


def metrics_of(job) -> Path:
    log = Path(state_of(job)["log"])
    return log.with_name(log.stem + ".metrics.jsonl")


def cli(inventory: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(ops_argv(inventory, *args), capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def threaded_reference(out: Path, steps: int) -> list[dict]:
    """The threaded trainer with 2 drafter replicas (tiny-cpu's own) and the same settings, stopped
    once it has logged `steps` steps: the trajectory the two nodes' ranks must follow."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", "tiny-cpu", "--output-dir", str(out),
                             *TRAIN_ARGS], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(steps_in(out / "metrics.jsonl")) >= steps or proc.poll() is not None, 180,
                 "the threaded reference")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    found = steps_in(out / "metrics.jsonl")
    assert len(found) >= steps, err.decode()[-2000:]
    return found[:steps]


def kill_tmux(job) -> None:
    subprocess.run(["tmux", "-L", job.tmux_socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def pair(sshd_server, sshd_server_b, client_key, known_hosts, tmp_path):
    tag = uuid.uuid4().hex[:6]
    nodes = [node_yaml("box-a", sshd_server.port, client_key, known_hosts, tmp_path / "work-a", tag),
             node_yaml("box-b", sshd_server_b.port, client_key, known_hosts, tmp_path / "work-b", tag)]
    spec = f"{{nodes: [box-a, box-b], runs_dir: {tmp_path / 'shared' / 'runs'}, rdzv_port: {free_port()}}}"
    path = write_inventory(tmp_path / "inventory.yaml", nodes, {"pair": spec})
    job = load_inventory(str(path)).multinode["pair"]
    yield path, job, nodes
    for target in job.node_targets():
        for pid in processes_of(target.job):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        kill_tmux(target.job)


def test_two_nodes_train_as_one_job(pair, tmp_path, monkeypatch):
    inventory, job, _ = pair
    a, b = job.node_targets()
    reference = threaded_reference(tmp_path / "reference", COMPARED_STEPS)
    first = cli(inventory, "relaunch", "-t", "pair", "--timeout", "300", "--grace", "60")
    print("\n$ dflash-ops relaunch -t pair\n" + first.stdout + first.stderr)  # the README's example output
    assert first.returncode == 0, first.stdout + first.stderr
    assert [line.split(" ... ")[0] for line in first.stdout.splitlines() if line.startswith("[")][:-1] == [
        f"[{i}/10] {name}" for i, name in enumerate(commands.relaunch_plan(2), 1)]
    assert f"run 0001 on 2 nodes, rendezvous 127.0.0.1:{job.rdzv_port} id pair-0001-" in first.stdout
    assert first.stdout.splitlines()[-1].startswith("[pair] relaunch: ok, 10 of 10 steps run")
    # one rank per node, world size 2, ranks 0 and 1 between them; one run on both nodes
    ranks = {name: list(ranks_of(t.job).values()) for name, t in (("a", a), ("b", b))}
    assert [len(r) for r in ranks.values()] == [1, 1], ranks
    assert sorted(r[0]["RANK"] for r in ranks.values()) == ["0", "1"]
    assert {r[0]["WORLD_SIZE"] for r in ranks.values()} == {"2"}
    runs = [state_of(t.job) for t in (a, b)]
    assert [s["run"] for s in runs] == [1, 1] and runs[0]["run_dir"] == runs[1]["run_dir"] == f"{job.runs_dir}/0001"
    assert "2 ranks (gloo)" in Path(runs[0]["log"]).read_text() + Path(runs[1]["log"]).read_text()

    # the loss trajectory of the threaded 2-replica run, on both nodes' metrics
    for target in (a, b):
        got = wait_for(lambda t=target: len(steps_in(metrics_of(t.job))) >= COMPARED_STEPS and
                       steps_in(metrics_of(t.job)), 120, "the compared steps")[:COMPARED_STEPS]
        assert [r["step"] for r in got] == [r["step"] for r in reference]
        for ours, theirs in zip(got, reference):
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6), (ours, theirs)
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-6)
            assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-9)

    status = cli(inventory, "status", "-t", "pair")
    print("\n$ dflash-ops status -t pair\n" + status.stdout)  # the README's example output
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith(f"pair: multinode job, 2 nodes x 1 rank (world size 2), rendezvous 127.0.0.1:"
                                    f"{job.rdzv_port}, runs {job.runs_dir}\nnode 0: box-a")
    assert "\nnode 1: box-b" in status.stdout and status.stdout.count("local ranks alive 1 of 1") == 2
    assert status.stdout.splitlines()[-1].startswith("OK: step ")
    assert "(2 nodes, world size 2)" in status.stdout.splitlines()[-1]
    as_json = json.loads(cli(inventory, "status", "-t", "pair", "--json").stdout)
    assert [n["target"] for n in as_json["nodes"]] == ["box-a", "box-b"] and as_json["verdict"] == "OK"
    for node, target in zip(as_json["nodes"], (a, b)):  # rank liveness: torchrun and its rank, by pid
        agent = [pid for pid, env in processes_of(target.job).items() if not env["RANK"]
                 and "torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert node["ranks"] == {"torchrun_pid": min(agent), "alive": sorted(ranks_of(target.job)), "expected": 1}
    hook_calls = tmp_path / "hook-calls.jsonl"
    hooked = dict(os.environ, DFLASH_OPS_STATE_DIR=str(tmp_path / "hook-state"), CALLS=str(hook_calls))
    scraped = cli(inventory, "metrics", "-t", "pair", "--textfile-dir", "-")
    assert scraped.returncode == 0, scraped.stderr
    up = sorted(line for line in scraped.stdout.splitlines() if line.startswith("dflash_up{"))
    assert [('target="box-a"' in up[0]), ('target="box-b"' in up[1]), len(up)] == [True, True, 2], up
    assert all(line.endswith(" 1") for line in up), up
    healthy = cli(inventory, "health", "-t", "pair", "--on-change", RECORD, env=hooked)
    assert healthy.returncode == 0 and healthy.stdout.startswith("DFLASH OK: pair: step "), healthy.stdout
    assert calls(hook_calls) == []  # the first sight of an OK job is no news
    drawn = cli(inventory, "report", "-t", "pair", "-o", str(tmp_path / "pair.png"))
    assert drawn.returncode == 0 and drawn.stdout.startswith("[box-a] run 0001: "), drawn.stdout + drawn.stderr
    assert (tmp_path / "pair.png").read_bytes().startswith(b"\x89PNG")
    tail = cli(inventory, "tail-log", "-t", "pair", "--node", "box-b", "-n", "400")
    assert tail.returncode == 0 and "launching run 0001" in tail.stdout, tail.stdout[-2000:] + tail.stderr
    assert "--rdzv-id pair-0001-" in tail.stdout

    stopped = cli(inventory, "stop", "-t", "pair", "--grace", "60")
    print("\n$ dflash-ops stop -t pair\n" + stopped.stdout + stopped.stderr)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.count("0 needed SIGKILL") == 2, stopped.stdout  # both nodes' ranks stopped on SIGTERM
    assert processes_of(a.job) == {} and processes_of(b.job) == {}
    assert [state_of(t.job)["state"] for t in (a, b)] == ["stopped", "stopped"]
    after_stop = job_check.check(job, timeout_s=20)
    assert after_stop.verdict.level == "OK", after_stop.verdict.reasons
    assert after_stop.verdict.reasons[0].startswith("stopped by dflash-ops stop at")
    assert after_stop.verdict.reasons[0].endswith("on every node)")
    checkpoints = sorted(p.name for p in (Path(job.runs_dir) / "0001" / "checkpoints").iterdir())
    assert checkpoints, "rank 0 checkpoints into the shared runs dir on a stop"
    stopped_at = steps_in(metrics_of(a.job))[-1]["step"]

    second = commands.relaunch(job, deploy=False, timeout=300.0, grace=60.0)
    assert second.ok, second.summary() + "\n" + "\n".join(s.message for s in second.steps)
    assert [state_of(t.job)["run"] for t in (a, b)] == [1, 1], "the resume picks the same run on every node"
    resumed = steps_in(metrics_of(a.job))
    assert resumed and resumed[0]["step"] == stopped_at + 1, (stopped_at, resumed[:1])

    # one node's rank dies: the job is CRITICAL, naming that node and rank
    try:
        (pid, env), = wait_for(lambda: ranks_of(b.job), 30, "node b's rank").items()
    except AssertionError:
        log = Path(state_of(b.job)["log"])
        raise AssertionError(f"node b has no rank after the resume; its log ends:\n{log.read_text()[-3000:]}") from None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not ranks_of(b.job), 60, "node b's torchrun to end")
    time.sleep(3)  # torchrun writes its failure summary as it exits
    critical = job_check.check(job, timeout_s=20)
    assert critical.verdict.level == "CRITICAL", critical.verdict.reasons
    named = [r for r in critical.verdict.reasons if r.startswith("node 1 box-b: rank died:")]
    assert named and f"rank {env['RANK']} (local rank 0, pid {pid}) exited with code -9 (SIGKILL)" in named[0], \
        critical.verdict.reasons
    wait_for(lambda: not processes_of(a.job), 120, "node a's ranks to end (the collective lost its peer)")
    crashed = cli(inventory, "health", "-t", "pair", "--on-change", RECORD, env=hooked)
    assert crashed.returncode == 2, crashed.stdout + crashed.stderr
    (call,) = calls(hook_calls)  # the whole job's verdict changed: one call, named after the job
    assert (call["DFLASH_TARGET"], call["DFLASH_OLD_STATE"], call["DFLASH_NEW_STATE"]) == ("pair", "OK", "CRITICAL")
    assert "box-b" in call["DFLASH_REASON"], call

    # health --auto-relaunch relaunches the whole job, never half
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    auto = cli(inventory, "health", "-t", "pair", "--auto-relaunch", env=dict(os.environ))
    assert auto.returncode == 2, auto.stdout + auto.stderr  # the verdict that triggered it
    assert "pair: auto-relaunch of every node succeeded" in auto.stdout, auto.stdout
    assert [len(ranks_of(t.job)) for t in (a, b)] == [1, 1]
    assert [state_of(t.job)["run"] for t in (a, b)] == [1, 1]


@pytest.fixture
def hidden_runs_server(sshd_server, client_key, tmp_path):
    """An sshd whose sessions see an empty tmpfs at tmp_path/shared (a private mount namespace):
    a node on which the runs dir is not the shared one."""
    hidden = tmp_path / "shared"
    hidden.mkdir()
    mount = ("unshare", "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"',
             str(hidden))
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with a tmpfs here: {probe.stderr.strip()}")
    server = sshd_helpers.start_sshd(tmp_path / "sshd-ns", [Path(f"{client_key}.pub")], sshd_server.session_env,
                                     wrap=mount)
    yield server
    server.stop()


def test_refusals_before_anything_stops(pair, hidden_runs_server, client_key, known_hosts, tmp_path, silent_server):
    _, job, nodes = pair
    hosts = tmp_path / "known_hosts_ns"
    hosts.write_text(known_hosts.read_text() + hidden_runs_server.known_hosts_line())
    tag = uuid.uuid4().hex[:6]
    node_c = node_yaml("box-c", hidden_runs_server.port, client_key, hosts, tmp_path / "work-c", tag)
    runs = f"runs_dir: {job.runs_dir}, rdzv_port: {job.rdzv_port}"
    silent = node_yaml("box-silent", silent_server, client_key, hosts, tmp_path / "work-s", tag)
    path = write_inventory(tmp_path / "inventory-refusals.yaml", [*nodes, node_c, silent], {
        "pair": f"{{nodes: [box-a, box-b], {runs}}}",
        "unshared": f"{{nodes: [box-a, box-c], {runs}}}",
        "lost": f"{{nodes: [box-a, box-b], {runs}, rdzv_host: no-such-host.invalid}}",
        "half": f"{{nodes: [box-a, box-silent], {runs}}}",
    })
    jobs = load_inventory(str(path)).multinode
    a, b = jobs["pair"].node_targets()
    # a job "running" on both nodes: a relaunch that stops it would end these sessions
    for target in (a, b):
        with connect(target) as t:
            t.check(f"tmux -L {target.job.tmux_socket} new-session -d -s {target.job.session} sleep 600", timeout=30)

    def untouched():
        for target in (a, b):
            with connect(target) as t:
                assert t.run(f"tmux -L {target.job.tmux_socket} has-session -t ={target.job.session}",
                             timeout=30).ok, f"{target.name}'s session was stopped"
            assert not Path(jobpaths.state_file(target.job)).exists()

    # another trainer release on node b (relaunch --no-deploy keeps what each node has)
    for target in (a, b):
        assert commands.deploy(target).ok
    fake = Path(b.job.workdir) / "releases" / "0.0.9-fake"
    (fake / "trainer").mkdir(parents=True)
    (fake / "trainer" / "__init__.py").write_text("")
    current = Path(jobpaths.current_release(b.job))
    current.unlink()
    current.symlink_to("releases/0.0.9-fake")
    result = cli(path, "relaunch", "-t", "pair", "--no-deploy")
    print("\n$ dflash-ops relaunch -t pair --no-deploy\n" + result.stdout + result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[2/10] same_job ... failed" in result.stdout
    assert "node 1 box-b has trainer release 0.0.9-fake but node 0 box-a has 0.1.0-" in result.stdout
    assert "nothing was stopped on any node" in result.stdout
    assert "[5/10] stop_session ... not-run" in result.stdout  # the plan after the failure is listed, not run
    untouched()

    # a runs dir that node c sees as another (empty) filesystem
    refused = commands.relaunch(jobs["unshared"])
    assert not refused.ok and refused.failed.step == "shared_runs_dir", refused.summary()
    assert f"node 1 box-c does not see the file node 0 box-a wrote in {job.runs_dir}" in refused.failed.message
    assert "is not one shared filesystem: mount the same shared storage" in refused.failed.message
    assert not list(Path(job.runs_dir).glob(".dflash-ops-shared-*")), "the token files are removed"
    untouched()

    # a rendezvous host that does not resolve
    refused = commands.relaunch(jobs["lost"])
    assert not refused.ok and refused.failed.step == "rendezvous", refused.summary()
    assert (f"node 0 box-a cannot reach the rendezvous endpoint no-such-host.invalid:{job.rdzv_port}: dns"
            in refused.failed.message), refused.failed.message
    assert "nothing was stopped on any node" in refused.failed.message
    untouched()

    # a node that does not answer: UNKNOWN within the budget, the other node still shown
    began = time.monotonic()
    status = cli(path, "status", "-t", "half", "--timeout", "4")
    assert time.monotonic() - began < 15, "the budget holds for every node at once"
    assert status.returncode == 3, status.stdout + status.stderr
    assert "\nnode 0: box-a (" in status.stdout and "\nnode 1: box-silent\n" in status.stdout, status.stdout
    lines = status.stdout.splitlines()
    assert any(line.startswith("session ") and "running" in line for line in lines), status.stdout
    assert lines[-1].startswith("UNKNOWN: ") and "node 1 box-silent: [box-silent] probe: " in lines[-1], lines[-1]
    refused = commands.relaunch(jobs["half"])
    assert not refused.ok and refused.failed.step == "preflight", refused.summary()
    assert "node 0 box-a: torch " in refused.failed.message and "node 1 box-silent: FAILED: " in refused.failed.message
    untouched()
