"""Checking a playbook against a step registry, and binding run options to their declared types."""

from __future__ import annotations

import typing
from typing import Any, Iterable, Mapping

from ..errors import InputError
from .document import OptionSpec, Playbook
from .registry import _STEP_NAME, StepRegistry
from .templates import Ref, _static_ref_type, parse_template
from .typecheck import REQUIRED, _conform, _did_you_mean, _kinds_fit, _Mismatch, _Problems, type_name


def validate_playbook(playbook: Playbook, registry: StepRegistry) -> None:
    """Every step exists and gets exactly its declared parameters with fitting types; raises one
    InputError listing every problem, naming file, step number, step name and field."""
    problems = _Problems(playbook.source)
    for entry in playbook.steps:
        at = entry.where()
        spec = registry.get(entry.step)
        if spec is None:
            problems.add(
                at,
                f"unknown step {entry.step!r}{_did_you_mean(entry.step, registry.names())}; "
                f"known steps: {', '.join(registry.names())}",
            )
            continue
        for key, value in entry.params.items():
            if key not in spec.params:
                takes = ", ".join(spec.params) or "no parameters"
                problems.add(
                    f"{at}: params.{key}",
                    f"unknown parameter{_did_you_mean(str(key), spec.params)}; {entry.step} takes: {takes}",
                )
                continue
            _check_param_type(value, spec.params[key].type, playbook.options, f"{at}: params.{key}", problems)
        for key, param in spec.params.items():
            if param.required and key not in entry.params:
                problems.add(
                    f"{at}: params.{key}",
                    f"missing required parameter ({type_name(param.type)}); add `{key}: ...` under params:",
                )
    problems.raise_if_any()


def _check_param_type(
    value: Any, typ: Any, options: Mapping[str, OptionSpec], where: str, problems: _Problems
) -> None:
    """Literal values must fit now; a whole-value reference must have a fitting kind."""
    if isinstance(value, str):
        try:
            parts = parse_template(value)
        except _Mismatch:
            return  # already reported by parse_playbook
        if len(parts) == 1 and isinstance(parts[0], Ref):
            try:
                hint = _static_ref_type(parts[0], options)
            except _Mismatch:
                return
            if not _kinds_fit(hint, typ):
                problems.add(
                    where,
                    f"{{{parts[0]}}} is of type {type_name(hint)} but the parameter "
                    f"takes {type_name(typ)}; embed it in text or reference another field",
                )
            return
    origin, args = typing.get_origin(typ) or typ, typing.get_args(typ)
    if origin is list and isinstance(value, list):
        for i, element in enumerate(value):
            _check_param_type(element, args[0] if args else Any, options, f"{where}[{i}]", problems)
        return
    if origin is dict and isinstance(value, dict):
        for key, element in value.items():
            _check_param_type(element, args[1] if args else Any, options, f"{where}.{key}", problems)
        return
    try:
        _conform(value, typ)
    except _Mismatch as e:
        problems.add(where + e.where, str(e))


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _from_text(text: str, typ: Any) -> Any:
    if typ is bool:
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise _Mismatch(f"expected true or false, got {text!r}")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise _Mismatch(f"expected {type_name(typ)}, got {text!r}") from None
    return text


def bind_options(playbook: Playbook, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run options: declared defaults overridden by `given`. None in `given` means "not set";
    text is converted to the declared type (for `--set purge=false`); an undeclared name is an error."""
    problems = _Problems(playbook.source)
    values = {name: opt.default for name, opt in playbook.options.items()}
    for name, value in (given or {}).items():
        if value is None:
            continue
        if name not in playbook.options:
            declared = ", ".join(playbook.options) or "none"
            problems.add(
                f"option {name!r}",
                f"playbook {playbook.name} has no such option"
                f"{_did_you_mean(name, playbook.options)}; it declares: {declared}",
            )
            continue
        typ = playbook.options[name].type
        try:
            values[name] = _conform(_from_text(value, typ) if isinstance(value, str) else value, typ)
        except _Mismatch as e:
            problems.add(f"option {name!r}", str(e))
    for name, value in values.items():
        if value is REQUIRED:
            problems.add(
                f"option {name!r}", f"required ({type_name(playbook.options[name].type)}) and not given"
            )
    problems.raise_if_any()
    return values


def parse_option_assignments(pairs: Iterable[str]) -> dict[str, str]:
    """["purge=false", "timeout=60"] -> {"purge": "false", "timeout": "60"} (types come later)."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _STEP_NAME.match(name.strip()):
            raise InputError(f"--set {pair!r}: write NAME=VALUE, e.g. --set purge=false")
        out[name.strip()] = value
    return out
