"""The argparse pieces the `dflash-train` commands share, declared once (stdlib only: parsing stays fast)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trainer.config import OVERRIDE_ALIASES, ConfigError, missing_cuda_devices
from trainer.typed_yaml import parse_value

DTYPE_CHOICES = ("bf16", "fp32")


class Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (exit 2), like every other input error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}. See {self.prog} --help\n")


def command_parser(
    prog: str, description: str, parser_class: type[argparse.ArgumentParser] = Parser, **kwargs
) -> argparse.ArgumentParser:
    """A parser whose description keeps its own line breaks (the examples in it)."""
    return parser_class(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )


def add_config(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help=help)


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """--set KEY=VALUE, repeatable (overrides_from_args reads it)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=help)


def add_checkpoint(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help=help)


def add_target(p: argparse.ArgumentParser, help: str, required: bool = False) -> None:
    p.add_argument("--target", required=required, metavar="SPEC", help=help)


def add_out(p: argparse.ArgumentParser, metavar: str, help: str) -> None:
    p.add_argument("--out", required=True, metavar=metavar, help=help)


def check_out_dir(path: str, flag: str = "--out") -> None:
    """--out DIR can be a directory: neither it nor a parent is a file (refused before any work)."""
    full = Path(os.path.abspath(path))
    for probe in (full, *full.parents):
        if probe.exists() and not probe.is_dir():
            where = "is a file" if probe == full else f"lies under the file {probe}"
            raise ConfigError(
                f"{flag} {path}: {where}, not a directory; give a directory (created if missing)"
            )


def check_cuda_devices(flag: str, devices: list[str]) -> None:
    """Every cuda device `flag` names exists here (a CPU build of torch has none)."""
    missing, count = missing_cuda_devices(devices)
    if missing:
        seen = (
            f"{count} CUDA device(s) are visible"
            if count
            else "no CUDA device is visible (a CPU build of torch?)"
        )
        raise ConfigError(f"{flag} names {', '.join(missing)} but {seen}. Fix: name existing devices, or cpu")


def add_dtype(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16", help=help)


def add_batch_size(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--batch-size", type=int, metavar="B", help=help)


def add_max_new_tokens(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=default, metavar="N")


def add_temperature(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help=help)


def add_sampling_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")


def check_at_least_one(*flags: tuple[str, int]) -> None:
    """(flag, value) pairs whose value must be a positive count."""
    for flag, value in flags:
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def chat_template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of apply_chat_template arguments."""
    fix = "Fix: e.g. '{\"enable_thinking\": false}'"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--chat-template-kwargs is not JSON ({exc}). {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-kwargs must be a JSON object. {fix}")
    return value


def check_temperature(temperature: float) -> None:
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")


def overrides_from_args(args: argparse.Namespace) -> dict:
    """CLI flags -> the override dict load_config takes (short names or dotted keys)."""
    # the training flags are the short names; other commands (dflash-train data) have --set only
    overrides = {name: value for name in OVERRIDE_ALIASES if (value := getattr(args, name, None)) is not None}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
        overrides[key.strip()] = parse_value(raw)  # the config file's rules: `off` stays text
    return overrides
