"""The trainer's configuration: plain dataclasses loaded from YAML, validated with one clear message.

Every key has a default, so a file only states what differs; a bare name finds a bundled config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from pathlib import Path

from trainer import typed_yaml
from trainer.block_size import DEFAULT_BLOCK_SIZE, block_size_problem
from trainer.compile_lock import COMPILE_LOCK_MODES
from trainer.compile_modes import COMPILE_MODES, REFUSED_COMPILE_MODES
from trainer.launchers import DEFAULT_LAUNCHER, LAUNCHERS
from trainer.stop_timing import DEFAULT_STOP_GRACE_S

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
ATTENTION_BACKENDS = ("flex", "sdpa")
ACTIVATION_CHECKPOINTING = ("none", "layers")  # "layers": see trainer.activation_checkpoint
DATA_SOURCES = ("synthetic", "jsonl", "features")
PRECISIONS = ("fp32", "bf16-mixed")  # bf16-mixed: fp32 master weights + AdamW state, bf16 compute
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
TRACKERS = ("tensorboard", "wandb", "mlflow")  # run.report_to's choices: a class each in train.trackers


class ConfigError(Exception):
    """A bad config value or file. The message names the key (or file:line) and the fix."""

    exit_code = 2


def in_one_line(exc: BaseException) -> str:
    """`TypeName: the first line of its message`: why a file could not be read, for a one-line error."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


@dataclasses.dataclass
class TargetConfig:
    spec: str = "tiny-random"  # "tiny-random" or a local Hugging Face model directory
    layer_ids: typing.Optional[list[int]] = None  # None: 5 layers spread from 1 to num_layers-3
    tiny: dict = dataclasses.field(default_factory=dict)  # overrides for the tiny-random model


@dataclasses.dataclass
class DrafterSection:
    """Drafter shape. A null (None) value copies the target's own value (the paper's choice)."""

    num_layers: int = 5
    block_size: int = DEFAULT_BLOCK_SIZE
    num_heads: typing.Optional[int] = None
    num_kv_heads: typing.Optional[int] = None
    head_dim: typing.Optional[int] = None
    intermediate_size: typing.Optional[int] = None
    mask_token_id: typing.Optional[int] = None  # None: the target's mask/pad token, else vocab-1
    rms_norm_eps: typing.Optional[float] = None
    rope_theta: typing.Optional[float] = None

    def overrides(self) -> dict:
        """The values that replace the target's (what DrafterConfig.for_target takes)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass
class SyntheticConfig:
    num_samples: int = 128  # sequences generated once at startup
    prompt_len: int = 8  # random prompt tokens; the rest is the target's greedy continuation


@dataclasses.dataclass
class DataConfig:
    source: str = "jsonl"  # "jsonl" (needs `path`), "synthetic", or "features" (`path`: a feature cache dir)
    path: typing.Optional[str] = None
    seq_len: int = 3072  # every sequence is padded/truncated to this, so shapes stay static
    eval_fraction: float = 0.0  # share of sequences held out from training for the tau evaluation
    # apply_chat_template arguments for `messages` records; null: what `data regenerate` recorded
    # beside data.path (trainer/template_args.py), else none
    chat_template_kwargs: typing.Optional[dict] = None
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)


@dataclasses.dataclass
class TrainSection:
    batch_size: int = 1  # sequences per drafter replica per step
    num_anchors: int = 512  # blocks sampled per sequence
    gamma: float = 7.0  # loss weight decay over block positions: exp(-(k-1)/gamma)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0  # the cosine ends at lr * min_lr_ratio
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    # "layers": recompute each drafter layer in backward instead of keeping its activations
    activation_checkpointing: str = "none"
    epochs: int = 6
    max_steps: typing.Optional[int] = None  # stop earlier than `epochs` (also shortens the schedule)
    seed: int = 0
    precision: typing.Optional[str] = None  # fp32 | bf16-mixed; null: bf16-mixed on CUDA, fp32 on CPU


@dataclasses.dataclass
class RunConfig:
    output_dir: str = "runs/default"
    metrics_file: typing.Optional[str] = None  # None: <output_dir>/metrics.jsonl
    target_devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])
    attention: str = "sdpa"
    compile_lock: str = "lock"
    compile_mode: str = "default"  # torch.compile mode of flex_attention (trainer.compile_modes)
    # after SIGTERM/SIGINT, seconds the step may take before exiting uncheckpointed (a stuck compile)
    stop_grace_s: float = DEFAULT_STOP_GRACE_S  # see trainer.stop_timing
    checkpoint_every: int = 100
    keep_last: int = 3
    log_every: int = 1
    # torch intra-op threads; null = torch's default (on a shared CPU 1 is faster: OpenMP pools spin)
    torch_threads: typing.Optional[int] = None
    resume: typing.Optional[str] = None  # None: fresh run; "latest"; or a checkpoint directory
    launcher: str = DEFAULT_LAUNCHER  # "torchrun": this process is one rank (trainer/distributed.py)
    # experiment trackers fed from the metrics records (trainer/trackers.py): tensorboard, wandb, mlflow
    report_to: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EvalSection:
    """Speculative-decoding evaluation (acceptance length tau) between training steps."""

    every: int = 0  # steps between evaluations (and after the last step); 0 = off
    num_prompts: int = 8
    max_new_tokens: int = 64
    path: typing.Optional[str] = None  # prompts JSONL; None: the held-out split (data.eval_fraction)


@dataclasses.dataclass
class TrainConfig:
    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    drafter: DrafterSection = dataclasses.field(default_factory=DrafterSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    # the file this came from and the line of each key it sets (for messages); not config keys
    source: str = dataclasses.field(default="", metadata={"internal": True})
    key_lines: dict = dataclasses.field(default_factory=dict, metadata={"internal": True}, repr=False)

    @property
    def metrics_path(self) -> str:
        return self.run.metrics_file or os.path.join(self.run.output_dir, "metrics.jsonl")

    def to_dict(self) -> dict:
        internal = {f.name for f in dataclasses.fields(self) if f.metadata.get("internal")}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in internal}


# the keys a training flag of their own sets: --max-steps N is --set train.max_steps=N
OVERRIDE_ALIASES = {
    dotted.rpartition(".")[2]: dotted
    for dotted in (
        "run.output_dir run.metrics_file run.resume run.compile_lock run.attention run.target_devices "
        "run.drafter_devices train.max_steps train.seed run.launcher"
    ).split()
}


def resolve_config_path(path: str) -> Path:
    """A file path, or a bare bundled name such as `tiny-cpu` (-> trainer/configs/tiny-cpu.yaml)."""
    p = Path(path)
    if p.is_file():
        return p
    if os.sep not in path and "/" not in path:
        bundled = CONFIGS_DIR / (path if path.endswith(".yaml") else path + ".yaml")
        if bundled.is_file():
            return bundled
    names = sorted(f.stem for f in CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config file {path!r} not found. Fix: pass a YAML file path, or one of the bundled "
        f"configs: {', '.join(names)}"
    )


def load_config(path: str, overrides: dict | None = None) -> TrainConfig:
    """Read, merge overrides into, and validate a config. Raises ConfigError on any bad value."""
    file = resolve_config_path(path)
    try:
        raw = typed_yaml.read_yaml(str(file))
    except typed_yaml.YamlInputError as exc:
        raise ConfigError(str(exc)) from None
    raw = typed_yaml.YamlMap() if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{file}: the top level must be a mapping of sections (target, drafter, data, train, run)"
        )
    for key, value in (overrides or {}).items():
        flag = f"--{key.replace('_', '-')}" if key in OVERRIDE_ALIASES else f"--set {key}"
        _set_dotted(raw, OVERRIDE_ALIASES.get(key, key), value, flag)
    return config_from_dict(raw, str(file))


def default_precision(drafter_devices: list[str]) -> str:
    """bf16-mixed when a drafter runs on CUDA (bf16 tensor cores), fp32 on CPU."""
    return "bf16-mixed" if any(dev.startswith("cuda") for dev in drafter_devices) else "fp32"


def config_from_dict(raw: dict, source: str) -> TrainConfig:
    """A validated TrainConfig from a parsed file or a resolved mapping (a checkpoint's config.json)."""
    try:
        cfg = typed_yaml.build(TrainConfig, raw, source)
    except typed_yaml.YamlInputError as exc:
        raise ConfigError(str(exc)) from None
    cfg.source = source
    cfg.key_lines = typed_yaml.dotted_lines(raw)
    validate(cfg)
    cfg.train.precision = cfg.train.precision or default_precision(cfg.run.drafter_devices)
    from trainer.template_args import resolve_for_run

    resolve_for_run(cfg)  # the run records what its data was rendered with
    return cfg


def _set_dotted(raw: dict, dotted: str, value, flag: str) -> None:
    *sections, key = dotted.split(".")
    node = raw
    for part in sections:
        child = node.get(part)
        if child is None:
            child = node[part] = typed_yaml.YamlMap()
            if isinstance(node, typed_yaml.YamlMap):  # made by the flag: a message about it names the flag
                node.key_lines[part] = flag
        if not isinstance(child, dict):
            raise ConfigError(f"{flag}: `{part}` is not a section")
        node = child
    node[key] = value
    if isinstance(node, typed_yaml.YamlMap):
        node.key_lines[key] = flag
    _set_by(value, flag)


def _set_by(value, flag: str) -> None:
    """A mapping given to a flag (--set train='{lr: 1}'): a message about its keys names the flag, not
    line 1 of the config file."""
    if isinstance(value, typed_yaml.YamlMap):
        value.key_lines = dict.fromkeys(value, flag)
        for child in value.values():
            _set_by(child, flag)


def _fail(cfg: TrainConfig, key: str, message: str) -> typing.NoReturn:
    where = typed_yaml.located(cfg.source or "config", cfg.key_lines.get(key))
    raise ConfigError(f"{where}: `{key}` {message}")


def _one_of(cfg: TrainConfig, key: str, value: str, choices: typing.Iterable[str], fix: str = "") -> None:
    if value not in choices:
        _fail(cfg, key, f"must be one of {', '.join(choices)}, got {value!r}.{fix}")


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need no torch. Raises ConfigError naming the key and the fix."""
    for check in (_validate_shape, _validate_train, _validate_data, _validate_run, _validate_eval):
        check(cfg)


# counts that must be at least 1; a null drafter dimension copies the target's (0 is a bad value)
POSITIVE_COUNTS = (
    "drafter.num_layers drafter.num_heads drafter.num_kv_heads drafter.head_dim drafter.intermediate_size "
    "drafter.block_size data.seq_len train.batch_size train.num_anchors train.epochs run.checkpoint_every "
    "run.keep_last run.log_every data.synthetic.num_samples data.synthetic.prompt_len eval.num_prompts "
    "eval.max_new_tokens"
).split()
DEVICE_KEYS = ("run.target_devices", "run.drafter_devices")
# the data sources that read data.path, and what to set it to
PATH_FIXES = {
    "jsonl": "set it to your .jsonl file.",
    "features": "set it to the directory `dflash-train data cache-features` wrote.",
}


def _value(cfg: TrainConfig, key: str) -> typing.Any:
    return functools.reduce(getattr, key.split("."), cfg)


def _validate_shape(cfg: TrainConfig) -> None:
    d = cfg.drafter
    for key in POSITIVE_COUNTS:
        value = _value(cfg, key)
        if value is not None and value < 1:
            _fail(cfg, key, f"must be at least 1, got {value}. Fix: set a positive value.")
    if block_problem := block_size_problem(d.block_size):
        _fail(cfg, "drafter.block_size", f"{block_problem}. Fix: use {DEFAULT_BLOCK_SIZE}.")
    if d.num_heads and d.num_kv_heads and d.num_heads % d.num_kv_heads:
        _fail(
            cfg, "drafter.num_kv_heads", f"({d.num_kv_heads}) must divide drafter.num_heads ({d.num_heads})."
        )


def _validate_train(cfg: TrainConfig) -> None:
    t = cfg.train
    if t.max_steps is not None and t.max_steps < 1:
        _fail(cfg, "train.max_steps", f"must be at least 1 or null, got {t.max_steps}.")
    if t.lr <= 0:
        _fail(cfg, "train.lr", f"must be positive, got {t.lr}. Fix: the paper uses 6e-4.")
    if not 0 <= t.warmup_frac < 1:
        _fail(cfg, "train.warmup_frac", f"must be in [0, 1), got {t.warmup_frac}. Fix: the paper uses 0.04.")
    if not 0 <= t.min_lr_ratio <= 1:
        _fail(cfg, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}.")
    if t.gamma <= 0:
        _fail(cfg, "train.gamma", f"must be positive, got {t.gamma}. Fix: the paper uses 7 for block 16.")
    if t.grad_clip <= 0:
        _fail(cfg, "train.grad_clip", f"must be positive, got {t.grad_clip}. Fix: the paper uses 1.0.")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        _fail(cfg, "train.betas", f"must be two numbers in [0, 1), got {t.betas}. Fix: [0.9, 0.95].")
    if t.precision is not None:
        fix = " Fix: bf16-mixed on GPUs, fp32 for exact CPU runs."
        _one_of(cfg, "train.precision", t.precision, PRECISIONS, fix)
    _one_of(cfg, "train.activation_checkpointing", t.activation_checkpointing, ACTIVATION_CHECKPOINTING)


def _validate_data(cfg: TrainConfig) -> None:
    data = cfg.data
    _one_of(cfg, "data.source", data.source, DATA_SOURCES)
    fix = PATH_FIXES.get(data.source)
    if fix and not data.path:
        _fail(cfg, "data.path", f"is required when data.source is {data.source}. Fix: {fix}")
    if data.source == "synthetic" and data.synthetic.prompt_len >= data.seq_len:
        shorter = f"({data.synthetic.prompt_len}) must be shorter than data.seq_len ({data.seq_len})."
        _fail(cfg, "data.synthetic.prompt_len", shorter)
    if data.seq_len < 2:
        _fail(cfg, "data.seq_len", f"must be at least 2, got {data.seq_len}.")


def _validate_run(cfg: TrainConfig) -> None:
    r = cfg.run
    _one_of(cfg, "run.attention", r.attention, ATTENTION_BACKENDS)
    _one_of(cfg, "run.compile_lock", r.compile_lock, COMPILE_LOCK_MODES)
    _one_of(cfg, "run.launcher", r.launcher, LAUNCHERS)
    for name in r.report_to:
        if name not in TRACKERS:
            close = typed_yaml.closest_match(name, TRACKERS)
            hint = f" Did you mean {close!r}?" if close else ""
            fix = f"Fix: any of {', '.join(TRACKERS)}, e.g. [tensorboard]."
            _fail(cfg, "run.report_to", f"has {name!r}, which is not a tracker.{hint} {fix}")
    r.report_to = list(dict.fromkeys(r.report_to))  # each tracker once
    if r.compile_mode in REFUSED_COMPILE_MODES:
        why = f"{r.compile_mode!r} is not offered: {REFUSED_COMPILE_MODES[r.compile_mode]}."
        _fail(cfg, "run.compile_mode", f"{why} Fix: use one of {', '.join(COMPILE_MODES)}.")
    _one_of(cfg, "run.compile_mode", r.compile_mode, COMPILE_MODES)
    if r.stop_grace_s <= 0:
        fix = "Fix: e.g. 20 (below ops' --grace)."
        _fail(cfg, "run.stop_grace_s", f"must be positive, got {r.stop_grace_s}. {fix}")
    for key in DEVICE_KEYS:
        devices = _value(cfg, key)
        if not devices:
            _fail(cfg, key, "must name at least one device. Fix: e.g. [cpu] or [cuda:0].")
        for dev in devices:
            if not DEVICE_RE.match(dev):
                _fail(cfg, key, f"has {dev!r}, which is not a device. Fix: use cpu, cuda or cuda:N.")
    if r.attention == "flex" and any(dev == "cpu" for dev in r.drafter_devices):
        why = "is flex, but a drafter device is cpu and torch cannot run flex_attention backward on CPU."
        _fail(cfg, "run.attention", f"{why} Fix: use --attention sdpa for CPU drafters.")


def _validate_eval(cfg: TrainConfig) -> None:
    if not 0 <= cfg.data.eval_fraction < 1:
        _fail(cfg, "data.eval_fraction", f"must be in [0, 1), got {cfg.data.eval_fraction}. Fix: e.g. 0.05.")
    if cfg.eval.every < 0:
        _fail(cfg, "eval.every", f"must be 0 (off) or a number of steps, got {cfg.eval.every}.")


def missing_cuda_devices(devices: list[str]) -> tuple[list[str], int]:
    """(the cuda devices of `devices` this machine lacks, how many it has); needs torch."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [d for d in devices if d.startswith("cuda") and int(d.partition(":")[2] or 0) >= count], count


def check_devices(cfg: TrainConfig) -> None:
    """Devices named in the config must exist on this machine (needs torch, so it runs at startup)."""
    for key in DEVICE_KEYS:
        missing, count = missing_cuda_devices(_value(cfg, key))
        if missing:
            seen = f"{count} CUDA device(s) visible" if count else "no CUDA device visible"
            fix = "Fix: pick existing devices, or cpu."
            _fail(cfg, key, f"names {missing[0]!r} but this machine has {seen}. {fix}")
