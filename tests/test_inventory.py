"""The inventory: the example file, inheritance, groups, file selection, the built-in local target,
and one clear error line for every kind of bad input."""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dflash_ops.inventory import rules as inventory_rules, target as inventory_target
from dflash_ops.errors import InputError
from dflash_ops.inventory.load import (
    ENV_VAR, Inventory, builtin_inventory, describe, load_inventory, load_inventory_text,
)
from dflash_ops.job.model import Health, HostSpec, Job, JumpHost, Target

REAL_BUNDLED_CONFIG_NAMES = inventory_target.bundled_config_names
REPO = Path(__file__).resolve().parent.parent
FILE = "inv.yaml"  # the name error messages must carry

# A valid remote setup the error cases below break one field at a time.
REMOTE_DEFAULTS = """\
defaults:
  job: {workdir: /srv/dflash, python: /srv/venv/bin/python3, config: /srv/dflash/train.yaml}
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No inventory from the developer's environment leaks in; HOME is a fresh folder."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    # Bundled config names are the trainer's business; pin them so these tests do not depend on
    # which files trainer/configs holds today.
    monkeypatch.setattr(inventory_target, "bundled_config_names", lambda: ("gpu-paper", "tiny-cpu"))
    return home


def load(text: str) -> Inventory:
    return load_inventory_text(textwrap.dedent(text), FILE)


def error_of(text: str) -> str:
    with pytest.raises(InputError) as caught:
        load(text)
    message = str(caught.value)
    assert "\n" not in message, "an inventory error must be one line"
    assert message.startswith(FILE + ":"), message
    return message


def line_of(text: str, needle: str) -> int:
    """1-based number of the first line holding `needle` (counted here, not by the loader)."""
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if needle in line)


# --------------------------------------------------------------------------------------------
# The example file


def test_bundled_config_names_are_the_trainer_configs():
    expected = sorted(p.stem for p in (REPO / "trainer" / "configs").glob("*.yaml"))
    assert list(REAL_BUNDLED_CONFIG_NAMES()) == expected


def test_example_inventory_loads_with_inheritance(isolated, monkeypatch):
    # With the real bundled names: the example must only name configs the trainer ships.
    monkeypatch.setattr(inventory_target, "bundled_config_names", REAL_BUNDLED_CONFIG_NAMES)
    inv = load_inventory(str(REPO / "inventory.yaml"))
    assert list(inv.targets) == ["local", "gpu-box", "bare-box"]
    assert inv.groups == {"all": ("gpu-box", "bare-box")}
    assert [t.name for t in inv.resolve()] == ["local"]

    box = inv.targets["gpu-box"]
    assert (box.transport, box.ctid, box.gpu_query_on) == ("pct", 200, "host")
    assert box.ssh == HostSpec(host="pve1.example.lan", port=22, user="root",
                               identity_file=str(isolated / ".ssh" / "id_ed25519"),
                               host_key_policy="strict")
    assert box.job == Job(
        workdir="/root/dflash", python="/root/venv/bin/python3",
        config="/root/dflash/configs/qwen3-8b.yaml",
        log_dir="/root/dflash/logs", cache_dir="/root/dflash/cache",
        target_gpus=(0,), drafter_gpus=(1, 2, 3),
        env=(("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),),
        health=Health(min_tokens_per_s=20000, stall_seconds=900, min_drafter_util_pct=30,
                      max_relaunches_per_hour=3, min_tau=3))

    bare = inv.targets["bare-box"]
    assert bare.transport == "ssh" and bare.ctid is None
    assert (bare.ssh.host, bare.ssh.port, bare.ssh.jump) == ("10.0.0.7", 2222, JumpHost("bastion", 22, "admin"))
    # Its own lists replace the defaults'; its health overrides one threshold and keeps the rest.
    assert (bare.job.target_gpus, bare.job.drafter_gpus) == ((0,), (1,))
    assert bare.job.health == Health(min_tokens_per_s=8000, stall_seconds=900,
                                     min_drafter_util_pct=30, max_relaunches_per_hour=3, min_tau=3)
    # defaults do not reach the local target
    assert inv.targets["local"].job.python == sys.executable


def test_example_inventory_documents_every_field():
    header = "".join(line for line in (REPO / "inventory.yaml").read_text().splitlines(True)
                     if line.startswith("#"))
    documented = [f.name for cls in (Job, Health, HostSpec) for f in dataclasses.fields(cls)
                  if not f.metadata.get("derived")]  # filled in by the loader, never written
    documented += ["ctid", "gpu_query_on", "transport", "defaults", "targets", "groups", "default_target"]
    missing = [name for name in documented if name not in header]
    assert not missing, f"inventory.yaml's header does not explain: {missing}"


def test_schema_covers_exactly_the_model_fields():
    # A field added to model.Job / Health / HostSpec must become settable in the inventory.
    assert set(inventory_rules.JOB_FIELDS) == {f.name for f in dataclasses.fields(Job) if not f.metadata.get("derived")}
    assert set(inventory_rules.HEALTH_FIELDS) == {f.name for f in dataclasses.fields(Health)}
    assert set(inventory_rules.HOST_FIELDS) == {f.name for f in dataclasses.fields(HostSpec)}


# --------------------------------------------------------------------------------------------
# Inheritance


def test_every_field_is_read_into_the_model():
    inv = load("""
        targets:
          box:
            transport: pct
            host: pve.lan
            port: 2200
            user: ops
            identity_file: /keys/id
            jump: jumper@bastion.lan:2022
            host_key_policy: accept-new
            known_hosts_file: /keys/known
            connect_timeout_s: 4.5
            ctid: 123
            gpu_query_on: host
            job:
              workdir: /data/w
              python: /opt/py/bin/python3
              config: gpu-paper
              session: train-1
              log_dir: /data/logs
              cache_dir: /scratch/ind
              target_gpus: [2, 3]
              drafter_gpus: [0, 1, 4]
              tmux_socket: ops-sock
              train_args: [--max-steps, 100, --lr, '6e-4']
              env: {NCCL_DEBUG: INFO, OMP_NUM_THREADS: 8}
              health: {min_tokens_per_s: 1.5, stall_seconds: 60, min_drafter_util_pct: 12, max_relaunches_per_hour: 0}
    """)
    assert inv.targets["box"] == Target(
        name="box", transport="pct", ctid=123, gpu_query_on="host",
        ssh=HostSpec(host="pve.lan", port=2200, user="ops", identity_file="/keys/id",
                     jump=JumpHost("bastion.lan", 2022, "jumper"), host_key_policy="accept-new",
                     known_hosts_file="/keys/known", connect_timeout_s=4.5),
        job=Job(workdir="/data/w", python="/opt/py/bin/python3", config="gpu-paper",
                session="train-1", log_dir="/data/logs", cache_dir="/scratch/ind",
                target_gpus=(2, 3), drafter_gpus=(0, 1, 4), tmux_socket="ops-sock",
                train_args=("--max-steps", "100", "--lr", "6e-4"),
                env=(("NCCL_DEBUG", "INFO"), ("OMP_NUM_THREADS", "8")),
                health=Health(1.5, 60, 12, 0), legacy_session="train-1"))


@pytest.mark.parametrize("text, parsed, destination", [
    ("jump.example", JumpHost("jump.example", 22, None), "jump.example:22"),
    ("ops@jump.example", JumpHost("jump.example", 22, "ops"), "ops@jump.example:22"),
    ("ops@10.0.0.1:2222", JumpHost("10.0.0.1", 2222, "ops"), "ops@10.0.0.1:2222"),
    ("[fe80::1]:2200", JumpHost("fe80::1", 2200, None), "[fe80::1]:2200"),
])
def test_jump_host_is_read_as_user_host_port(text, parsed, destination):
    inv = load(f"""
        targets:
          box:
            transport: ssh
            host: a
            jump: '{text}'
            job: {{workdir: /w, python: /w/py, config: tiny-cpu}}
    """)
    jump = inv.targets["box"].ssh.jump
    assert jump == parsed and jump.destination() == destination


def test_defaults_deep_merge_and_target_wins():
    inv = load("""
        defaults:
          transport: ssh
          user: deploy
          port: 2200
          job:
            workdir: /srv/dflash
            python: /srv/venv/bin/python3
            config: /srv/dflash/train.yaml
            drafter_gpus: [1, 2, 3]
            env: {A: '1', B: '2'}
            health: {stall_seconds: 600, min_tokens_per_s: 100}
        targets:
          plain: {host: a.lan}
          custom:
            host: b.lan
            port: 22
            job:
              workdir: /data/other
              drafter_gpus: [1]
              env: {B: x, C: '3'}
              health: {stall_seconds: 120}
    """)
    plain, custom = inv.targets["plain"], inv.targets["custom"]
    assert (plain.transport, plain.ssh.user, plain.ssh.port) == ("ssh", "deploy", 2200)
    assert plain.job.env == (("A", "1"), ("B", "2"))
    assert plain.job.log_dir == "/srv/dflash/logs"

    assert (custom.ssh.user, custom.ssh.port) == ("deploy", 22)
    assert custom.job.python == "/srv/venv/bin/python3"  # inherited
    assert custom.job.drafter_gpus == (1,)  # a list is replaced, not appended to
    assert dict(custom.job.env) == {"A": "1", "B": "x", "C": "3"}  # a mapping merges key by key
    assert (custom.job.health.stall_seconds, custom.job.health.min_tokens_per_s) == (120, 100)
    # Derived dirs follow the target's own workdir, not the defaults'.
    assert (custom.job.log_dir, custom.job.cache_dir) == ("/data/other/logs", "/data/other/cache")


def test_pct_only_defaults_reach_only_pct_targets():
    inv = load(REMOTE_DEFAULTS + """\
  ctid: 200
  gpu_query_on: host
targets:
  box: {transport: ssh, host: a.lan}
  ct: {transport: pct, host: pve.lan}
""")
    assert (inv.targets["ct"].ctid, inv.targets["ct"].gpu_query_on) == (200, "host")
    assert (inv.targets["box"].ctid, inv.targets["box"].gpu_query_on) == (None, "container")


def test_yaml_anchors_and_merge_keys_are_not_duplicates():
    inv = load(REMOTE_DEFAULTS + """\
targets:
  a: &common {transport: ssh, host: a.lan, port: 2201}
  b:
    <<: *common
    host: b.lan
""")
    assert (inv.targets["b"].ssh.host, inv.targets["b"].ssh.port) == ("b.lan", 2201)


def test_only_true_and_false_are_booleans():
    # YAML 1.1 reads `off` as False; the documented policy value must survive unquoted.
    inv = load(REMOTE_DEFAULTS + """\
targets:
  box: {transport: ssh, host: a.lan, host_key_policy: off, job: {env: {FLAG: yes}}}
""")
    assert inv.targets["box"].ssh.host_key_policy == "off"
    assert inv.targets["box"].job.env == (("FLAG", "yes"),)


def test_hostile_strings_are_kept_exactly(tmp_path):
    hostile = "it's \"q\" $(touch pwned) `touch pwned2` ; rm -rf x ü 日本"
    data = {
        "targets": {"box": {"transport": "ssh", "host": "a.lan", "job": {
            "workdir": "/srv/" + hostile, "python": "/srv/v env/bin/python3",
            "config": "/srv/c $(id).yaml", "session": hostile,
            "train_args": ["--note", hostile, "--multi\nline"],
            "env": {"NOTE": hostile + "\nsecond line"}}}}}
    text = yaml.safe_dump(data, allow_unicode=True)
    job = load_inventory_text(text, FILE).targets["box"].job
    assert job.workdir == "/srv/" + hostile
    assert job.log_dir == "/srv/" + hostile + "/logs"
    assert job.python == "/srv/v env/bin/python3"
    assert job.config == "/srv/c $(id).yaml"
    assert job.session == hostile
    assert job.train_args == ("--note", hostile, "--multi\nline")
    assert job.env == (("NOTE", hostile + "\nsecond line"),)
    assert not list(Path.cwd().iterdir()), "loading must never run anything"


# --------------------------------------------------------------------------------------------
# Groups and the default target


GROUPED = REMOTE_DEFAULTS + """\
targets:
  a: {transport: ssh, host: a.lan}
  b: {transport: ssh, host: b.lan}
  c: {transport: ssh, host: c.lan}
groups:
  backwards: [c, a]
"""


def test_group_fans_out_in_group_order():
    inv = load(GROUPED)
    assert [t.name for t in inv.resolve("backwards")] == ["c", "a"]
    assert [t.name for t in inv.resolve("b")] == ["b"]
    assert [t.name for t in inv.resolve(None)] == ["local"]
    assert [t.name for t in inv.resolve("local")] == ["local"]


def test_default_target_may_be_a_group():
    inv = load(GROUPED + "default_target: backwards\n")
    assert [t.name for t in inv.resolve()] == ["c", "a"]
    assert [t.name for t in load(GROUPED + "default_target: b\n").resolve()] == ["b"]


def test_unknown_name_lists_known_names():
    with pytest.raises(InputError) as caught:
        load(GROUPED).resolve("d")
    message = str(caught.value)
    assert "'d'" in message and "\n" not in message
    for name in ("local", "a", "b", "c", "backwards"):
        assert name in message


# --------------------------------------------------------------------------------------------
# Which file is read


def _inventory_naming(path: Path, target: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"targets:\n  {target}: {{transport: local}}\n")
    return str(path)


def _names(inv: Inventory) -> list[str]:
    return [n for n in inv.targets if n != "local"]


def test_file_precedence(tmp_path, monkeypatch, isolated):
    explicit = _inventory_naming(tmp_path / "explicit.yaml", "from-explicit")
    from_env = _inventory_naming(tmp_path / "env.yaml", "from-env")
    in_cwd = _inventory_naming(Path.cwd() / "inventory.yaml", "from-cwd")
    _inventory_naming(isolated / ".config" / "dflash-ops" / "inventory.yaml", "from-home")
    monkeypatch.setenv(ENV_VAR, from_env)

    assert _names(load_inventory(explicit)) == ["from-explicit"]
    home_file = _inventory_naming(isolated / "inv" / "home.yaml", "from-tilde")
    assert _names(load_inventory("~/inv/home.yaml")) == ["from-tilde"]
    assert load_inventory("~/inv/home.yaml").source == home_file
    assert load_inventory(explicit).source == explicit
    assert _names(load_inventory()) == ["from-env"]
    monkeypatch.delenv(ENV_VAR)
    assert _names(load_inventory()) == ["from-cwd"]
    os.unlink(in_cwd)
    assert _names(load_inventory()) == ["from-home"]
    xdg = tmp_path / "xdg"
    _inventory_naming(xdg / "dflash-ops" / "inventory.yaml", "from-xdg")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    assert _names(load_inventory()) == ["from-xdg"]
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "empty"))
    inv = load_inventory()
    assert list(inv.targets) == ["local"] and inv.source is None


def test_named_file_that_is_missing_is_an_error(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(InputError, match="--inventory .*nope.yaml.*not found"):
        load_inventory(missing)
    monkeypatch.setenv(ENV_VAR, missing)
    with pytest.raises(InputError, match=f"{ENV_VAR}=.*nope.yaml.*not found"):
        load_inventory()


def test_unreadable_files_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_inventory(str(tmp_path))  # a directory is not an inventory file
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("targets: {caf\xe9: {transport: local}}\n".encode("latin-1"))
    with pytest.raises(InputError, match="latin1.yaml: not UTF-8"):
        load_inventory(str(latin1))


# --------------------------------------------------------------------------------------------
# The embedded local target


def test_builtin_local_target_without_any_file(isolated):
    inv = load_inventory()
    assert inv.source is None and inv.groups == {}
    [local] = inv.resolve()
    workdir = str(isolated / ".dflash-ops" / "local")
    assert (local.name, local.transport, local.ssh, local.ctid) == ("local", "local", None, None)
    assert local.job.workdir == workdir
    assert (local.job.log_dir, local.job.cache_dir) == (workdir + "/logs", workdir + "/cache")
    assert local.job.python == sys.executable
    assert (local.job.config, local.job.session) == ("tiny-cpu", f"dflash-{local.job.job_id}")
    assert local.job.legacy_session == "dflash-local"  # what a job launched by an earlier version runs under
    assert local.job.gpus == ()
    # A CPU run's speed depends on the machine and there are no drafter GPUs: those floors are
    # off; a stall is still noticed.
    assert local.job.health.min_tokens_per_s == 0 and local.job.health.min_drafter_util_pct == 0
    assert 0 < local.job.health.stall_seconds <= 900
    assert builtin_inventory().targets == inv.targets


def test_file_overrides_local_job_and_local_paths_resolve_here(tmp_path, isolated, monkeypatch):
    folder = tmp_path / "conf"
    folder.mkdir()
    tool = tmp_path / "bin" / "mypython"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    path = folder / "inventory.yaml"
    path.write_text(textwrap.dedent("""\
        defaults:
          job: {workdir: /srv/dflash, python: /srv/venv/bin/python3, config: /srv/c.yaml, session: remote}
        targets:
          local:
            job: {workdir: ~/w, session: mine, log_dir: runs/logs, config: cfg/my.yaml}
          other-local:
            transport: local
            job: {python: mypython}
    """))
    inv = load_inventory(str(path))
    local = inv.targets["local"]
    assert local.transport == "local"
    assert local.job.workdir == str(isolated / "w")
    assert local.job.session == "mine"
    assert local.job.log_dir == str(folder / "runs" / "logs")  # relative to the inventory's folder
    assert local.job.cache_dir == str(isolated / "w" / "cache")
    assert local.job.config == str(folder / "cfg" / "my.yaml")
    assert local.job.python == sys.executable  # `defaults:` never reaches a local target
    other = inv.targets["other-local"]
    assert other.job.python == str(tool)  # a bare command name is looked up on PATH
    assert (other.job.session, other.job.config) == (f"dflash-{other.job.job_id}", "tiny-cpu")
    assert other.job.session != local.job.session
    assert not (isolated / "w").exists(), "loading must not create anything"


def test_local_may_be_written_without_fields():
    job = load("targets:\n  local:\n").targets["local"].job
    assert (job.session, job.legacy_session) == (f"dflash-{job.job_id}", "dflash-local")


# --------------------------------------------------------------------------------------------
# describe


def test_describe_one_aligned_line_per_target():
    lines = describe(load_inventory(str(REPO / "inventory.yaml")))
    assert len(lines) == 3
    local, gpu_box, bare_box = lines
    assert local.startswith("* local") and "this machine" in local and "no GPUs" in local
    assert gpu_box.startswith("  gpu-box")
    for part in ("pct", "root@pve1.example.lan:22", "ct 200", "target GPUs 0", "drafter GPUs 1,2,3"):
        assert part in gpu_box
    for part in ("ssh", "root@10.0.0.7:2222", "via admin@bastion:22", "drafter GPUs 1"):
        assert part in bare_box
    # transport and location columns start at the same offset on every line
    assert len({line.index(t, 3) for line, t in zip(lines, ("local", "pct", "ssh"))}) == 1
    assert len({line.index(w) for line, w in zip(lines, ("this machine", "root@pve1", "root@10"))}) == 1
    assert all(line == line.rstrip() for line in lines)


def test_describe_marks_the_default_group():
    marked = [line.split()[1] for line in describe(load(GROUPED + "default_target: backwards\n"))
              if line.startswith("*")]
    assert marked == ["a", "c"]


# --------------------------------------------------------------------------------------------
# Bad input: one line naming file:line, the target, the field, and a fix.
# Each case: (id, yaml, target scope or None, field or None, the line's needle, more words).

BOX = REMOTE_DEFAULTS + "targets:\n"


def job_case(name, job_yaml, field, words):
    """A case of one bad `job:` setting on an ssh target: the error names target 'box' and field
    job.<field>, at the line of `box:`."""
    return (name, BOX + f"  box: {{transport: ssh, host: a, job: {{{job_yaml}}}}}\n", "box", f"job.{field}", "box:", words)


CASES = [
    ("unknown-key", BOX + "  box: {transport: ssh, hots: a.lan}\n", "box", "hots", "hots", ["did you mean 'host'"]),
    ("unknown-job-key", BOX + "  box:\n    transport: ssh\n    host: a\n    job:\n      sesion: x\n",
     "box", "job.sesion", "sesion", ["did you mean 'session'"]),
    ("job-key-on-target", BOX + "  box: {transport: ssh, host: a, workdir: /w}\n", "box", "workdir", "workdir: /w",
     ["under 'job:'"]),
    ("unknown-top-level", REMOTE_DEFAULTS + "target:\n  box: {transport: ssh, host: a}\n", None, "target",
     "target:", ["did you mean 'targets'"]),
    ("port-text", BOX + "  box: {transport: ssh, host: a, port: abc}\n", "box", "port", "port", ["whole number", "'abc'"]),
    ("port-bool", BOX + "  box: {transport: ssh, host: a, port: true}\n", "box", "port", "port", ["boolean"]),
    ("port-range", BOX + "  box: {transport: ssh, host: a, port: 70000}\n", "box", "port", "port", ["65535"]),
    ("ctid-low", BOX + "  box: {transport: pct, host: a, ctid: 5}\n", "box", "ctid", "ctid", ["100"]),
    ("gpus-not-list", BOX + "  box: {transport: ssh, host: a, job: {target_gpus: 0}}\n", "box", "job.target_gpus",
     "target_gpus", ["[0, 1]"]),
    ("gpus-negative", BOX + "  box: {transport: ssh, host: a, job: {drafter_gpus: [1, -1]}}\n", "box",
     "job.drafter_gpus", "drafter_gpus", [">= 0"]),
    ("gpus-text", BOX + "  box: {transport: ssh, host: a, job: {drafter_gpus: ['1']}}\n", "box",
     "job.drafter_gpus", "drafter_gpus", ["'1'"]),
    ("gpus-bool", BOX + "  box: {transport: ssh, host: a, job: {drafter_gpus: [true]}}\n", "box",
     "job.drafter_gpus", "drafter_gpus", ["boolean"]),
    ("gpus-repeated", BOX + "  box: {transport: ssh, host: a, job: {drafter_gpus: [1, 2, 1]}}\n", "box",
     "job.drafter_gpus", "drafter_gpus", ["GPU 1 is listed twice"]),
    ("gpu-two-roles", "defaults:\n  job: {workdir: /w, python: /p, config: tiny-cpu, target_gpus: [0, 1]}\n"
     "targets:\n  box: {transport: ssh, host: a, job: {drafter_gpus: [2, 1]}}\n", "box", "job.drafter_gpus", "drafter_gpus",
     ["GPU 1 is in both target_gpus and drafter_gpus; give each GPU one role"]),
    ("ssh-without-host", BOX + "  box: {transport: ssh}\n", "box", "host", "box:", ["required", "host:"]),
    ("pct-without-host", BOX + "  box: {transport: pct, ctid: 200}\n", "box", "host", "box:", ["Proxmox host"]),
    ("pct-without-ctid", BOX + "  box: {transport: pct, host: pve}\n", "box", "ctid", "box:", ["ctid: 200"]),
    ("ctid-on-ssh", BOX + "  box: {transport: ssh, host: a, ctid: 200}\n", "box", "ctid", "box:",
     ["only to pct targets"]),
    ("host-on-local", "targets:\n  mine: {transport: local, host: a}\n", "mine", "host", "mine:", ["local target"]),
    ("unknown-transport", BOX + "  box: {transport: docker, host: a}\n", "box", "transport", "box:",
     ["local, ssh, pct", "'docker'"]),
    ("no-transport", BOX + "  box: {host: a}\n", "box", "transport", "box:", ["required"]),
    ("local-not-local", BOX + "  local: {transport: ssh, host: a}\n", "local", "transport", "local:", ["reserved"]),
    ("duplicate-target", BOX + "  box: {transport: ssh, host: a}\n  other: {transport: ssh, host: b}\n"
     "  box: {transport: ssh, host: c}\n", None, None, "host: c", ["target 'box' is defined twice", "line 4"]),
    ("duplicate-field", BOX + "  box:\n    transport: ssh\n    host: a\n    host: b\n", None, None, "host: b",
     ["key 'host' under targets.box is defined twice"]),
    ("group-is-target", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  box: [box]\n", "group 'box'", None,
     "box: [box]", ["also a target"]),
    ("group-named-local", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  local: [box]\n", "group 'local'",
     None, "local: [box]", ["also a target"]),
    ("group-unknown-member", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  all: [box, nope]\n", "group 'all'",
     None, "all:", ["unknown target 'nope'", "box"]),
    ("group-of-groups", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  g1: [box]\n  g2: [g1]\n", "group 'g2'",
     None, "g2:", ["targets only"]),
    ("group-empty", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  all: []\n", "group 'all'", None,
     "all:", ["non-empty list"]),
    ("group-not-list", BOX + "  box: {transport: ssh, host: a}\ngroups:\n  all: box\n", "group 'all'", None,
     "all:", ["list of target names"]),
    ("host-key-policy", BOX + "  box: {transport: ssh, host: a, host_key_policy: lax}\n", "box", "host_key_policy",
     "box:", ["strict, accept-new, off"]),
    job_case("relative-workdir", "workdir: dflash", "workdir", ["absolute", "/root/dflash"]),
    job_case("tilde-workdir", "workdir: ~/dflash", "workdir", ["absolute"]),
    job_case("relative-python", "python: python3", "python", ["absolute", "non-login"]),
    job_case("relative-log-dir", "log_dir: logs", "log_dir", ["absolute"]),
    job_case("relative-cache-dir", "cache_dir: cache", "cache_dir", ["absolute"]),
    ("relative-default-workdir", "defaults:\n  job: {workdir: dflash}\n", "defaults", "job.workdir", "workdir",
     ["absolute"]),
    job_case("relative-config", "config: configs/x.yaml", "config", ["absolute", "tiny-cpu"]),
    job_case("unknown-bundled-config", "config: tiny-gpu", "config", ["bundled", "tiny-cpu", "gpu-paper"]),
    job_case("session-dot", "session: v1.2", "session", ["'.' and ':'"]),
    job_case("session-colon", "session: 'a:b'", "session", ["'.' and ':'"]),
    job_case("session-newline", 'session: "a\\nb"', "session", ["control character"]),
    job_case("session-format", "session: 'job#{pane_pid}'", "session", ["tmux format"]),
    job_case("session-empty", "session: ''", "session", ["empty"]),
    job_case("socket-path", "tmux_socket: /tmp/s", "tmux_socket", ["NAME"]),
    job_case("stall-zero", "health: {stall_seconds: 0}", "health.stall_seconds", ["> 0"]),
    job_case("tokens-negative", "health: {min_tokens_per_s: -5}", "health.min_tokens_per_s", [">= 0"]),
    job_case("util-over-100", "health: {min_drafter_util_pct: 130}", "health.min_drafter_util_pct", ["at most 100"]),
    job_case("tau-negative", "health: {min_tau: -1}", "health.min_tau", [">= 0"]),
    job_case("relaunches-negative", "health: {max_relaunches_per_hour: -1}", "health.max_relaunches_per_hour", ["between 0"]),
    job_case("stall-text", "health: {stall_seconds: 15m}", "health.stall_seconds", ["number", "'15m'"]),
    job_case("stall-infinite", "health: {stall_seconds: .inf}", "health.stall_seconds", ["finite"]),
    ("connect-timeout-zero", BOX + "  box: {transport: ssh, host: a, connect_timeout_s: 0}\n", "box",
     "connect_timeout_s", "box:", ["> 0"]),
    job_case("health-key-in-job", "stall_seconds: 5", "stall_seconds", ["health"]),
    job_case("cache-is-workdir", "cache_dir: /srv/dflash", "cache_dir", ["workdir", "purged"]),
    job_case("cache-above-logs", "log_dir: /srv/x/logs, cache_dir: /srv/x", "cache_dir", ["log_dir"]),
    job_case("cache-is-runs", "cache_dir: /srv/dflash/runs", "cache_dir", ["runs (checkpoints)", "purged"]),
    job_case("cache-in-a-run", "cache_dir: /srv/dflash/runs/0001/c", "cache_dir", ["inside the runs"]),
    job_case("cache-dotdot-legacy-run", "cache_dir: /srv/dflash/cache/../run", "cache_dir", ["run dir of earlier versions"]),
    job_case("cache-dotdot-runs", "cache_dir: /srv/dflash/cache/../runs", "cache_dir", ["runs (checkpoints)"]),
    job_case("cache-is-releases", "cache_dir: /srv/dflash/releases", "cache_dir", ["releases"]),
    job_case("cache-is-current", "cache_dir: /srv/dflash/current", "cache_dir", ["current release"]),
    job_case("cache-in-logs", "cache_dir: /srv/dflash/logs/c", "cache_dir", ["inside the log_dir"]),
    job_case("cache-is-python-prefix", "python: /opt/venv/bin/python3, cache_dir: /opt/venv", "cache_dir", ["contains the python prefix (/opt/venv)"]),
    job_case("cache-in-python-lib", "python: /opt/venv/bin/python3, cache_dir: /opt/venv/lib/c", "cache_dir", ["inside the python's lib"]),
    job_case("cache-root", "cache_dir: /tmp", "cache_dir", ["too close to '/'"]),
    job_case("env-bad-name", "env: {BAD-NAME: x}", "env", ["'BAD-NAME'"]),
    job_case("env-bool", "env: {FLAG: true}", "env", ["FLAG", "quote"]),
    job_case("train-args-float", "train_args: [--lr, 6.0e-4]", "train_args", ["quote"]),
    ("host-option", BOX + "  box: {transport: ssh, host: -oProxyCommand=x}\n", "box", "host", "box:", ["option"]),
    ("host-with-user", BOX + "  box: {transport: ssh, host: root@a}\n", "box", "host", "box:", ["'user:'"]),
    ("jump-malformed", BOX + "  box: {transport: ssh, host: a, jump: 'a b@c'}\n", "box", "jump", "box:",
     ["user@host:port"]),
    ("bad-target-name", BOX + "  'my box': {transport: ssh, host: a}\n", None, None, "my box", ["'my box'", "letters"]),
    ("target-not-mapping", BOX + "  box: a.lan\n", "box", None, "box:", ["mapping"]),
    ("target-empty", BOX + "  box:\n", "box", None, "box:", ["no fields"]),
    ("missing-python", "targets:\n  box: {transport: ssh, host: a, job: {workdir: /w, config: tiny-cpu}}\n", "box",
     "job.python", "box:", ["required"]),
    ("default-target-unknown", BOX + "  box: {transport: ssh, host: a}\ndefault_target: bx\n", None,
     "default_target", "default_target", ["'bx'", "box", "local"]),
    ("targets-not-mapping", "targets: [a, b]\n", None, "targets", "targets", ["mapping"]),
]


@pytest.mark.parametrize("text, scope, field, needle, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line(text, scope, field, needle, words):
    message = error_of(text)
    assert message.startswith(f"{FILE}:{line_of(text, needle)}: "), message
    if scope:
        expected_scope = scope if scope.startswith(("group", "defaults")) else f"target '{scope}'"
        assert f": {expected_scope}: " in message, message
    if field:
        assert f"field '{field}'" in message, message
    for word in words:
        assert word in message, message


def test_line_numbers_point_at_the_inherited_value():
    # A relative workdir in defaults is reported in `defaults`, at its own line.
    text = "targets:\n  box: {transport: ssh, host: a}\ndefaults:\n  job:\n    workdir: rel\n"
    assert error_of(text).startswith(f"{FILE}:5: defaults: field 'job.workdir'")


def test_not_yaml_names_the_line():
    message = error_of("targets:\n  box: {transport: ssh\n  other: [\n")
    assert "not valid YAML" in message
    line = int(message.split(":")[1])
    assert 2 <= line <= 4, message


def test_not_a_mapping_and_empty_files():
    assert "got a list" in error_of("- a\n- b\n")
    assert "got the text 'hello'" in error_of("hello\n")
    assert "empty" in error_of("")
    assert "empty" in error_of("# only a comment\n")


def test_each_error_case_is_rejected_and_the_fixed_file_loads():
    # The cases must fail for the reason they name: the base they break loads fine.
    assert list(load(BOX + "  box: {transport: ssh, host: a}\n").targets) == ["local", "box"]
    assert load(BOX + "  box: {transport: pct, host: pve, ctid: 200}\n").targets["box"].ctid == 200
