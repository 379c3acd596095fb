"""The playbook document: its YAML (read strictly: a duplicated key is refused), options and
steps, checked for shape, option types, templates and `when:`."""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import InputError
from ..strict_yaml import parse_yaml
from .registry import IDENTIFIER
from .templates import (
    EarlierSteps,
    Ref,
    check_reference,
    parse_ref,
    parse_template,
    static_ref_type,
    strings_in,
)
from .typecheck import REQUIRED, Mismatch, Problems, conform, describe, did_you_mean


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """A run option a playbook declares (`--no-purge` -> purge=False), with its type and default."""

    name: str
    type: Any
    default: Any = REQUIRED
    help: str = ""


@dataclasses.dataclass(frozen=True)
class Condition:
    """`when:` of a step: a reference (optionally negated) or a literal true/false."""

    text: str
    ref: Ref | None = None
    negate: bool = False
    literal: bool = True

    def holds(self, roots: Mapping[str, Any]) -> bool:
        if self.ref is None:
            return self.literal
        value = roots.get(self.ref.path[0])
        for attr in self.ref.path[1:]:  # the path was checked against the data model when parsed
            value = (
                None
                if value is None
                else (value.get(attr) if isinstance(value, Mapping) else getattr(value, attr, None))
            )
        return bool(value) != self.negate

    def why_not(self) -> str:
        """Why the step is skipped, for the progress line: `options.purge is false`."""
        if self.ref is None:
            return "when: false"
        return f"{self.ref} is {'true' if self.negate else 'false'}"


@dataclasses.dataclass(frozen=True)
class StepEntry:
    number: int  # 1-based position in the playbook
    step: str
    params: Mapping[str, Any]
    when: Condition | None = None
    line: int | None = None

    def where(self) -> str:
        return f"step {self.number} ({self.step}" + (f", line {self.line})" if self.line else ")")


@dataclasses.dataclass(frozen=True)
class Playbook:
    name: str
    source: str  # file path, or "<string>"
    description: str
    options: Mapping[str, OptionSpec]
    steps: tuple[StepEntry, ...]


_TOP_KEYS = ("description", "options", "steps")
_STEP_KEYS = ("step", "params", "when")
_OPTION_KEYS = ("type", "default", "help")
_OPTION_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def parse_playbook(text: str, source: str = "<string>", name: str | None = None) -> Playbook:
    """Parse and structurally check a playbook (shape, options, templates, `when`).

    Step names and parameters are checked against a registry by `validate_playbook`.
    """
    problems = Problems(source)
    data, lines = _load_yaml(text, source, problems)
    problems.raise_if_any()
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        problems.add("", f"expected a mapping with a 'steps:' list at the top, got {got}")
        problems.raise_if_any()
    for key in data:
        if key not in _TOP_KEYS:
            problems.add(
                f"top-level key {key!r}",
                f"unknown key{did_you_mean(str(key), _TOP_KEYS)}; allowed: {', '.join(_TOP_KEYS)}",
            )
    description = data.get("description", "")
    if not isinstance(description, str):
        problems.add("description", f"expected text, got {describe(description)}")
        description = ""
    options = _parse_options(data.get("options"), problems)
    steps = _parse_steps(data.get("steps", REQUIRED), lines, options, problems)
    problems.raise_if_any()
    if name is None:
        name = Path(source).stem if source != "<string>" else "playbook"
    return Playbook(name, source, description, types.MappingProxyType(options), tuple(steps))


def _load_yaml(text: str, source: str, problems: Problems) -> tuple[Any, list[int | None]]:
    """The document, read by the inventory's strict reader (a duplicated key is refused, only
    true/false are booleans), and the 1-based line of each entry of its `steps:` list."""
    try:
        data = parse_yaml(text, source)
    except InputError as e:
        where = re.match(re.escape(source) + r"(?::(\d+))?: ", str(e))  # "FILE:LINE: why" -> "line LINE: why"
        problems.add(
            f"line {where[1]}" if where and where[1] else "", str(e)[where.end() :] if where else str(e)
        )
        return None, []
    lines: list[int | None] = []
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == "steps" and isinstance(value, yaml.SequenceNode):
                lines = [item.start_mark.line + 1 for item in value.value]
    return data, lines


def _parse_options(raw: Any, problems: Problems) -> dict[str, OptionSpec]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add("options", f"expected a mapping of option names, got {describe(raw)}")
        return {}
    options = {}
    for name, decl in raw.items():
        where = f"options.{name}"
        if not isinstance(name, str) or not IDENTIFIER.match(name):
            problems.add(where, "option names must be identifiers (letters, digits, _)")
            continue
        if not isinstance(decl, dict):
            decl = {"default": decl}  # shorthand `purge: true`: the type follows the default
        for key in decl:
            if key not in _OPTION_KEYS:
                problems.add(
                    f"{where}.{key}",
                    f"unknown key{did_you_mean(str(key), _OPTION_KEYS)}; allowed: {', '.join(_OPTION_KEYS)}",
                )
        default = decl.get("default", REQUIRED)
        if "type" in decl:
            typ = _OPTION_TYPES.get(decl["type"]) if isinstance(decl["type"], str) else None
            if typ is None:
                problems.add(
                    f"{where}.type", f"unknown type {decl['type']!r}; use one of {', '.join(_OPTION_TYPES)}"
                )
                continue
        elif default is REQUIRED or default is None:
            problems.add(where, "give a default or a type: (bool, int, float or str)")
            continue
        else:
            typ = type(default)
            if typ not in _OPTION_TYPES.values():
                problems.add(f"{where}.default", f"must be a bool, number or text, got {describe(default)}")
                continue
        if default is not REQUIRED:
            try:
                default = conform(default, typ)
            except Mismatch as e:
                problems.add(f"{where}.default", str(e))
                continue
        help_text = decl.get("help", "")
        options[name] = OptionSpec(name, typ, default, help_text if isinstance(help_text, str) else "")
    return options


def _parse_steps(
    raw: Any, lines: list[int | None], options: Mapping[str, OptionSpec], problems: Problems
) -> list[StepEntry]:
    if raw is REQUIRED:
        problems.add("", "no 'steps:' list; add one with at least one step")
        return []
    if not isinstance(raw, list):
        problems.add("steps", f"expected a list of steps (`- step: NAME`), got {describe(raw)}")
        return []
    if not raw:
        problems.add("steps", "the list is empty; add at least one step")
    entries: list[StepEntry] = []
    for i, item in enumerate(raw):
        number, line = i + 1, lines[i] if i < len(lines) else None
        at = f"step {number}" + (f" (line {line})" if line else "")
        if isinstance(item, str):
            item = {"step": item}
        if not isinstance(item, dict):
            problems.add(at, f"expected a step name or a mapping with 'step:', got {describe(item)}")
            continue
        if "step" not in item:
            keys = list(item)
            hint = (
                f"; write `- step: {keys[0]}` and put its parameters under `params:`"
                if len(keys) == 1
                else "; add `step: NAME`"
            )
            problems.add(at, "missing 'step:'" + hint)
            continue
        name = item["step"]
        if not isinstance(name, str) or not IDENTIFIER.match(name):
            problems.add(f"{at}: step", f"expected a step name, got {describe(name)}")
            continue
        entry = StepEntry(number, name, {}, None, line)
        at = entry.where()
        for key in item:
            if key not in _STEP_KEYS:
                problems.add(
                    f"{at}: {key}",
                    f"unknown key{did_you_mean(str(key), _STEP_KEYS)}; allowed: "
                    f"{', '.join(_STEP_KEYS)} (step parameters go under params:)",
                )
        params = item.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            problems.add(f"{at}: params", f"expected a mapping of parameter names, got {describe(params)}")
            params = {}
        earlier = {e.step: None for e in entries}  # their outputs are checked against the registry later
        for key, value in params.items():
            for where, text in strings_in(value):
                _check_template(text, options, earlier, f"{at}: params.{key}{where}", problems)
        when = _parse_when(item["when"], options, f"{at}: when", problems) if "when" in item else None
        entries.append(dataclasses.replace(entry, params=types.MappingProxyType(dict(params)), when=when))
    return entries


def _check_template(
    text: str, options: Mapping[str, OptionSpec], earlier: EarlierSteps, where: str, problems: Problems
) -> None:
    try:
        parts = parse_template(text)
        for part in parts:
            if isinstance(part, Ref):
                check_reference(part, options, earlier, in_text=len(parts) > 1)
    except Mismatch as e:
        problems.add(where, str(e))


_WHEN = re.compile(r"(not\s+)?\{?\s*([^{}\s]+)\s*\}?\Z")


def _parse_when(
    raw: Any, options: Mapping[str, OptionSpec], where: str, problems: Problems
) -> Condition | None:
    if isinstance(raw, bool):
        return Condition(str(raw).lower(), literal=raw)
    m = _WHEN.match(raw.strip()) if isinstance(raw, str) else None
    ref = parse_ref(m.group(2)) if m is not None else None
    if m is None or ref is None:
        problems.add(where, f"expected `options.NAME`, `not options.NAME` or true/false, got {describe(raw)}")
        return None
    if ref.path[0] == "steps":
        problems.add(where, f"{{{ref}}}: `when:` is decided before any step runs; use options.NAME")
        return None
    try:
        static_ref_type(ref, options, {})
    except Mismatch as e:
        problems.add(where, str(e))
        return None
    return Condition(raw.strip(), ref, negate=bool(m.group(1)))
