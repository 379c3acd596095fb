"""Checking a playbook against a step registry, and binding run options to their declared types."""

from __future__ import annotations

import typing
from typing import Any, Iterable, Mapping

from ..errors import InputError
from .document import OptionSpec, Playbook
from .registry import IDENTIFIER, StepRegistry
from .templates import EarlierSteps, Ref, check_reference, parse_template, static_ref_type, strings_in
from .typecheck import REQUIRED, Mismatch, Problems, conform, did_you_mean, kinds_fit, type_name


def validate_playbook(playbook: Playbook, registry: StepRegistry) -> None:
    """Every step exists and gets exactly its declared parameters with fitting types; raises one
    InputError listing every problem, naming file, step number, step name and field."""
    problems = Problems(playbook.source)
    earlier: dict[str, Mapping[str, Any] | None] = {}
    for entry in playbook.steps:
        at = entry.where()
        spec = registry.get(entry.step)
        known = dict(earlier)
        earlier[entry.step] = spec.outputs if spec is not None else None
        if spec is None:
            problems.add(
                at,
                f"unknown step {entry.step!r}{did_you_mean(entry.step, registry.names())}; "
                f"known steps: {', '.join(registry.names())}",
            )
            continue
        for key, value in entry.params.items():
            if key not in spec.params:
                takes = ", ".join(spec.params) or "no parameters"
                problems.add(
                    f"{at}: params.{key}",
                    f"unknown parameter{did_you_mean(str(key), spec.params)}; {entry.step} takes: {takes}",
                )
                continue
            where = f"{at}: params.{key}"
            _check_step_refs(value, known, where, problems)
            _check_param_type(value, spec.params[key].type, playbook.options, known, where, problems)
        for key, param in spec.params.items():
            if param.required and key not in entry.params:
                problems.add(
                    f"{at}: params.{key}",
                    f"missing required parameter ({type_name(param.type)}); add `{key}: ...` under params:"
                    + (f" ({param.help})" if param.help else ""),
                )
    problems.raise_if_any()


def _check_step_refs(value: Any, earlier: EarlierSteps, where: str, problems: Problems) -> None:
    """`{steps.STEP.OUTPUT}` against the outputs STEP declares (parse_playbook, without the
    registry, checked only that STEP comes earlier)."""
    for sub, text in strings_in(value):
        try:
            parts = parse_template(text)
        except Mismatch:
            continue  # already reported by parse_playbook
        for part in parts:
            if isinstance(part, Ref) and part.path[0] == "steps":
                try:
                    check_reference(part, {}, earlier, in_text=len(parts) > 1)
                except Mismatch as e:
                    problems.add(where + sub, str(e))


def _check_param_type(
    value: Any,
    typ: Any,
    options: Mapping[str, OptionSpec],
    earlier: EarlierSteps,
    where: str,
    problems: Problems,
) -> None:
    """Literal values must fit now; a whole-value reference must have a fitting kind."""
    if isinstance(value, str):
        try:
            parts = parse_template(value)
        except Mismatch:
            return  # already reported by parse_playbook
        if len(parts) == 1 and isinstance(parts[0], Ref):
            try:
                hint = static_ref_type(parts[0], options, earlier)
            except Mismatch:
                return  # reported by parse_playbook or _check_step_refs
            if not kinds_fit(hint, typ):
                problems.add(
                    where,
                    f"{{{parts[0]}}} is of type {type_name(hint)} but the parameter "
                    f"takes {type_name(typ)}; embed it in text or reference another field",
                )
            return
    origin, args = typing.get_origin(typ) or typ, typing.get_args(typ)
    if origin is list and isinstance(value, list):
        for i, element in enumerate(value):
            _check_param_type(element, args[0] if args else Any, options, earlier, f"{where}[{i}]", problems)
        return
    if origin is dict and isinstance(value, dict):
        for key, element in value.items():
            _check_param_type(element, args[1] if args else Any, options, earlier, f"{where}.{key}", problems)
        return
    try:
        conform(value, typ)
    except Mismatch as e:
        problems.add(where + e.where, str(e))


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _from_text(text: str, typ: Any) -> Any:
    if typ is bool:
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise Mismatch(f"expected true or false, got {text!r}")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise Mismatch(f"expected {type_name(typ)}, got {text!r}") from None
    return text


def bind_options(playbook: Playbook, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run options: declared defaults overridden by `given`. None in `given` means "not set";
    text is converted to the declared type (for `--set purge=false`); an undeclared name is an error."""
    problems = Problems(playbook.source)
    values = {name: opt.default for name, opt in playbook.options.items()}
    for name, value in (given or {}).items():
        if value is None:
            continue
        if name not in playbook.options:
            declared = ", ".join(playbook.options) or "none"
            problems.add(
                f"option {name!r}",
                f"playbook {playbook.name} has no such option"
                f"{did_you_mean(name, playbook.options)}; it declares: {declared}",
            )
            continue
        typ = playbook.options[name].type
        try:
            values[name] = conform(_from_text(value, typ) if isinstance(value, str) else value, typ)
        except Mismatch as e:
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
        if not sep or not IDENTIFIER.match(name.strip()):
            raise InputError(f"--set {pair!r}: write NAME=VALUE, e.g. --set purge=false")
        out[name.strip()] = value
    return out
