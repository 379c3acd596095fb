"""The YAML users write, read with the trainer's strict loader; its errors become InputError."""

from __future__ import annotations

from typing import Any, Mapping

from trainer import typed_yaml
from trainer.typed_yaml import YamlMap

from dflash_ops.errors import InputError

__all__ = ["YamlMap", "parse_yaml", "read_yaml"]


def parse_yaml(text: str, filename: str, named_items: Mapping[str, str] | None = None) -> Any:
    try:
        return typed_yaml.parse_yaml(text, filename, named_items)
    except typed_yaml.YamlInputError as e:
        raise InputError(str(e)) from None


def read_yaml(path: str, named_items: Mapping[str, str] | None = None) -> Any:
    try:
        return typed_yaml.read_yaml(path, named_items)
    except typed_yaml.YamlInputError as e:
        raise InputError(str(e)) from None
