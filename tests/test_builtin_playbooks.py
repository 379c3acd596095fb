"""Built-in commands say which playbook file ran, and a user's file that shadows a built-in one
must declare the options the command's flags set."""
from __future__ import annotations

import pytest

from dflash_ops import ops, playbook
from dflash_ops.errors import InputError

CHECK_ONLY = "description: only checks that the job is stopped\nsteps:\n  - require_job_stopped\n"


def user_dir(tmp_path, name="relaunch", text=CHECK_ONLY):
    d = tmp_path / "playbooks"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(text)
    return d


def test_the_shipped_playbook_is_named_and_not_shadowed():
    loaded = ops.load_book("relaunch", [playbook.SHIPPED_PLAYBOOKS], {"purge": False})
    assert not loaded.shadowed and not loaded.warnings
    assert loaded.describe() == f"ran {playbook.SHIPPED_PLAYBOOKS / 'relaunch.yaml'}"


def test_a_shadowing_file_without_the_flags_option_is_refused_when_the_flag_is_given(tmp_path):
    dirs = [user_dir(tmp_path), playbook.SHIPPED_PLAYBOOKS]
    with pytest.raises(InputError) as info:
        ops.load_book("relaunch", dirs, {"purge": False, "deploy": None})
    message = str(info.value)
    assert message.startswith("--no-purge (option 'purge'): playbook ") and "\n" not in message
    assert str(tmp_path / "playbooks" / "relaunch.yaml") in message and "--no-deploy" not in message


def test_a_shadowing_file_without_the_flags_option_is_warned_about_otherwise(tmp_path):
    loaded = ops.load_book("relaunch", [user_dir(tmp_path), playbook.SHIPPED_PLAYBOOKS], {})
    assert loaded.shadowed and loaded.describe().endswith("(shadows the built-in one)")
    assert len(loaded.warnings) == 1 and "--no-purge" in loaded.warnings[0] and "--fresh" in loaded.warnings[0]


def test_a_playbook_that_is_no_built_in_is_not_called_shadowing(tmp_path):
    d = user_dir(tmp_path, name="my-check")
    loaded = ops.load_book("my-check", [d, playbook.SHIPPED_PLAYBOOKS])
    assert not loaded.shadowed and loaded.describe() == f"ran {d / 'my-check.yaml'}"


def test_auto_relaunch_says_which_file_it_ran(local_target, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_STATE_DIR", str(tmp_path / "state"))
    checked = ops.check(local_target)  # never launched: no session -> CRITICAL
    assert checked.verdict.level == "CRITICAL"
    action = ops.auto_relaunch(local_target, checked, [user_dir(tmp_path), playbook.SHIPPED_PLAYBOOKS])
    assert action.attempted and action.result.ok, action.message
    assert action.message == (f"auto-relaunch succeeded (ran {tmp_path / 'playbooks' / 'relaunch.yaml'} "
                               "(shadows the built-in one))")


def test_a_duplicated_key_in_a_playbook_is_refused():
    text = "steps:\n  - step: require_job_stopped\n    step: deploy\n"
    with pytest.raises(InputError, match=r"pb.yaml: line 3: key 'step' under steps is defined twice"):
        playbook.parse_playbook(text, "pb.yaml")


def test_cli_refuses_the_flag_in_one_line_and_names_the_file_it_runs(tmp_path):
    import os
    import subprocess
    import sys

    inventory = tmp_path / "inv.yaml"
    inventory.write_text(f"targets:\n  here:\n    transport: local\n"
                         f"    job: {{workdir: {tmp_path / 'w'}, python: /usr/bin/python3, config: tiny-cpu}}\n")
    d = user_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_INVENTORY"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dflash_ops", "--inventory", str(inventory), *args],
                              capture_output=True, text=True, env=env, timeout=60)

    refused = cli("--playbook-dir", str(d), "relaunch", "--no-purge", "--dry-run", "-t", "here")
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert len(refused.stderr.strip().splitlines()) == 1 and "--no-purge" in refused.stderr, refused.stderr
    ran = cli("--playbook-dir", str(d), "relaunch", "--dry-run", "-t", "here")
    assert ran.returncode == 0, ran
    assert ran.stdout.splitlines()[0] == f"relaunch: ran {d / 'relaunch.yaml'} (shadows the built-in one)"
    assert "warning: playbook" in ran.stderr and "--no-purge" in ran.stderr
