"""Rules live in the steps, so they hold for every way in (a command, a user's playbook, every node
of a multinode job), and their messages name what the user wrote there: the grace floor, the
rollback's release, a deploy whose upload was corrupted."""

from __future__ import annotations

import subprocess
import textwrap
import types
from pathlib import Path

import pytest

from dflash_ops import commands
from dflash_ops.act import deploy as deploy_lib, library
from dflash_ops.job import jobpaths
from dflash_ops.errors import InputError
from dflash_ops.inventory.load import load_inventory_text
from dflash_ops.playbook.user import bind_options, load, run_playbook

try:
    from tests.ops_helpers import ops_argv
    from tests.test_playbook import make_ctx, pb
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from ops_helpers import ops_argv
    from test_playbook import make_ctx, pb

REPO = Path(__file__).resolve().parent.parent


def play(tmp_path: Path, text: str, dry_run: bool = True):
    book = load(str(pb(text, tmp_path)), [], library.LIBRARY)
    return run_playbook(
        book, library.LIBRARY, make_ctx(tmp_path, dry_run=dry_run), bind_options(book, library.LIBRARY, {})
    )


def test_a_playbook_cannot_stop_with_a_grace_under_the_trainers_floor(tmp_path):
    result = play(tmp_path, "steps:\n  - step: stop_session\n    params: {grace_s: 3}\n")
    assert not result.ok and result.exit_code == 2
    assert "grace_s 3 s is shorter than the trainer may need" in result.failed.message
    assert "use grace_s 29 or more" in result.failed.message and "--grace" not in result.failed.message
    assert play(tmp_path, "steps:\n  - step: stop_session\n    params: {grace_s: 29}\n").ok


TWO_NODES = textwrap.dedent("""\
    defaults:
      job: {workdir: /srv/dflash, python: /srv/venv/bin/python3, config: gpu-paper,
            launcher: torchrun, nproc_per_node: 1, drafter_gpus: [0], target_gpus: []}
    targets:
      gpu-a: {transport: ssh, host: 10.0.0.7}
      gpu-b: {transport: ssh, host: 10.0.0.8}
    multinode:
      pair: {nodes: [gpu-a, gpu-b], runs_dir: /r}
    """)


def test_a_two_node_stop_and_relaunch_refuse_a_grace_under_the_floor():
    job = load_inventory_text(TWO_NODES).multinode["pair"]
    for command in (commands.stop, commands.relaunch):
        with pytest.raises(InputError, match=r"--grace 5 s is shorter .* use --grace 29 or more"):
            command(job, grace=5, dry_run=True)
    assert commands.stop(job, grace=29, dry_run=True).ok


def test_the_grace_floor_holds_in_the_step_on_every_node_without_the_commands_own_check(monkeypatch):
    """The command refuses first only to refuse before it connects: the step that signals holds the
    floor itself, on each node of a two-node job, and nothing after it runs."""
    job = load_inventory_text(TWO_NODES).multinode["pair"]
    monkeypatch.setattr(commands, "_check_grace", lambda *_: None)
    for command in (commands.stop, commands.relaunch):
        result = command(job, grace=5, dry_run=True)
        assert not result.ok and result.failed.step == "stop_session", result.summary()
        assert result.exit_code == 2  # a refusal, as on one node
        lines = result.failed.message.splitlines()
        for i, name in enumerate(("gpu-a", "gpu-b")):
            assert lines[i].startswith(f"node {i} {name}: FAILED: grace_s 5 s is shorter"), lines
        assert {s.status for s in result.steps[result.failed.number :]} == {"not-run"}


def test_auto_relaunch_of_a_two_node_job_keeps_the_grace_floor_and_touches_nothing(tmp_path, monkeypatch):
    """The third way in: health --auto-relaunch relaunches with relaunch's default grace, which a
    trainer with a longer stop grace refuses on every node before anything connects."""
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path))
    slow = TWO_NODES.replace("config: gpu-paper,", "config: gpu-paper, train_args: [--set, run.stop_grace_s=45],")
    job = load_inventory_text(slow).multinode["pair"]
    critical = types.SimpleNamespace(verdict=types.SimpleNamespace(level="CRITICAL"))
    action = commands.auto_relaunch(job, critical)
    assert action is not None and action.attempted and action.result is None
    assert action.message.startswith("auto-relaunch FAILED: --grace 30 s is shorter"), action.message


def test_a_playbooks_rollback_names_its_release_parameter_not_a_flag(tmp_path):
    result = play(tmp_path, "steps:\n  - step: rollback\n    params: {release: ../etc}\n")
    assert not result.ok and result.exit_code == 2
    assert "release '../etc': not a release id" in result.failed.message
    assert "--rollback" not in result.failed.message


def test_a_rollback_step_with_no_earlier_release_says_so_without_exit_code_noise(tmp_path):
    result = play(tmp_path, "steps:\n  - rollback\n", dry_run=False)
    assert not result.ok and result.exit_code == 2
    assert result.failed.message == "[box] rollback: no earlier release to roll back to (current: none)"


def test_deploy_rollback_without_an_earlier_release_is_one_line_and_exit_2(tmp_path):
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  local:\n    job: {{workdir: {tmp_path}/w}}\n")
    ran = subprocess.run(
        ops_argv(inventory, "deploy", "--rollback"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert ran.returncode == 2, ran
    assert ran.stderr.strip().splitlines() == [
        "dflash-ops: --rollback: no earlier release to roll back to on local (kept: none); nothing was changed"
    ]
    assert "exit code" not in ran.stdout + ran.stderr


def test_a_corrupted_upload_is_named_a_checksum_mismatch_and_removed(tmp_path, monkeypatch, local_target):
    real = deploy_lib.build_bundle()
    monkeypatch.setattr(deploy_lib, "build_bundle", lambda: deploy_lib.Bundle(real.data, "0" * 64))
    result = commands.deploy(local_target)
    assert not result.ok and result.exit_code == 1
    message = result.failed.message
    assert (
        message.startswith("[local] deploy: checksum mismatch for ") and "the upload was corrupted" in message
    )
    assert "exit code 3" not in message
    assert list(Path(jobpaths.releases_dir(local_target.job)).glob("*.tar.gz")) == []
