"""Is `--grace` long enough for the trainer to stop by itself (run.stop_grace_s plus its watchdog's
margin)? Known from `--set run.stop_grace_s=` or a bundled config; a target-only config is not read."""

from __future__ import annotations

from pathlib import Path

from trainer import stop_timing, typed_yaml

from dflash_ops.errors import InputError
from dflash_ops.job.model import Job

_SETTING = "run.stop_grace_s"
_BUNDLED = Path(typed_yaml.__file__).resolve().parent / "configs"


def _from_train_args(args: tuple[str, ...]) -> object | None:
    found = None
    for i, arg in enumerate(args):
        if arg == "--set" and i + 1 < len(args):
            item = args[i + 1]
        elif arg.startswith("--set="):
            item = arg.removeprefix("--set=")
        else:
            continue
        key, _, raw = item.partition("=")
        if key.strip() == _SETTING:
            found = typed_yaml.parse_value(raw)  # the last --set wins, as in the trainer
    return found


def _from_bundled_config(name: str) -> object | None:
    path = _BUNDLED / (name if name.endswith(".yaml") else name + ".yaml")
    if "/" in name or not path.is_file():
        return None  # a config file on the target
    data = typed_yaml.read_yaml(str(path))
    run = data.get("run") if isinstance(data, dict) else None
    return (run if isinstance(run, dict) else {}).get("stop_grace_s", stop_timing.DEFAULT_STOP_GRACE_S)


def trainer_stop_grace(job: Job) -> float | None:
    """The job's run.stop_grace_s when it can be known here, else None."""
    value = _from_train_args(job.train_args)
    if value is None:
        value = _from_bundled_config(job.config)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_grace(job: Job, grace_s: float, given_as: str = "--grace") -> None:
    """Refuse (exit 2) a grace that would SIGKILL a trainer still stopping by itself.
    The step that signals checks it, so it holds for every way in; `given_as` names where it was written."""
    stop_grace = trainer_stop_grace(job)
    if stop_grace is None:
        return
    floor = stop_timing.ops_grace_floor(stop_grace)
    if grace_s < floor:
        raise InputError(
            f"{given_as} {grace_s:g} s is shorter than the trainer may need to stop by itself "
            f"(run.stop_grace_s {stop_grace:g} s + its watchdog's {stop_timing.WATCHDOG_MARGIN_S:g} s "
            f"+ {stop_timing.LOG_MARGIN_S:g} s); use {given_as} {floor:g} or more, or lower run.stop_grace_s"
        )
