"""Templates in parameter values: "{job.cache_dir}/inductor", "{{" and "}}" for literal braces.
A lookup of plain data fields, never an evaluation; substituted text is never re-read."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
import typing
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .. import model
from .typecheck import _did_you_mean, _item_hint, _kind, _Mismatch, _NoneType, type_name

if TYPE_CHECKING:
    from .document import OptionSpec

NAMESPACES = ("target", "job", "options")


@dataclasses.dataclass(frozen=True)
class Ref:
    path: tuple[str, ...]

    def __str__(self) -> str:
        return ".".join(self.path)


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]|[^{}]+")
_REF_TEXT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_REF_HELP = "use {job.FIELD}, {target.FIELD} or {options.NAME}; write {{ and }} for literal braces"


def parse_template(text: str) -> list[str | Ref]:
    """Literal text and references, in order; raises _Mismatch on bad syntax."""
    parts: list[str | Ref] = []
    for m in _TEMPLATE_TOKEN.finditer(text):
        token = m.group(0)
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif m.group(1) is not None:
            inner = m.group(1).strip()
            if not _REF_TEXT.match(inner):
                raise _Mismatch(f"bad reference {token!r} in {text!r}: {_REF_HELP}")
            parts.append(Ref(tuple(inner.split("."))))
        elif token in ("{", "}"):
            raise _Mismatch(f"unmatched {token!r} in {text!r}: {_REF_HELP}")
        else:
            parts.append(token)
    return parts


def _refs_in(value: Any) -> Iterable[tuple[str, Any]]:
    """(sub-path, string) for every string inside a param value."""
    if isinstance(value, str):
        yield "", value
    elif isinstance(value, list):
        for i, element in enumerate(value):
            for where, text in _refs_in(element):
                yield f"[{i}]{where}", text
    elif isinstance(value, dict):
        for key, element in value.items():
            for where, text in _refs_in(element):
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


def _static_ref_type(ref: Ref, options: Mapping[str, "OptionSpec"]) -> Any:
    """The type hint a reference will have at run time, from the playbook's options and the
    inventory data model; raises _Mismatch naming what is wrong."""
    root = ref.path[0]
    if root not in NAMESPACES:
        raise _Mismatch(
            f"unknown reference {{{ref}}}: it must start with target., job. or options."
            + _did_you_mean(root, NAMESPACES)
        )
    if root == "options":
        if len(ref.path) != 2:
            raise _Mismatch(f"bad reference {{{ref}}}: write {{options.NAME}}")
        name = ref.path[1]
        if name not in options:
            declared = ", ".join(options) or "none"
            raise _Mismatch(
                f"unknown option {{{ref}}}: declare {name!r} under options: (declared: "
                f"{declared})" + _did_you_mean(name, options)
            )
        return options[name].type
    hint: Any = model.Target if root == "target" else model.Job
    walked = root
    for attr in ref.path[1:]:
        record = _record_type(hint)
        if record is None:
            raise _Mismatch(
                f"bad reference {{{ref}}}: {walked} is of type {type_name(hint)}, it has no fields"
            )
        fields = _public_fields(record)
        if attr not in fields:
            raise _Mismatch(
                f"unknown reference {{{ref}}}: {walked} has no field {attr!r}"
                + _did_you_mean(attr, fields)
                + f" (fields: {', '.join(fields)})"
            )
        hint, walked = fields[attr], f"{walked}.{attr}"
    return hint


def _record_type(hint: Any) -> type | None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NoneType]
        return _record_type(rest[0]) if len(rest) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _check_embeddable(ref: Ref, hint: Any) -> None:
    kind = _kind(hint)
    if kind in ("record", dict) or (kind is list and _kind(_item_hint(hint)) in ("record", dict, list)):
        raise _Mismatch(
            f"{{{ref}}} is of type {type_name(hint)} and cannot be put inside text; "
            "reference one of its fields, or make it the whole value"
        )


class _Unresolved(Exception):
    pass


def _lookup(ref: Ref, roots: Mapping[str, Any], target_name: str) -> Any:
    value, walked = roots.get(ref.path[0]), ref.path[0]
    for attr in ref.path[1:]:
        if value is None:
            raise _Unresolved(f"{{{ref}}}: {walked} is not set for target {target_name!r}")
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
            raise _Unresolved(f"{{{ref}}}: {walked} has no field {attr!r}")
        walked = f"{walked}.{attr}"
    if value is None or value == "":
        raise _Unresolved(
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
