"""Plain data describing targets and jobs; the defaults here are the only ones."""

from __future__ import annotations

import dataclasses
import hashlib

from trainer.launchers import DEFAULT_LAUNCHER

# A job's logs and compile cache live under its workdir unless the inventory says otherwise.
LOG_DIR_NAME = "logs"
CACHE_DIR_NAME = "cache"
# The session every job of a box had before sessions were derived from the workdir (the local
# target's was LEGACY_LOCAL_SESSION): a job those versions launched still runs under it.
LEGACY_SESSION = "dflash"
LEGACY_LOCAL_SESSION = "dflash-local"


@dataclasses.dataclass(frozen=True)
class JumpHost:
    """An ssh jump host (OpenSSH's -J), written `user@host:port` in the inventory."""

    host: str  # an IPv6 address without its brackets
    port: int = 22
    user: str | None = None  # None: the user of the target it leads to

    def destination(self) -> str:
        """`[user@]host:port` as ssh -J takes it, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + f"{host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """How to reach an ssh host (the box itself, or the Proxmox host for pct)."""

    host: str
    port: int = 22
    user: str = "root"
    identity_file: str | None = None
    jump: JumpHost | None = None
    # "strict": key must already be in known_hosts; "accept-new": record unknown keys (a changed
    # key is still refused); "off": trust anything (explicit opt-in only).
    host_key_policy: str = "strict"
    known_hosts_file: str | None = None  # default ~/.ssh/known_hosts
    connect_timeout_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class Health:
    min_tokens_per_s: float = 0.0  # WARNING below this (the eager-fallback signature)
    stall_seconds: float = 900.0  # CRITICAL when no new step for this long
    min_drafter_util_pct: float = 0.0  # WARNING when drafter GPUs are under this while training
    max_relaunches_per_hour: int = 3  # guard for `health --auto-relaunch`
    min_tau: float = 0.0  # WARNING when the measured acceptance length is under this (0 = off)


@dataclasses.dataclass(frozen=True)
class Job:
    workdir: str  # releases/, current -> release, runs/ live here
    python: str  # absolute path of the python that runs the trainer (venv's bin/python)
    config: str  # trainer config: path on the target, or a bundled name like "tiny-cpu"
    session: str = ""  # tmux session name; default derived from the workdir (one per job on a box)
    log_dir: str = ""  # numbered train-NNNN.log + .metrics.jsonl; default <workdir>/logs
    cache_dir: str = ""  # TORCHINDUCTOR_CACHE_DIR (+ triton/ under it); default <workdir>/cache
    target_gpus: tuple[int, ...] = ()
    drafter_gpus: tuple[int, ...] = ()
    tmux_socket: str = "dflash"  # tmux -L socket name, so we never touch the user's own tmux
    train_args: tuple[str, ...] = ()  # extra dflash-train arguments
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the trainer
    health: Health = dataclasses.field(default_factory=Health)
    launcher: str = DEFAULT_LAUNCHER  # "torchrun": one process per rank, DDP (dflash_ops/torchrun.py)
    nproc_per_node: int = 1  # torchrun ranks on this target, one GPU each
    nnodes: int = 1  # hosts in the torchrun job (the targets of a group)
    rdzv_endpoint: str = ""  # HOST:PORT of the c10d rendezvous when nnodes > 1
    # the session (configured, else that version's default) a job launched by an earlier version
    # runs under: jobpaths.legacy_marker_value
    legacy_session: str = dataclasses.field(default=LEGACY_SESSION, metadata={"derived": True})

    def __post_init__(self):
        # Derived defaults are filled in here, once, so every reader sees the real paths.
        workdir = self.workdir.rstrip("/") or "/"
        if not self.log_dir:
            object.__setattr__(self, "log_dir", f"{workdir}/{LOG_DIR_NAME}")
        if not self.cache_dir:
            object.__setattr__(self, "cache_dir", f"{workdir}/{CACHE_DIR_NAME}")
        if not self.session:
            object.__setattr__(self, "session", f"dflash-{self.job_id}")

    @property
    def job_id(self) -> str:
        """Who this job is on its box: the workdir, never shared; unique names derive from it."""
        return hashlib.sha256(self.workdir.rstrip("/").encode()).hexdigest()[:10]

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.target_gpus) | set(self.drafter_gpus)))


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    transport: str  # "local" | "ssh" | "pct"
    job: Job
    ssh: HostSpec | None = None  # for ssh and pct
    ctid: int | None = None  # for pct
    # Where nvidia-smi runs for a pct target: "container" (pids may be invisible) or "host"
    # (pids mapped to containers through /proc/PID/cgroup).
    gpu_query_on: str = "container"

    def node_targets(self) -> list[Target]:
        return [self]

    @property
    def gpu_host_ctid(self) -> int | None:
        """The container id when GPUs are queried on the Proxmox host (real pids), else None."""
        return self.ctid if self.transport == "pct" and self.gpu_query_on == "host" else None
