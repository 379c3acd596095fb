"""Reads and validates the inventory file into an `Inventory`; every mistake is ONE InputError line,
`FILE:LINE: target 'NAME': field 'job.FIELD': what is wrong; how to fix it`. Each layer is checked
where it is written (layers.py), then each merged target as a whole (target.py)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

from trainer.launchers import TORCHRUN
from trainer.typed_yaml import kind_of, show

from dflash_ops.errors import InputError
from dflash_ops.inventory.layers import (
    Fields,
    Lines,
    Where,
    check_layer,
    check_name,
    mapping_or_empty,
    merge,
    unknown_field,
)
from dflash_ops.inventory.rules import (
    HOST_FIELDS,
    JOB_FIELDS,
    PCT_FIELDS,
    REMOTE_PATH_EXAMPLES,
    TARGET_FIELDS,
    TRANSPORTS,
    with_article,
)
from dflash_ops.inventory.target import TargetBuilder
from dflash_ops.job.model import Target
from dflash_ops.inventory import multinode as multinode_inventory
from dflash_ops.inventory.multinode import MultinodeJob
from dflash_ops.inventory.strict_yaml import YamlMap, parse_yaml, read_yaml

ENV_VAR = "DFLASH_OPS_INVENTORY"
LOCAL = "local"
TOP_LEVEL_KEYS = ("defaults", "targets", "groups", "default_target", multinode_inventory.KEY)
# a key written twice there is "target 'box'"
NAMED_ITEMS = {"targets": "target", "groups": "group", multinode_inventory.KEY: "multinode job"}

# The embedded `local` target's job. Thresholds fit the tiny CPU run: its speed depends on the
# machine, so the throughput and GPU-utilisation floors are off; a tiny run that makes no step
# for 5 minutes is stuck.
LOCAL_JOB: Fields = {
    "workdir": "~/.dflash-ops/local",
    "python": sys.executable,
    "config": "tiny-cpu",
    "health": {
        "min_tokens_per_s": 0.0,
        "stall_seconds": 300.0,
        "min_drafter_util_pct": 0.0,
        "max_relaunches_per_hour": 3,
    },
}


@dataclasses.dataclass(frozen=True)
class Inventory:
    targets: dict[str, Target]  # `local` first, then the file's targets in file order
    groups: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    default_target: str = LOCAL  # a target or group name
    source: str | None = None  # the file it was read from; None for the built-in inventory
    # one torchrun job across several targets (multinode_inventory): the commands that act on a
    # job take its name; the others act on one node's target
    multinode: dict[str, MultinodeJob] = dataclasses.field(default_factory=dict)

    def node_of(self, target: str) -> str | None:
        """Why acting on `target` alone would break a multinode job it is a node of, or None."""
        for name, job in self.multinode.items():
            index = next((i for i, node in enumerate(job.nodes) if node.name == target), None)
            if index is not None:
                return (
                    f"{target} is node {index} of the multinode job {name!r}: acting on it alone would "
                    f"break the job on the other nodes; act on the job with -t {name}"
                )
        return None

    def jobs(self, name: str | None = None) -> list[Target | MultinodeJob]:
        """The jobs a --target value names: a multinode job, else each target `resolve` gives."""
        if name is not None and name in self.multinode:
            return [self.multinode[name]]
        return list(self.resolve(name))

    def resolve(self, name: str | None = None) -> list[Target]:
        """Targets for a --target value: a target, or a group's targets in order; None = default."""
        name = self.default_target if name is None else name
        if name in self.targets:
            return [self.targets[name]]
        if name in self.groups:
            return [self.targets[member] for member in self.groups[name]]
        if name in self.multinode:
            nodes = ", ".join(n.name for n in self.multinode[name].nodes)
            raise InputError(
                f"{name!r} is a multinode job: relaunch, stop, gpu-clean, purge-cache, deploy (not its "
                f"--list or --rollback), status, health, tail-log, report and metrics act on it as one "
                f"job; for this command name one of its nodes' targets ({nodes})"
            )
        known = f"known targets: {', '.join(self.targets)}"
        if self.groups:
            known += f"; groups: {', '.join(self.groups)}"
        if self.multinode:
            known += f"; multinode jobs: {', '.join(self.multinode)}"
        raise InputError(
            f"unknown target or group {show(name)} ({known}); pick one of those, "
            f"or add it to {self.source or 'an inventory file (see --inventory)'}"
        )


def find_inventory_file(path: str | None = None) -> str | None:
    """The inventory file, or None for the built-in one: `path`, $DFLASH_OPS_INVENTORY, ./inventory.yaml,
    $XDG_CONFIG_HOME/dflash-ops/inventory.yaml; a file named explicitly must exist."""
    if path:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            raise InputError(f"--inventory {path}: file not found; check the path")
        return path
    from_env = os.path.expanduser(os.environ.get(ENV_VAR, ""))
    if from_env:
        if not os.path.isfile(from_env):
            raise InputError(f"{ENV_VAR}={from_env}: file not found; fix or unset the variable")
        return from_env
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    candidates = ("inventory.yaml", os.path.join(config_home, "dflash-ops", "inventory.yaml"))
    return next((candidate for candidate in candidates if os.path.isfile(candidate)), None)


def load_inventory(path: str | None = None) -> Inventory:
    """Find, read and validate the inventory (see find_inventory_file for the search order)."""
    found = find_inventory_file(path)
    if found is None:
        return builtin_inventory()
    data = read_yaml(found, NAMED_ITEMS)
    return inventory_from_data(data, found, os.path.dirname(os.path.abspath(found)))


def load_inventory_text(
    text: str, filename: str = "inventory.yaml", base_dir: str | None = None
) -> Inventory:
    """Validate inventory YAML given as text; `filename` only names it in messages."""
    return inventory_from_data(parse_yaml(text, filename, NAMED_ITEMS), filename, base_dir or os.getcwd())


def builtin_inventory() -> Inventory:
    return inventory_from_data(YamlMap(), None, os.getcwd())


def inventory_from_data(data: object, filename: str | None, base_dir: str) -> Inventory:
    top = Where(filename or "built-in inventory")
    if data is None:
        raise top.error(
            None,
            None,
            "the file is empty; define 'targets:' (see the example inventory.yaml), "
            "or remove the file to use only the built-in local target",
        )
    data = _top_level(data, top)

    def line_of(key: str) -> int:
        return data.key_lines.get(key, 1)

    defaults, default_lines = _defaults(data.get("defaults"), line_of("defaults"), top)
    raw_targets = mapping_or_empty(
        data.get("targets"),
        "targets",
        line_of("targets"),
        top,
        "{gpu-box: {transport: ssh, host: gpu.example.lan}}",
    )
    targets: dict[str, Target] = {}
    for name in [LOCAL] + [n for n in raw_targets if n != LOCAL]:
        line = raw_targets.key_lines.get(name, raw_targets.line)
        check_name(name, "target", top, line)
        raw = raw_targets.get(name) if name in raw_targets else YamlMap(line)
        where = Where(top.filename, f"target {name!r}")
        targets[name] = _target(name, raw, line, defaults, default_lines, where, base_dir)

    _check_rendezvous(targets, raw_targets, top)
    _check_identities(targets, raw_targets, top)
    groups = _groups(data, targets, top)
    multinode = multinode_inventory.parse(
        data.get(multinode_inventory.KEY), line_of(multinode_inventory.KEY), targets, groups, top.filename
    )
    default_target = data.get("default_target", LOCAL)
    if not isinstance(default_target, str) or default_target not in {**targets, **groups}:
        known = ", ".join(list(targets) + list(groups))
        raise top.error(
            line_of("default_target"),
            "default_target",
            f"{show(default_target)} is not a target or group; use one of: {known}",
        )
    return Inventory(
        targets=targets, groups=groups, default_target=default_target, source=filename, multinode=multinode
    )


def _top_level(data: object, top: Where) -> YamlMap:
    if not isinstance(data, dict):
        raise top.error(
            1,
            None,
            f"expected a mapping with {', '.join(TOP_LEVEL_KEYS)}, got {kind_of(data)}; "
            "see the example inventory.yaml",
        )
    if not isinstance(data, YamlMap):
        data = YamlMap.of(data)
    for key in data:
        if key in TOP_LEVEL_KEYS:
            continue
        why = unknown_field(key, dict.fromkeys(TOP_LEVEL_KEYS), "top.")
        if key in TARGET_FIELDS or key in JOB_FIELDS:
            where = "'defaults:'" if key in TARGET_FIELDS else "'defaults: job:'"
            why = f"unknown top-level key; {key!r} belongs under {where} (or under a target)"
        raise top.error(data.key_lines.get(key), str(key), why)
    return data


def _defaults(raw: object, line: int, top: Where) -> tuple[Fields, Lines]:
    """The `defaults:` layer: it applies to ssh and pct targets only, so its values must be remote ones."""
    defaults_where = Where(top.filename, "defaults")
    raw_defaults = mapping_or_empty(raw, "defaults", line, top, "{user: root, job: {workdir: /root/dflash}}")
    defaults, default_lines = check_layer(raw_defaults, TARGET_FIELDS, defaults_where)
    if defaults.get("transport") == "local":
        raise defaults_where.error(
            default_lines["transport"],
            "transport",
            "defaults apply to ssh and pct targets only; use ssh or pct, or remove it",
        )
    for key, example in REMOTE_PATH_EXAMPLES.items():
        value = defaults.get("job", {}).get(key)
        if value is not None and not value.startswith("/"):
            raise defaults_where.error(
                default_lines[f"job.{key}"],
                f"job.{key}",
                "defaults apply to ssh and pct targets, so this must be an absolute "
                f"path on the target, got {show(value)}; write the full path, "
                f"e.g. {example}",
            )
    return defaults, default_lines


def _check_rendezvous(targets: dict[str, Target], raw_targets: YamlMap, top: Where) -> None:
    """Targets that meet at one torchrun rendezvous must agree on how many hosts meet there."""
    seen: dict[str, list[str]] = {}
    for name, target in targets.items():
        job = target.job
        if job.launcher != TORCHRUN or job.nnodes == 1:
            continue
        members = seen.setdefault(job.rdzv_endpoint, [])
        where = Where(top.filename, f"target {name!r}")
        line = raw_targets.key_lines.get(name)
        if members and targets[members[0]].job.nnodes != job.nnodes:
            first = targets[members[0]].job.nnodes
            raise where.error(
                line,
                "job.nnodes",
                f"is {job.nnodes} but target {members[0]!r} meets at the same "
                f"rdzv_endpoint {job.rdzv_endpoint} with nnodes {first}; give every "
                "host of one torchrun job the same nnodes",
            )
        members.append(name)
        if len(members) > job.nnodes:
            raise where.error(
                line,
                "job.rdzv_endpoint",
                f"{len(members)} targets ({', '.join(members)}) meet at "
                f"{job.rdzv_endpoint} but nnodes is {job.nnodes}; raise "
                "nnodes, or give one job another endpoint",
            )


def _check_identities(targets: dict[str, Target], raw_targets: YamlMap, top: Where) -> None:
    """Two jobs on one machine never share a tmux socket and session (each would stop the other's trainer)."""
    seen: dict[tuple, Target] = {}
    for name, target in targets.items():
        job = target.job
        # where its tmux server lives: this machine, or the host, container and (ssh) user it reaches
        machine = None if target.ssh is None else (target.ssh.host, target.ssh.port, target.ctid)
        user = target.ssh.user if target.ssh is not None and target.transport == "ssh" else None
        key = (machine, user, job.tmux_socket, job.session)
        other = seen.setdefault(key, target)
        if other is target or other.job.workdir == job.workdir:
            continue
        where = Where(top.filename, f"target {name!r}")
        raise where.error(
            raw_targets.key_lines.get(name),
            "job.session",
            f"target {other.name!r} runs another job (workdir {other.job.workdir}, this one "
            f"{job.workdir}) on the same machine with the same tmux socket {job.tmux_socket!r} and "
            f"session {job.session!r}: each would stop the other's trainer; give one of them another "
            "job.session, or leave job.session out (the default is derived from the workdir)",
        )


def _target(
    name: str, raw: object, line: int, defaults: Fields, default_lines: Lines, where: Where, base_dir: str
) -> Target:
    if raw is None and name == LOCAL:  # `local:` alone: keep the built-in local job
        raw = YamlMap(line)
    if raw is None or not isinstance(raw, YamlMap):
        problem = (
            "has no fields" if raw is None else f"expected a mapping of target fields, got {kind_of(raw)}"
        )
        raise where.error(
            line, None, f"{problem}; write e.g. {name}: {{transport: ssh, host: gpu.example.lan}}"
        )
    own, own_lines = check_layer(raw, TARGET_FIELDS, where)
    own_line = raw.line or line

    transport = own.get("transport") or (LOCAL if name == LOCAL else defaults.get("transport"))
    if transport is None:
        raise where.error(
            own_line,
            "transport",
            f"is required: one of {', '.join(TRANSPORTS)} (or set it once under 'defaults:')",
        )
    if name == LOCAL and transport != "local":
        raise where.error(
            own_lines.get("transport", own_line),
            "transport",
            "the name 'local' is reserved for this machine (transport local); "
            "give the remote target another name",
        )

    not_here = {"local": {**HOST_FIELDS, **PCT_FIELDS}, "ssh": PCT_FIELDS, "pct": {}}[transport]
    for key in own:
        if key in not_here:
            fix = (
                "a local target runs on this machine, without ssh; remove it"
                if transport == "local"
                else "it applies only to pct targets; remove it or set transport: pct"
            )
            raise where.error(
                own_lines[key], key, f"does not apply to {with_article(transport)} target ({fix})"
            )

    if transport == "local":
        # The local target does not inherit `defaults:` (those describe remote boxes).
        values = merge({"job": LOCAL_JOB}, own)
        lines = own_lines
    else:
        inherited = {k: v for k, v in defaults.items() if k not in not_here}
        values = merge(inherited, own)
        lines = {**default_lines, **own_lines}
    values["transport"] = transport
    return TargetBuilder(name, values, lines, own_line, where, base_dir).build()


def _groups(data: YamlMap, targets: dict[str, Target], top: Where) -> dict[str, tuple[str, ...]]:
    raw = mapping_or_empty(
        data.get("groups"), "groups", data.key_lines.get("groups", 1), top, "{all: [gpu-box, bare-box]}"
    )
    groups: dict[str, tuple[str, ...]] = {}
    for name, members in raw.items():
        line = raw.key_lines.get(name, raw.line)
        check_name(name, "group", top, line)
        bad = functools.partial(Where(top.filename, f"group {name!r}").error, line, None)
        if name in targets:
            raise bad(f"{name!r} is also a target name; rename the group or the target")
        example = f"{name}: [{', '.join(list(targets)[1:3]) or 'gpu-box'}]"
        if not isinstance(members, list) or not members:
            raise bad(f"expected a non-empty list of target names like {example}, got {kind_of(members)}")
        for member in members:
            if member in raw and member not in targets:
                raise bad(f"lists group {member!r}; a group lists targets only: write its targets here")
            if not isinstance(member, str) or member not in targets:
                raise bad(f"names unknown target {show(member)}; known targets: {', '.join(targets)}")
            if members.count(member) > 1:
                raise bad(f"lists target {member!r} twice; list each target once")
        groups[name] = tuple(members)
    return groups


def describe(inventory: Inventory) -> list[str]:
    """One aligned line per target: name (`*` marks the default), transport, where it runs, GPUs."""
    default_names = {t.name for t in inventory.resolve(None)}
    rows = []
    for target in inventory.targets.values():
        if target.ssh is None:
            where = "this machine"
        else:
            host = f"[{target.ssh.host}]" if ":" in target.ssh.host else target.ssh.host
            where = f"{target.ssh.user}@{host}:{target.ssh.port}"
            if target.ctid is not None:
                where += f" ct {target.ctid}"
            if target.ssh.jump:
                where += f" via {target.ssh.jump.destination()}"
        job = target.job
        if job.gpus:
            gpus = (
                f"target GPUs {','.join(map(str, job.target_gpus)) or '-'}, "
                f"drafter GPUs {','.join(map(str, job.drafter_gpus)) or '-'}"
            )
        else:
            gpus = "no GPUs"
        mark = "*" if target.name in default_names else " "
        rows.append((f"{mark} {target.name}", target.transport, where, gpus))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
