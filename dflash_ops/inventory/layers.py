"""Checking one inventory layer (`defaults:`, a target) against the schema, merging layers, and naming
the FILE:LINE of a mistake (every mapping is a YamlMap that knows its keys' lines)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Collection

from trainer.typed_yaml import YamlMap, did_you_mean, kind_of, located, show

from dflash_ops.errors import InputError
from dflash_ops.inventory.rules import HEALTH_FIELDS, JOB_FIELDS, TARGET_FIELDS, Bad, Schema

Fields = dict[str, Any]  # clean values by field name; a mapping field (job:, health:) nests
Lines = dict[str, int]  # the line of each field, by dotted name ("job.health.stall_seconds")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


@dataclasses.dataclass
class Where:
    """Where in the file we are, to prefix error messages."""

    filename: str
    scope: str = ""  # "target 'gpu-box'", "defaults", "group 'all'" or "" for the top level

    def error(self, line: int | None, field: str | None, problem: str) -> InputError:
        parts = [located(self.filename, line), self.scope, f"field {field!r}" if field else "", problem]
        return InputError(": ".join(part for part in parts if part))


def unknown_field(key: Any, schema: Collection[str], prefix: str) -> str:
    if not isinstance(key, str):
        return f"{show(key)} is not a field name; known fields: {', '.join(schema)}"
    if prefix == "" and key in JOB_FIELDS:
        return f"unknown field here; {key!r} is a job field: put it under 'job:'"
    if prefix == "job." and key in TARGET_FIELDS:
        return f"unknown field here; {key!r} is a target field: move it out of 'job:'"
    if prefix == "job." and key in HEALTH_FIELDS:
        return f"unknown field here; {key!r} is a health threshold: put it under 'job: health:'"
    hint = did_you_mean(key, schema) or f"known fields: {', '.join(schema)}"
    return f"unknown field; {hint}"


def check_layer(raw: YamlMap, schema: Schema, where: Where, prefix: str = "") -> tuple[Fields, Lines]:
    """Check one mapping's keys and value types. Returns (clean values, {dotted field: line})."""
    values: Fields = {}
    lines: Lines = {}
    for key, value in raw.items():
        field = f"{prefix}{key}"
        line = raw.key_lines.get(key, raw.line)
        rule = schema.get(key) if isinstance(key, str) else None
        if rule is None:
            raise where.error(line, field, unknown_field(key, schema, prefix))
        lines[field] = line
        if isinstance(rule, dict):
            if value is None:  # `health:` with nothing under it
                value = YamlMap(line)
            if not isinstance(value, YamlMap):
                raise where.error(
                    line,
                    field,
                    f"expected a mapping of {key} fields ({', '.join(rule)}), got {kind_of(value)}",
                )
            values[key], sub_lines = check_layer(value, rule, where, field + ".")
            lines.update(sub_lines)
        else:
            try:
                values[key] = rule(value)
            except Bad as e:
                raise where.error(line, field, str(e)) from None
    return values, lines


def merge(base: Fields, over: Fields) -> Fields:
    """Deep merge: mappings merge key by key, everything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_name(name: Any, kind: str, where: Where, line: int) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise where.error(
            line,
            None,
            f"{kind} name {show(name)} is not valid; use letters, digits, "
            "'-', '_' and '.', starting with a letter or digit (at most 64)",
        )
    return name


def mapping_or_empty(value: Any, field: str, line: int, where: Where, example: str) -> YamlMap:
    if value is None:
        return YamlMap(line)
    if not isinstance(value, YamlMap):
        raise where.error(line, field, f"expected a mapping like {example}, got {kind_of(value)}")
    return value
