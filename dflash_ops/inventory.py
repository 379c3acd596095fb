"""The inventory: which targets exist, how to reach them, and the job each one runs.

`load_inventory()` finds and reads the inventory file (its format is documented at the top of the
example `inventory.yaml` in the repository root), validates it and returns an `Inventory` of
`model.Target` objects. Every mistake in the file is reported as ONE `InputError` line:
`FILE:LINE: target 'NAME': field 'job.FIELD': what is wrong; how to fix it`.

Validation happens in two passes: each layer (`defaults:`, each target) is checked on its own, so
a bad value is reported where it is written; then each target is merged with what it inherits and
checked as a whole (required fields, transport-specific rules, GPU roles, path safety).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import posixpath
import re
import shutil
import sys
from importlib.util import find_spec
from typing import Callable

from . import jobpaths
from .strict_yaml import _Map, parse_yaml, read_yaml
from .errors import InputError
from .model import Health, HostSpec, Job, Target

ENV_VAR = "DFLASH_OPS_INVENTORY"
LOCAL = "local"
TRANSPORTS = ("local", "ssh", "pct")
HOST_KEY_POLICIES = ("strict", "accept-new", "off")
GPU_QUERY_ON = ("container", "host")
TOP_LEVEL_KEYS = ("defaults", "targets", "groups", "default_target")

# The embedded `local` target's job. Thresholds fit the tiny CPU run: its speed depends on the
# machine, so the throughput and GPU-utilisation floors are off; a tiny run that makes no step
# for 5 minutes is stuck.
LOCAL_JOB = {
    "workdir": "~/.dflash-ops/local",
    "python": sys.executable,
    "config": "tiny-cpu",
    "session": "dflash-local",
    "health": {
        "min_tokens_per_s": 0.0,
        "stall_seconds": 300.0,
        "min_drafter_util_pct": 0.0,
        "max_relaunches_per_hour": 3,
    },
}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JUMP = re.compile(r"(?:(?P<user>[^@\s:]+)@)?(?P<host>[^@\s:/\[\]]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d+))?\Z")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiosx" else "a ") + word  # "an ssh", "a pct", "a local"


# ---------------------------------------------------------------------------------------------
# Field rules. Each takes the YAML value and returns the clean value, or raises _Bad with
# "what is wrong; how to fix it" (the caller adds file, line, target and field).


class _Bad(Exception):
    pass


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the text {_show(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({value})"


def _text(value, example: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected text like {example}, got {_kind(value)}")
    if not value:
        raise _Bad(f"is empty; write it like {example}")
    if _CONTROL.search(value):
        raise _Bad(f"contains a control character (newline, tab ...) in {_show(value)}; remove it")
    return value


def _whole(lo: int, hi: int, example: str) -> Callable:
    def rule(value) -> int:
        # bool is an int subclass in Python: `port: true` must not become port 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"expected a whole number like {example}, got {_kind(value)}")
        if not lo <= value <= hi:
            raise _Bad(f"must be between {lo} and {hi}, got {value}")
        return value

    return rule


def _number(example: str, zero_ok: bool, most: float | None = None) -> Callable:
    def rule(value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad(f"expected a number like {example}, got {_kind(value)}")
        if not math.isfinite(value):
            raise _Bad(f"must be a finite number like {example}, got {value}")
        if value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0 (0 turns the check off)" if zero_ok else "> 0"
            raise _Bad(f"must be {bound}, got {value}")
        if most is not None and value > most:
            raise _Bad(f"must be at most {most:g}, got {value}")
        return float(value)

    return rule


def _choice(options: tuple[str, ...]) -> Callable:
    def rule(value) -> str:
        if isinstance(value, str) and value in options:
            return value
        close = difflib.get_close_matches(str(value), options, n=1) if isinstance(value, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise _Bad(f"must be one of {', '.join(options)}, got {_kind(value)}{hint}")

    return rule


def _host(value) -> str:
    value = _text(value, "pve1.example.lan")
    if value.startswith("-"):
        raise _Bad(f"a host name cannot start with '-' ({_show(value)}); ssh would read it as an option")
    if any(c.isspace() for c in value):
        raise _Bad(f"a host name has no spaces, got {_show(value)}")
    if "@" in value:
        raise _Bad(f"write only the host here and the user in 'user:' (got {_show(value)})")
    return value


def _user(value) -> str:
    value = _text(value, "root")
    if value.startswith("-") or any(c.isspace() or c in "@:" for c in value):
        raise _Bad(f"a user name has no spaces, '@' or ':' and does not start with '-', got {_show(value)}")
    return value


def split_jump(value: str) -> tuple[str | None, str, int] | None:
    """`user@host:port` (user and port optional; an IPv6 host in brackets) -> (user, host, port),
    None when it is not one; a port outside 1..65535 is returned as given, for the caller to name."""
    match = _JUMP.match(value)
    if not match or match["host"].startswith("-") or (match["user"] or "").startswith("-"):
        return None
    return match["user"], match["host"].strip("[]"), int(match["port"] or 22)


def _jump(value) -> str:
    value = _text(value, "admin@bastion:22")
    parts = split_jump(value)
    if parts is None:
        raise _Bad(f"expected 'user@host:port' (user and port optional), got {_show(value)}")
    if not 1 <= parts[2] <= 65535:
        raise _Bad(f"port must be between 1 and 65535, got {parts[2]}")
    return value


def _path(value) -> str:
    return _text(value, "/root/dflash")


def _config(value) -> str:
    return _text(value, "/root/dflash/configs/qwen3-8b.yaml or tiny-cpu")


def _session(value) -> str:
    value = _text(value, "dflash")
    if "." in value or ":" in value:
        raise _Bad(f"tmux refuses '.' and ':' in session names, got {_show(value)}; use e.g. 'dflash-train'")
    if "#{" in value:
        raise _Bad(
            f"'#{{' starts a tmux format that tmux would expand in the name, got {_show(value)}; "
            "use e.g. 'dflash-train'"
        )
    return value


def _socket(value) -> str:
    value = _text(value, "dflash")
    if "/" in value:
        raise _Bad(f"is a tmux socket NAME (tmux -L), not a path, got {_show(value)}; drop the '/'")
    return value


def _gpus(value) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _Bad(f"expected a list of GPU indices like [0, 1], got {_kind(value)}")
    for gpu in value:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise _Bad(f"GPU indices are whole numbers >= 0, got {_kind(gpu)}; write it like [0, 1]")
    for gpu in value:
        if value.count(gpu) > 1:
            raise _Bad(f"GPU {gpu} is listed twice; list each GPU once")
    return tuple(value)


def _train_args(value) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _Bad(f"expected a list of arguments like ['--max-steps', '100'], got {_kind(value)}")
    args = []
    for arg in value:
        # Whole numbers convert exactly; a float would be re-spelled (6.0e-4 -> 0.0006), so it
        # must be quoted to reach the trainer as written.
        if isinstance(arg, int) and not isinstance(arg, bool):
            arg = str(arg)
        if not isinstance(arg, str):
            raise _Bad(f"each argument must be text, got {_kind(arg)}; quote it, e.g. '6e-4'")
        if "\x00" in arg:
            raise _Bad("an argument cannot contain a NUL character; remove it")
        args.append(arg)
    return tuple(args)


def _env(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _Bad(
            f"expected a mapping of NAME: value like {{CUDA_LAUNCH_BLOCKING: '1'}}, got {_kind(value)}"
        )
    env = {}
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise _Bad(
                f"environment variable names are letters, digits and '_' (not starting "
                f"with a digit), got {_show(name)}"
            )
        if isinstance(val, int) and not isinstance(val, bool):
            val = str(val)
        if not isinstance(val, str):
            raise _Bad(f"the value of {name} must be text, got {_kind(val)}; quote it, e.g. {name}: '1'")
        if "\x00" in val:
            raise _Bad(f"the value of {name} cannot contain a NUL character; remove it")
        env[name] = val
    return env


def _endpoint(value) -> str:
    value = _text(value, "10.0.0.7:29400")
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or host.startswith("-")
        or any(c.isspace() for c in host)
        or not port.isdigit()
        or not 1 <= int(port) <= 65535
    ):
        raise _Bad(f"expected HOST:PORT of the rendezvous host, like 10.0.0.7:29400, got {_show(value)}")
    return value


LAUNCHERS = ("threads", "torchrun")
_TORCHRUN_FIELDS = ("nproc_per_node", "nnodes", "rdzv_endpoint")
_HEALTH_FIELDS: dict = {
    "min_tokens_per_s": _number("20000", zero_ok=True),
    "stall_seconds": _number("900", zero_ok=False),
    "min_drafter_util_pct": _number("30", zero_ok=True, most=100),
    "max_relaunches_per_hour": _whole(0, 60, "3"),
    "min_tau": _number("3", zero_ok=True, most=64),
}
_JOB_FIELDS: dict = {
    "workdir": _path,
    "python": _path,
    "config": _config,
    "session": _session,
    "log_dir": _path,
    "cache_dir": _path,
    "target_gpus": _gpus,
    "drafter_gpus": _gpus,
    "tmux_socket": _socket,
    "train_args": _train_args,
    "env": _env,
    "health": _HEALTH_FIELDS,
    "launcher": _choice(LAUNCHERS),
    "nproc_per_node": _whole(1, 64, "2"),
    "nnodes": _whole(1, 4096, "2"),
    "rdzv_endpoint": _endpoint,
}
_HOST_FIELDS: dict = {
    "host": _host,
    "port": _whole(1, 65535, "22"),
    "user": _user,
    "identity_file": _path,
    "jump": _jump,
    "host_key_policy": _choice(HOST_KEY_POLICIES),
    "known_hosts_file": _path,
    "connect_timeout_s": _number("10", zero_ok=False),
}
# Proxmox allows container ids from 100 up.
_PCT_FIELDS: dict = {"ctid": _whole(100, 999_999_999, "200"), "gpu_query_on": _choice(GPU_QUERY_ON)}
_TARGET_FIELDS: dict = {"transport": _choice(TRANSPORTS), **_HOST_FIELDS, **_PCT_FIELDS, "job": _JOB_FIELDS}
_REMOTE_PATH_EXAMPLES = {
    "workdir": "/root/dflash",
    "python": "/root/venv/bin/python3",
    "log_dir": "/root/dflash/logs",
    "cache_dir": "/root/dflash/cache",
}


# ---------------------------------------------------------------------------------------------
# Checking layers and building targets.


@dataclasses.dataclass
class _Where:
    """Where in the file we are, to prefix error messages."""

    filename: str
    scope: str = ""  # "target 'gpu-box'", "defaults", "group 'all'" or "" for the top level

    def error(self, line: int | None, field: str | None, problem: str) -> InputError:
        parts = [f"{self.filename}:{line}" if line else self.filename]
        if self.scope:
            parts.append(self.scope)
        if field:
            parts.append(f"field {field!r}")
        return InputError(": ".join(parts + [problem]))


def _unknown_field(key, schema: dict, prefix: str) -> str:
    if not isinstance(key, str):
        return f"{_show(key)} is not a field name; known fields: {', '.join(schema)}"
    if prefix == "" and key in _JOB_FIELDS:
        return f"unknown field here; {key!r} is a job field: put it under 'job:'"
    if prefix == "job." and key in _TARGET_FIELDS:
        return f"unknown field here; {key!r} is a target field: move it out of 'job:'"
    if prefix == "job." and key in _HEALTH_FIELDS:
        return f"unknown field here; {key!r} is a health threshold: put it under 'job: health:'"
    close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(schema)}"
    return f"unknown field; {hint}"


def _unknown_top_level(key) -> str:
    if key in _TARGET_FIELDS or key in _JOB_FIELDS:
        where = "'defaults:'" if key in _TARGET_FIELDS else "'defaults: job:'"
        return f"unknown top-level key; {key!r} belongs under {where} (or under a target)"
    return _unknown_field(key, dict.fromkeys(TOP_LEVEL_KEYS), "top.")


def _check_layer(raw: _Map, schema: dict, where: _Where, prefix: str = "") -> tuple[dict, dict]:
    """Check one mapping's keys and value types. Returns (clean values, {dotted field: line})."""
    values: dict = {}
    lines: dict = {}
    for key, value in raw.items():
        field = f"{prefix}{key}"
        line = raw.key_lines.get(key, raw.line)
        rule = schema.get(key) if isinstance(key, str) else None
        if rule is None:
            raise where.error(line, field, _unknown_field(key, schema, prefix))
        lines[field] = line
        if isinstance(rule, dict):
            if value is None:  # `health:` with nothing under it
                value = _Map(line)
            if not isinstance(value, dict):
                raise where.error(
                    line, field, f"expected a mapping of {key} fields ({', '.join(rule)}), got {_kind(value)}"
                )
            values[key], sub_lines = _check_layer(value, rule, where, field + ".")
            lines.update(sub_lines)
        else:
            try:
                values[key] = rule(value)
            except _Bad as e:
                raise where.error(line, field, str(e)) from None
    return values, lines


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, everything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _strip_slashes(path: str) -> str:
    return path.rstrip("/") or "/"


def bundled_config_names() -> tuple[str, ...]:
    """Names of the configs shipped in trainer/configs (found without importing the trainer)."""
    spec = find_spec("trainer")
    names: set[str] = set()
    for folder in (spec.submodule_search_locations or []) if spec else []:
        configs = os.path.join(folder, "configs")
        if os.path.isdir(configs):
            names.update(f[:-5] for f in os.listdir(configs) if f.endswith(".yaml"))
    return tuple(sorted(names))


def _is_config_name(config: str) -> bool:
    return "/" not in config and not config.endswith((".yaml", ".yml")) and not config.startswith("~")


class _TargetBuilder:
    """Turns one target's merged fields into a model.Target, checking the whole-target rules."""

    def __init__(self, name: str, values: dict, lines: dict, own_line: int, where: _Where, base_dir: str):
        self.name, self.values, self.lines, self.own_line = name, values, lines, own_line
        self.where, self.base_dir = where, base_dir
        self.transport = values["transport"]
        self.remote = self.transport != "local"

    def fail(self, field: str, problem: str) -> InputError:
        return self.where.error(self.lines.get(field, self.own_line), field, problem)

    def build(self) -> Target:
        ssh = self.host_spec() if self.remote else None
        ctid = self.values.get("ctid")
        if self.transport == "pct" and ctid is None:
            raise self.fail("ctid", "is required for a pct target: the Proxmox container id, e.g. ctid: 200")
        return Target(
            name=self.name,
            transport=self.transport,
            job=self.job(),
            ssh=ssh,
            ctid=ctid if self.transport == "pct" else None,
            gpu_query_on=self.values.get("gpu_query_on", "container"),
        )

    def local_file(self, path: str | None) -> str | None:
        """A path on THIS machine: `~` expanded, relative paths taken from the inventory's folder."""
        if path is None:
            return None
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(path)))

    def host_spec(self) -> HostSpec:
        v = self.values
        if "host" not in v:
            raise self.fail(
                "host",
                f"is required for {_a(self.transport)} target: the "
                + ("Proxmox host" if self.transport == "pct" else "machine")
                + " to ssh to, e.g. host: pve1.example.lan",
            )
        return HostSpec(
            host=v["host"],
            port=v.get("port", 22),
            user=v.get("user", "root"),
            identity_file=self.local_file(v.get("identity_file")),
            jump=v.get("jump"),
            host_key_policy=v.get("host_key_policy", "strict"),
            known_hosts_file=self.local_file(v.get("known_hosts_file")),
            connect_timeout_s=v.get("connect_timeout_s", 10.0),
        )

    def job_path(self, key: str, value: str) -> str:
        field = f"job.{key}"
        if not self.remote:
            return self.local_file(value)
        if not value.startswith("/"):
            why = (
                "the remote shell is non-login: no PATH from your profile, no venv activation"
                if key == "python"
                else "'~' and relative paths are not expanded on the target"
            )
            example = _REMOTE_PATH_EXAMPLES[key]
            raise self.fail(
                field,
                f"must be an absolute path on the target, got {_show(value)}; "
                f"write the full path, e.g. {example} ({why})",
            )
        return _strip_slashes(value)

    def job_python(self, python: str) -> str:
        if self.remote or "/" in python or python.startswith("~"):
            return self.job_path("python", python)
        found = shutil.which(python)  # a bare command name on this machine
        if not found:
            raise self.fail(
                "job.python", f"{python!r} is not found on PATH; give the full path of the interpreter"
            )
        return found

    def job_config(self, config: str) -> str:
        if _is_config_name(config):
            bundled = bundled_config_names()
            if bundled and config not in bundled:
                raise self.fail(
                    "job.config",
                    f"{config!r} is not a bundled config (bundled: {', '.join(bundled)}); "
                    "use one of those or give the path of a config file",
                )
            return config
        if not self.remote:
            return self.local_file(config)
        if not config.startswith("/"):
            raise self.fail(
                "job.config",
                f"a config file on the target needs an absolute path, got {_show(config)}; write "
                "e.g. /root/dflash/configs/qwen3-8b.yaml, or use a bundled name like tiny-cpu",
            )
        return config

    def job(self) -> Job:
        job = self.values.get("job", {})
        for key in ("workdir", "python", "config"):
            if key not in job:
                raise self.fail(
                    f"job.{key}", "is required; set it under this target's 'job:' or under 'defaults: job:'"
                )
        workdir = _strip_slashes(self.job_path("workdir", job["workdir"]))
        join = posixpath.join if self.remote else os.path.join

        def own_dir(key: str, default: str) -> str:
            return _strip_slashes(self.job_path(key, job[key])) if key in job else join(workdir, default)

        log_dir, cache_dir = own_dir("log_dir", "logs"), own_dir("cache_dir", "cache")
        python = self.job_python(job["python"])
        self.check_cache_dir(workdir, log_dir, cache_dir, python)
        target_gpus, drafter_gpus = job.get("target_gpus", ()), job.get("drafter_gpus", ())
        for gpu in drafter_gpus:
            if gpu in target_gpus:
                raise self.fail(
                    "job.drafter_gpus",
                    f"GPU {gpu} is in both target_gpus and drafter_gpus; give each GPU one role",
                )
        self.check_launcher(job)
        return Job(
            workdir=workdir,
            python=python,
            config=self.job_config(job["config"]),
            session=job.get("session", "dflash"),
            log_dir=log_dir,
            cache_dir=cache_dir,
            target_gpus=tuple(target_gpus),
            drafter_gpus=tuple(drafter_gpus),
            tmux_socket=job.get("tmux_socket", "dflash"),
            train_args=tuple(job.get("train_args", ())),
            env=tuple(job.get("env", {}).items()),
            health=Health(**job.get("health", {})),
            **{key: job[key] for key in _TORCHRUN_FIELDS + ("launcher",) if key in job},
        )

    def check_launcher(self, job: dict) -> None:
        """torchrun fields belong together: ranks per host, hosts, rendezvous, one GPU per rank."""
        if job.get("launcher", "threads") != "torchrun":
            for key in _TORCHRUN_FIELDS:
                if key in job:
                    raise self.fail(
                        f"job.{key}", "only applies with 'launcher: torchrun'; add that, or remove it"
                    )
            return
        if "nproc_per_node" not in job:
            raise self.fail(
                "job.nproc_per_node",
                "is required with 'launcher: torchrun' (ranks on this "
                "target, one GPU each), e.g. nproc_per_node: 2",
            )
        nnodes, endpoint = job.get("nnodes", 1), job.get("rdzv_endpoint")
        if nnodes > 1 and not endpoint:
            raise self.fail(
                "job.rdzv_endpoint",
                f"is required when nnodes is {nnodes}: HOST:PORT that every "
                "target of the job reaches, e.g. 10.0.0.7:29400",
            )
        if nnodes == 1 and endpoint:
            raise self.fail(
                "job.rdzv_endpoint",
                "is only used when nnodes > 1 (one host rendezvous on its own); remove it, or set nnodes",
            )
        if job.get("target_gpus"):
            raise self.fail(
                "job.target_gpus",
                "with 'launcher: torchrun' each rank runs its own target on its "
                "own GPU; list the ranks' GPUs in drafter_gpus and set target_gpus: []",
            )
        gpus = job.get("drafter_gpus", ())
        if gpus and len(gpus) != job["nproc_per_node"]:
            raise self.fail(
                "job.drafter_gpus",
                f"lists {len(gpus)} GPU(s) but nproc_per_node is "
                f"{job['nproc_per_node']}; give exactly one GPU per rank",
            )

    def check_cache_dir(self, workdir: str, log_dir: str, cache_dir: str, python: str = "") -> None:
        # The cache dir is deleted by purge-cache and on every relaunch: it must never hold, or sit
        # inside, the job's code, runs, logs or python. Paths are compared after normalising `..`.
        cache = posixpath.normpath(cache_dir)
        fix = f"use a directory of its own, e.g. {posixpath.join(workdir, 'cache')}"
        if cache.count("/") < 2:
            raise self.fail("job.cache_dir", f"{cache_dir!r} is too close to '/' to be purged safely; {fix}")
        owned = [(workdir, "workdir", False), (log_dir, "log_dir", True)]
        owned += [(path, what, True) for path, what in jobpaths.owned_by_the_job(workdir)]
        if python.startswith("/"):
            prefix = posixpath.dirname(posixpath.dirname(posixpath.normpath(python)))  # <prefix>/bin/python
            owned += [
                (prefix, "python prefix", False),
                (posixpath.join(prefix, "bin"), "python's bin", True),
                (posixpath.join(prefix, "lib"), "python's lib", True),
            ]
        for other, label, not_inside in owned:
            other = posixpath.normpath(other)
            if other == cache or other.startswith(cache + "/"):
                raise self.fail(
                    "job.cache_dir",
                    f"{cache_dir!r} contains the {label} ({other}) and is purged on relaunch; {fix}",
                )
            if not_inside and cache.startswith(other + "/"):
                raise self.fail(
                    "job.cache_dir",
                    f"{cache_dir!r} lies inside the {label} ({other}) and is purged on relaunch; {fix}",
                )


def _check_name(name, kind: str, where: _Where, line: int) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise where.error(
            line,
            None,
            f"{kind} name {_show(name)} is not valid; use letters, digits, "
            "'-', '_' and '.', starting with a letter or digit (at most 64)",
        )
    return name


def _mapping_or_empty(value, field: str, line: int, where: _Where, example: str) -> dict:
    if value is None:
        return _Map(line)
    if not isinstance(value, dict):
        raise where.error(line, field, f"expected a mapping like {example}, got {_kind(value)}")
    return value


# ---------------------------------------------------------------------------------------------
# The inventory.


@dataclasses.dataclass(frozen=True)
class Inventory:
    targets: dict[str, Target]  # `local` first, then the file's targets in file order
    groups: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    default_target: str = LOCAL  # a target or group name
    source: str | None = None  # the file it was read from; None for the built-in inventory

    def resolve(self, name: str | None = None) -> list[Target]:
        """Targets for a --target value: a target, or a group's targets in order; None = default."""
        name = self.default_target if name is None else name
        if name in self.targets:
            return [self.targets[name]]
        if name in self.groups:
            return [self.targets[member] for member in self.groups[name]]
        known = f"known targets: {', '.join(self.targets)}"
        if self.groups:
            known += f"; groups: {', '.join(self.groups)}"
        raise InputError(
            f"unknown target or group {_show(name)} ({known}); pick one of those, "
            f"or add it to {self.source or 'an inventory file (see --inventory)'}"
        )


def find_inventory_file(path: str | None = None) -> str | None:
    """The inventory file to read, or None for the built-in inventory.

    Order: `path` (--inventory), $DFLASH_OPS_INVENTORY, ./inventory.yaml,
    $XDG_CONFIG_HOME/dflash-ops/inventory.yaml (XDG_CONFIG_HOME defaults to ~/.config).
    A file named explicitly (argument or variable) must exist.
    """
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
    for candidate in ("inventory.yaml", os.path.join(config_home, "dflash-ops", "inventory.yaml")):
        if os.path.isfile(candidate):
            return candidate
    return None


def load_inventory(path: str | None = None) -> Inventory:
    """Find, read and validate the inventory (see find_inventory_file for the search order)."""
    found = find_inventory_file(path)
    if found is None:
        return builtin_inventory()
    return inventory_from_data(read_yaml(found), found, os.path.dirname(os.path.abspath(found)))


def load_inventory_text(
    text: str, filename: str = "inventory.yaml", base_dir: str | None = None
) -> Inventory:
    """Validate inventory YAML given as text; `filename` only names it in messages."""
    return inventory_from_data(parse_yaml(text, filename), filename, base_dir or os.getcwd())


def builtin_inventory() -> Inventory:
    """The inventory used when there is no file: only the embedded `local` target."""
    return inventory_from_data(_Map(), None, os.getcwd())


def inventory_from_data(data, filename: str | None, base_dir: str) -> Inventory:
    """Validate parsed YAML (as read by parse_yaml) and build the Inventory."""
    top = _Where(filename or "built-in inventory")
    if data is None:
        raise top.error(
            None,
            None,
            "the file is empty; define 'targets:' (see the example inventory.yaml), "
            "or remove the file to use only the built-in local target",
        )
    if not isinstance(data, dict):
        raise top.error(
            1,
            None,
            f"expected a mapping with {', '.join(TOP_LEVEL_KEYS)}, got {_kind(data)}; "
            "see the example inventory.yaml",
        )
    if not isinstance(data, _Map):
        data = _wrap(data)
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise top.error(data.key_lines.get(key), str(key), _unknown_top_level(key))

    def line_of(key: str) -> int:
        return data.key_lines.get(key, 1)

    # Defaults apply to ssh and pct targets only, so they must already be valid remote values.
    defaults_where = _Where(top.filename, "defaults")
    raw_defaults = _mapping_or_empty(
        data.get("defaults"),
        "defaults",
        line_of("defaults"),
        top,
        "{user: root, job: {workdir: /root/dflash}}",
    )
    defaults, default_lines = _check_layer(raw_defaults, _TARGET_FIELDS, defaults_where)
    if defaults.get("transport") == "local":
        raise defaults_where.error(
            default_lines["transport"],
            "transport",
            "defaults apply to ssh and pct targets only; use ssh or pct, or remove it",
        )
    for key, example in _REMOTE_PATH_EXAMPLES.items():
        value = defaults.get("job", {}).get(key)
        if value is not None and not value.startswith("/"):
            raise defaults_where.error(
                default_lines[f"job.{key}"],
                f"job.{key}",
                "defaults apply to ssh and pct targets, so this must be an absolute "
                f"path on the target, got {_show(value)}; write the full path, "
                f"e.g. {example}",
            )

    raw_targets = _mapping_or_empty(
        data.get("targets"),
        "targets",
        line_of("targets"),
        top,
        "{gpu-box: {transport: ssh, host: gpu.example.lan}}",
    )
    targets: dict[str, Target] = {}
    for name in [LOCAL] + [n for n in raw_targets if n != LOCAL]:
        line = raw_targets.key_lines.get(name, raw_targets.line)
        _check_name(name, "target", top, line)
        raw = raw_targets.get(name) if name in raw_targets else _Map(line)
        where = _Where(top.filename, f"target {name!r}")
        targets[name] = _target(name, raw, line, defaults, default_lines, where, base_dir)

    _check_rendezvous(targets, raw_targets, top)
    groups = _groups(data, targets, top)
    default_target = data.get("default_target", LOCAL)
    if not isinstance(default_target, str) or (
        default_target not in targets and default_target not in groups
    ):
        known = ", ".join(list(targets) + list(groups))
        raise top.error(
            line_of("default_target"),
            "default_target",
            f"{_show(default_target)} is not a target or group; use one of: {known}",
        )
    return Inventory(targets=targets, groups=groups, default_target=default_target, source=filename)


def _check_rendezvous(targets: dict[str, Target], raw_targets, top: _Where) -> None:
    """Targets that meet at one torchrun rendezvous must agree on how many hosts meet there."""
    seen: dict[str, list[str]] = {}
    for name, target in targets.items():
        job = target.job
        if job.launcher != "torchrun" or job.nnodes == 1:
            continue
        members = seen.setdefault(job.rdzv_endpoint, [])
        where = _Where(top.filename, f"target {name!r}")
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


def _wrap(data: dict) -> _Map:
    """Plain dicts (from code, not parse_yaml) get line 0 everywhere."""
    wrapped = _Map()
    for key, value in data.items():
        wrapped[key] = _wrap(value) if isinstance(value, dict) and not isinstance(value, _Map) else value
    return wrapped


def _target(
    name: str, raw, line: int, defaults: dict, default_lines: dict, where: _Where, base_dir: str
) -> Target:
    """Check one target's own fields, merge what it inherits, and build it."""
    if raw is None and name == LOCAL:  # `local:` alone: keep the built-in local job
        raw = _Map(line)
    if raw is None or not isinstance(raw, dict):
        problem = "has no fields" if raw is None else f"expected a mapping of target fields, got {_kind(raw)}"
        raise where.error(
            line, None, f"{problem}; write e.g. {name}: {{transport: ssh, host: gpu.example.lan}}"
        )
    own, own_lines = _check_layer(raw, _TARGET_FIELDS, where)
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

    not_here = {"local": {**_HOST_FIELDS, **_PCT_FIELDS}, "ssh": _PCT_FIELDS, "pct": {}}[transport]
    for key in own:
        if key in not_here:
            fix = (
                "a local target runs on this machine, without ssh; remove it"
                if transport == "local"
                else "it applies only to pct targets; remove it or set transport: pct"
            )
            raise where.error(own_lines[key], key, f"does not apply to {_a(transport)} target ({fix})")

    if transport == "local":
        # The local target does not inherit `defaults:` (those describe remote boxes).
        values = _merge({"job": LOCAL_JOB}, own)
        lines = own_lines
    else:
        inherited = {k: v for k, v in defaults.items() if k not in not_here}
        values = _merge(inherited, own)
        lines = {**default_lines, **own_lines}
    values["transport"] = transport
    return _TargetBuilder(name, values, lines, own_line, where, base_dir).build()


def _groups(data: _Map, targets: dict, top: _Where) -> dict[str, tuple[str, ...]]:
    raw = _mapping_or_empty(
        data.get("groups"), "groups", data.key_lines.get("groups", 1), top, "{all: [gpu-box, bare-box]}"
    )
    groups: dict[str, tuple[str, ...]] = {}
    for name, members in raw.items():
        line = raw.key_lines.get(name, raw.line)
        _check_name(name, "group", top, line)
        where = _Where(top.filename, f"group {name!r}")
        if name in targets:
            raise where.error(line, None, f"{name!r} is also a target name; rename the group or the target")
        example = f"{name}: [{', '.join(list(targets)[1:3]) or 'gpu-box'}]"
        if not isinstance(members, list) or not members:
            raise where.error(
                line, None, f"expected a non-empty list of target names like {example}, got {_kind(members)}"
            )
        for member in members:
            if member in raw and member not in targets:
                raise where.error(
                    line, None, f"lists group {member!r}; a group lists targets only: write its targets here"
                )
            if not isinstance(member, str) or member not in targets:
                raise where.error(
                    line, None, f"names unknown target {_show(member)}; known targets: {', '.join(targets)}"
                )
            if members.count(member) > 1:
                raise where.error(line, None, f"lists target {member!r} twice; list each target once")
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
                where += f" via {target.ssh.jump}"
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
