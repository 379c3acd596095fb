"""Templates in parameter values: "{job.cache_dir}/inductor", "{{" and "}}" for literal braces.
A lookup of plain data fields, never an evaluation; substituted text is never re-read."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .. import model
from .typecheck import Mismatch, did_you_mean, item_type, kind_of, record_type, type_name

if TYPE_CHECKING:
    from .document import OptionSpec

NAMESPACES = ("target", "job", "options", "steps")


@dataclasses.dataclass(frozen=True)
class Ref:
    path: tuple[str, ...]

    def __str__(self) -> str:
        return ".".join(self.path)


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]|[^{}]+")
_REF_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_REF_HELP = (
    "use {job.FIELD}, {target.FIELD}, {options.NAME} or {steps.STEP.OUTPUT}; "
    "write {{ and }} for literal braces"
)


def parse_ref(text: str) -> Ref | None:
    """`job.cache_dir` -> Ref(("job", "cache_dir")); None when the text is not a dotted name."""
    text = text.strip()
    return Ref(tuple(text.split("."))) if _REF_TEXT.match(text) else None


def parse_template(text: str) -> list[str | Ref]:
    """Literal text and references, in order; raises Mismatch on bad syntax."""
    parts: list[str | Ref] = []
    for m in _TEMPLATE_TOKEN.finditer(text):
        token = m.group(0)
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif m.group(1) is not None:
            ref = parse_ref(m.group(1))
            if ref is None:
                raise Mismatch(f"bad reference {token!r} in {text!r}: {_REF_HELP}")
            parts.append(ref)
        elif token in ("{", "}"):
            raise Mismatch(f"unmatched {token!r} in {text!r}: {_REF_HELP}")
        else:
            parts.append(token)
    return parts


def strings_in(value: Any) -> Iterable[tuple[str, Any]]:
    """(sub-path, string) for every string inside a param value."""
    if isinstance(value, str):
        yield "", value
    elif isinstance(value, list):
        for i, element in enumerate(value):
            for where, text in strings_in(element):
                yield f"[{i}]{where}", text
    elif isinstance(value, dict):
        for key, element in value.items():
            for where, text in strings_in(element):
                yield f".{key}{where}", text


@functools.lru_cache(maxsize=None)
def _public_fields(cls: type) -> dict[str, Any]:
    """Name -> type hint of a dataclass's fields and public properties (what templates may read)."""
    hints = typing.get_type_hints(cls)
    out = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    for name, attr in inspect.getmembers(cls, lambda a: isinstance(a, property)):
        if not name.startswith("_"):
            out[name] = typing.get_type_hints(attr.fget).get("return", Any)
    return out


def refs_in(value: Any) -> list[Ref]:
    """Every reference inside a param value (text that is not a valid template has none)."""
    found = []
    for _where, text in strings_in(value):
        try:
            found += [part for part in parse_template(text) if isinstance(part, Ref)]
        except Mismatch:
            continue
    return found


# What `{steps.STEP.OUTPUT}` may read at some point of a playbook: the steps before it, each with
# its declared output types (None while the step registry is not at hand).
EarlierSteps = Mapping[str, "Mapping[str, Any] | None"]


def static_ref_type(ref: Ref, options: Mapping[str, "OptionSpec"], earlier: EarlierSteps) -> Any:
    """The type hint a reference will have at run time, from the playbook's options, the outputs
    of the steps before and the inventory data model; raises Mismatch naming what is wrong."""
    root = ref.path[0]
    if root not in NAMESPACES:
        raise Mismatch(
            f"unknown reference {{{ref}}}: it must start with target., job., options. or steps."
            + did_you_mean(root, NAMESPACES)
        )
    if root == "steps":
        return _output_type(ref, earlier)
    if root == "options":
        if len(ref.path) != 2:
            raise Mismatch(f"bad reference {{{ref}}}: write {{options.NAME}}")
        name = ref.path[1]
        if name not in options:
            declared = ", ".join(options) or "none"
            raise Mismatch(
                f"unknown option {{{ref}}}: declare {name!r} under options: (declared: "
                f"{declared})" + did_you_mean(name, options)
            )
        return options[name].type
    hint: Any = model.Target if root == "target" else model.Job
    walked = root
    for attr in ref.path[1:]:
        record = record_type(hint)
        if record is None:
            raise Mismatch(
                f"bad reference {{{ref}}}: {walked} is of type {type_name(hint)}, it has no fields"
            )
        fields = _public_fields(record)
        if attr not in fields:
            raise Mismatch(
                f"unknown reference {{{ref}}}: {walked} has no field {attr!r}"
                + did_you_mean(attr, fields)
                + f" (fields: {', '.join(fields)})"
            )
        hint, walked = fields[attr], f"{walked}.{attr}"
    return hint


def _output_type(ref: Ref, earlier: EarlierSteps) -> Any:
    if len(ref.path) != 3:
        raise Mismatch(f"bad reference {{{ref}}}: write {{steps.STEP.OUTPUT}}")
    step, name = ref.path[1:]
    if step not in earlier:
        raise Mismatch(
            f"unknown reference {{{ref}}}: no step {step!r} runs before this one (earlier steps: "
            f"{', '.join(earlier) or 'none'})" + did_you_mean(step, earlier)
        )
    outputs = earlier[step]
    if outputs is None:
        return Any
    if name not in outputs:
        raise Mismatch(
            f"unknown reference {{{ref}}}: step {step} has no output {name!r}"
            + did_you_mean(name, outputs)
            + f" (outputs: {', '.join(outputs) or 'none'})"
        )
    return outputs[name]


def check_reference(
    ref: Ref, options: Mapping[str, "OptionSpec"], earlier: EarlierSteps, in_text: bool
) -> None:
    """Raise Mismatch when `ref` cannot resolve (static_ref_type), or, placed inside other text
    (`in_text`), when its value is a record or a list of them, which has no text form."""
    hint = static_ref_type(ref, options, earlier)
    if in_text:
        _check_embeddable(ref, hint)


def _check_embeddable(ref: Ref, hint: Any) -> None:
    kind = kind_of(hint)
    if kind in ("record", dict) or (kind is list and kind_of(item_type(hint)) in ("record", dict, list)):
        raise Mismatch(
            f"{{{ref}}} is of type {type_name(hint)} and cannot be put inside text; "
            "reference one of its fields, or make it the whole value"
        )


class Unresolved(Exception):
    pass


def _step_output(ref: Ref, outputs: Mapping[str, Mapping[str, Any]]) -> Any:
    if len(ref.path) != 3:
        raise Unresolved(f"{{{ref}}}: write {{steps.STEP.OUTPUT}}")
    step, name = ref.path[1:]
    if step not in outputs:
        raise Unresolved(f"{{{ref}}}: step {step} has not run before this one")
    value = outputs[step].get(name)
    if value is None or value == "":
        raise Unresolved(f"{{{ref}}} is empty: step {step} gave no {name}")
    return value


def _lookup(ref: Ref, roots: Mapping[str, Any], target_name: str) -> Any:
    if ref.path[0] == "steps":
        return _step_output(ref, roots.get("steps") or {})
    value, walked = roots.get(ref.path[0]), ref.path[0]
    for attr in ref.path[1:]:
        if value is None:
            raise Unresolved(f"{{{ref}}}: {walked} is not set for target {target_name!r}")
        if isinstance(value, Mapping) and attr in value:
            value = value[attr]
        elif (
            dataclasses.is_dataclass(value)
            and not isinstance(value, type)
            and not attr.startswith("_")
            and attr in _public_fields(type(value))
        ):
            value = getattr(value, attr)
        else:
            raise Unresolved(f"{{{ref}}}: {walked} has no field {attr!r}")
        walked = f"{walked}.{attr}"
    if value is None or value == "":
        raise Unresolved(
            f"{{{ref}}} is empty for target {target_name!r}; set {walked} in the "
            "inventory (an empty value would silently change a path or command)"
        )
    return value


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    return str(value)


def render(value: Any, roots: Mapping[str, Any], target_name: str = "") -> Any:
    """`value` with every template filled in, in one pass: substituted text is never re-read.

    A string that is exactly one reference keeps the referenced value's type ("{job.gpus}" is a
    list of ints); a reference inside longer text is written out (lists joined with commas).
    """
    if isinstance(value, str):
        parts = parse_template(value)
        if len(parts) == 1 and isinstance(parts[0], Ref):
            found = _lookup(parts[0], roots, target_name)
            return list(found) if isinstance(found, tuple) else found
        return "".join(p if isinstance(p, str) else _as_text(_lookup(p, roots, target_name)) for p in parts)
    if isinstance(value, list):
        return [render(v, roots, target_name) for v in value]
    if isinstance(value, dict):
        return {k: render(v, roots, target_name) for k, v in value.items()}
    return value
