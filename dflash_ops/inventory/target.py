"""Building one `model.Target` from its merged fields, checking the rules that span fields."""

from __future__ import annotations

import os
import posixpath
import shutil
from importlib.util import find_spec

from trainer.launchers import DEFAULT_LAUNCHER, TORCHRUN
from trainer.typed_yaml import show

from dflash_ops.job import cache_guard
from dflash_ops.errors import InputError
from dflash_ops.inventory.layers import Fields, Lines, Where
from dflash_ops.inventory.rules import REMOTE_PATH_EXAMPLES, TORCHRUN_FIELDS, with_article
from dflash_ops.job.model import (
    CACHE_DIR_NAME,
    LEGACY_LOCAL_SESSION,
    LEGACY_SESSION,
    LOG_DIR_NAME,
    Health,
    HostSpec,
    Job,
    Target,
)

# Fields passed on only when the file sets them, so the defaults are job/model.py's.
HOST_OPTIONAL = ("port", "user", "jump", "host_key_policy", "connect_timeout_s")
HOST_LOCAL_FILES = ("identity_file", "known_hosts_file")  # paths on this machine
JOB_OPTIONAL = ("session", "tmux_socket", "launcher") + TORCHRUN_FIELDS
TARGET_OPTIONAL = ("gpu_query_on",)


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


class TargetBuilder:
    """Turns one target's merged fields into a model.Target, checking the whole-target rules."""

    def __init__(self, name: str, values: Fields, lines: Lines, own_line: int, where: Where, base_dir: str):
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
            **{key: self.values[key] for key in TARGET_OPTIONAL if key in self.values},
        )

    def local_file(self, path: str) -> str:
        """A path on THIS machine: `~` expanded, relative paths taken from the inventory's folder."""
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(path)))

    def host_spec(self) -> HostSpec:
        v = self.values
        if "host" not in v:
            raise self.fail(
                "host",
                f"is required for {with_article(self.transport)} target: the "
                + ("Proxmox host" if self.transport == "pct" else "machine")
                + " to ssh to, e.g. host: pve1.example.lan",
            )
        given: Fields = {key: v[key] for key in HOST_OPTIONAL if key in v}
        given.update({key: self.local_file(v[key]) for key in HOST_LOCAL_FILES if key in v})
        return HostSpec(host=v["host"], **given)

    def job_path(self, key: str, value: str) -> str:
        if not self.remote:
            return self.local_file(value)
        if not value.startswith("/"):
            why = (
                "the remote shell is non-login: no PATH from your profile, no venv activation"
                if key == "python"
                else "'~' and relative paths are not expanded on the target"
            )
            raise self.fail(
                f"job.{key}",
                f"must be an absolute path on the target, got {show(value)}; "
                f"write the full path, e.g. {REMOTE_PATH_EXAMPLES[key]} ({why})",
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
        if "/" not in config and not config.endswith((".yaml", ".yml")) and not config.startswith("~"):
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
                f"a config file on the target needs an absolute path, got {show(config)}; write "
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

        log_dir, cache_dir = own_dir("log_dir", LOG_DIR_NAME), own_dir("cache_dir", CACHE_DIR_NAME)
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
            log_dir=log_dir,
            cache_dir=cache_dir,
            target_gpus=tuple(target_gpus),
            drafter_gpus=tuple(drafter_gpus),
            train_args=tuple(job.get("train_args", ())),
            env=tuple(job.get("env", {}).items()),
            health=Health(**job.get("health", {})),
            legacy_session=job.get("session") or (LEGACY_SESSION if self.remote else LEGACY_LOCAL_SESSION),
            **{key: job[key] for key in JOB_OPTIONAL if key in job},
        )

    def check_launcher(self, job: Fields) -> None:
        """torchrun fields belong together: ranks per host, hosts, rendezvous, one GPU per rank."""
        if job.get("launcher", DEFAULT_LAUNCHER) != TORCHRUN:
            for key in TORCHRUN_FIELDS:
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
        # inside, the job's code, runs, logs or python (cache_guard; checked again on the target).
        why = cache_guard.problem(cache_dir, cache_guard.owned_paths(workdir, log_dir, python))
        if why is not None:
            fix = f"use a directory of its own, e.g. {posixpath.join(workdir, CACHE_DIR_NAME)}"
            raise self.fail("job.cache_dir", f"{cache_dir!r} {why} and is purged on relaunch; {fix}")
