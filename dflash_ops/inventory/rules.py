"""The inventory's field rules and the schema tables that name them; a rule returns the clean value or
raises `Bad` with "what is wrong; how to fix it" (the caller says where)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Union

from trainer.launchers import LAUNCHERS
from trainer.typed_yaml import did_you_mean, kind_of, show

from dflash_ops.job.model import JumpHost

TRANSPORTS = ("local", "ssh", "pct")
HOST_KEY_POLICIES = ("strict", "accept-new", "off")
GPU_QUERY_ON = ("container", "host")

Rule = Callable[[Any], Any]
Schema = dict[str, Union[Rule, "Schema"]]  # a nested schema is a mapping field (job:, health:)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_JUMP = re.compile(r"(?:(?P<user>[^@\s:]+)@)?(?P<host>[^@\s:/\[\]]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d+))?\Z")


def with_article(word: str) -> str:
    return ("an " if word[0] in "aeiosx" else "a ") + word  # "an ssh", "a pct", "a local"


class Bad(Exception):
    """What is wrong with one value and how to fix it; the caller says where."""


def _text(value: Any, example: str) -> str:
    if not isinstance(value, str):
        raise Bad(f"expected text like {example}, got {kind_of(value)}")
    if not value:
        raise Bad(f"is empty; write it like {example}")
    if _CONTROL.search(value):
        raise Bad(f"contains a control character (newline, tab ...) in {show(value)}; remove it")
    return value


def whole_rule(lo: int, hi: int, example: str) -> Rule:
    def rule(value: Any) -> int:
        # bool is an int subclass in Python: `port: true` must not become port 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise Bad(f"expected a whole number like {example}, got {kind_of(value)}")
        if not lo <= value <= hi:
            raise Bad(f"must be between {lo} and {hi}, got {value}")
        return value

    return rule


def _number(example: str, zero_ok: bool, most: float | None = None) -> Rule:
    def rule(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Bad(f"expected a number like {example}, got {kind_of(value)}")
        if not math.isfinite(value):
            raise Bad(f"must be a finite number like {example}, got {value}")
        if value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0 (0 turns the check off)" if zero_ok else "> 0"
            raise Bad(f"must be {bound}, got {value}")
        if most is not None and value > most:
            raise Bad(f"must be at most {most:g}, got {value}")
        return float(value)

    return rule


def _choice(options: tuple[str, ...]) -> Rule:
    def rule(value: Any) -> str:
        if isinstance(value, str) and value in options:
            return value
        close = did_you_mean(value, options) if isinstance(value, str) else ""
        hint = f"; {close}" if close else ""
        raise Bad(f"must be one of {', '.join(options)}, got {kind_of(value)}{hint}")

    return rule


def host_rule(value: Any) -> str:
    value = _text(value, "pve1.example.lan")
    if value.startswith("-"):
        raise Bad(f"a host name cannot start with '-' ({show(value)}); ssh would read it as an option")
    if any(c.isspace() for c in value):
        raise Bad(f"a host name has no spaces, got {show(value)}")
    if "@" in value:
        raise Bad(f"write only the host here and the user in 'user:' (got {show(value)})")
    return value


def _user(value: Any) -> str:
    value = _text(value, "root")
    if value.startswith("-") or any(c.isspace() or c in "@:" for c in value):
        raise Bad(f"a user name has no spaces, '@' or ':' and does not start with '-', got {show(value)}")
    return value


def _jump(value: Any) -> JumpHost:
    text = _text(value, "admin@bastion:22")
    match = _JUMP.match(text)
    if not match or match["host"].startswith("-") or (match["user"] or "").startswith("-"):
        raise Bad(f"expected 'user@host:port' (user and port optional), got {show(text)}")
    jump = JumpHost(host=match["host"].strip("[]"), user=match["user"])  # JumpHost's default port
    if match["port"]:
        jump = dataclasses.replace(jump, port=int(match["port"]))
    if not 1 <= jump.port <= 65535:
        raise Bad(f"port must be between 1 and 65535, got {jump.port}")
    return jump


def path_rule(value: Any) -> str:
    return _text(value, "/root/dflash")


def _config(value: Any) -> str:
    return _text(value, "/root/dflash/configs/qwen3-8b.yaml or tiny-cpu")


def _session(value: Any) -> str:
    value = _text(value, "dflash")
    if "." in value or ":" in value:
        raise Bad(f"tmux refuses '.' and ':' in session names, got {show(value)}; use e.g. 'dflash-train'")
    if "#{" in value:
        raise Bad(
            f"'#{{' starts a tmux format that tmux would expand in the name, got {show(value)}; "
            "use e.g. 'dflash-train'"
        )
    return value


def _socket(value: Any) -> str:
    value = _text(value, "dflash")
    if "/" in value:
        raise Bad(f"is a tmux socket NAME (tmux -L), not a path, got {show(value)}; drop the '/'")
    return value


def _gpus(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise Bad(f"expected a list of GPU indices like [0, 1], got {kind_of(value)}")
    for gpu in value:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise Bad(f"GPU indices are whole numbers >= 0, got {kind_of(gpu)}; write it like [0, 1]")
    for gpu in value:
        if value.count(gpu) > 1:
            raise Bad(f"GPU {gpu} is listed twice; list each GPU once")
    return tuple(value)


def _train_args(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise Bad(f"expected a list of arguments like ['--max-steps', '100'], got {kind_of(value)}")
    args = []
    for arg in value:
        # Whole numbers convert exactly; a float would be re-spelled (6.0e-4 -> 0.0006), so it
        # must be quoted to reach the trainer as written.
        if isinstance(arg, int) and not isinstance(arg, bool):
            arg = str(arg)
        if not isinstance(arg, str):
            raise Bad(f"each argument must be text, got {kind_of(arg)}; quote it, e.g. '6e-4'")
        if "\x00" in arg:
            raise Bad("an argument cannot contain a NUL character; remove it")
        args.append(arg)
    return tuple(args)


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise Bad(
            f"expected a mapping of NAME: value like {{CUDA_LAUNCH_BLOCKING: '1'}}, got {kind_of(value)}"
        )
    env = {}
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise Bad(
                f"environment variable names are letters, digits and '_' (not starting "
                f"with a digit), got {show(name)}"
            )
        if isinstance(val, int) and not isinstance(val, bool):
            val = str(val)
        if not isinstance(val, str):
            raise Bad(f"the value of {name} must be text, got {kind_of(val)}; quote it, e.g. {name}: '1'")
        if "\x00" in val:
            raise Bad(f"the value of {name} cannot contain a NUL character; remove it")
        env[name] = val
    return env


def _endpoint(value: Any) -> str:
    value = _text(value, "10.0.0.7:29400")
    host, sep, port = value.rpartition(":")
    bad_host = not host or host.startswith("-") or any(c.isspace() for c in host)
    if not sep or bad_host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise Bad(f"expected HOST:PORT of the rendezvous host, like 10.0.0.7:29400, got {show(value)}")
    return value


TORCHRUN_FIELDS = ("nproc_per_node", "nnodes", "rdzv_endpoint")
HEALTH_FIELDS: Schema = {
    "min_tokens_per_s": _number("20000", zero_ok=True),
    "stall_seconds": _number("900", zero_ok=False),
    "min_drafter_util_pct": _number("30", zero_ok=True, most=100),
    "max_relaunches_per_hour": whole_rule(0, 60, "3"),
    "min_tau": _number("3", zero_ok=True, most=64),
}
JOB_FIELDS: Schema = {
    "workdir": path_rule,
    "python": path_rule,
    "config": _config,
    "session": _session,
    "log_dir": path_rule,
    "cache_dir": path_rule,
    "target_gpus": _gpus,
    "drafter_gpus": _gpus,
    "tmux_socket": _socket,
    "train_args": _train_args,
    "env": _env,
    "health": HEALTH_FIELDS,
    "launcher": _choice(LAUNCHERS),
    "nproc_per_node": whole_rule(1, 64, "2"),
    "nnodes": whole_rule(1, 4096, "2"),
    "rdzv_endpoint": _endpoint,
}
HOST_FIELDS: Schema = {
    "host": host_rule,
    "port": whole_rule(1, 65535, "22"),
    "user": _user,
    "identity_file": path_rule,
    "jump": _jump,
    "host_key_policy": _choice(HOST_KEY_POLICIES),
    "known_hosts_file": path_rule,
    "connect_timeout_s": _number("10", zero_ok=False),
}
# Proxmox allows container ids from 100 up.
PCT_FIELDS: Schema = {"ctid": whole_rule(100, 999_999_999, "200"), "gpu_query_on": _choice(GPU_QUERY_ON)}
TARGET_FIELDS: Schema = {"transport": _choice(TRANSPORTS), **HOST_FIELDS, **PCT_FIELDS, "job": JOB_FIELDS}
# Shown when a path on a remote target is not absolute.
REMOTE_PATH_EXAMPLES = {
    "workdir": "/root/dflash",
    "python": "/root/venv/bin/python3",
    "log_dir": "/root/dflash/logs",
    "cache_dir": "/root/dflash/cache",
}
