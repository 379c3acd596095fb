"""Types of step parameters and options (bool, int, float, str, list[X], dict[str, X]), checking a
value against one, and collecting a playbook's problems into one error."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Iterable, Mapping

from ..errors import InputError


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_SCALARS = (bool, int, float, str)
_NoneType = type(None)


class Mismatch(Exception):
    """A value does not fit a type; `str()` is the complaint, `where` the sub-path (`[2]`)."""

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where


def type_name(typ: Any) -> str:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (list, dict) and args:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if typ is Any:
        return "any"
    return getattr(typ, "__name__", str(typ))


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def is_supported_type(typ: Any) -> bool:
    if typ in _SCALARS or typ in (list, dict, Any):
        return True
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is list and len(args) == 1:
        return is_supported_type(args[0])
    if origin is dict and len(args) == 2:
        return args[0] is str and is_supported_type(args[1])
    return False


def conform(value: Any, typ: Any) -> Any:
    """`value` checked against `typ` (ints widen to float, tuples become lists); else Mismatch."""
    origin = typing.get_origin(typ) or typ
    args = typing.get_args(typ)
    if typ is Any:
        return value
    if typ is bool and isinstance(value, bool):
        return value
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, str):
        return value
    if origin is list and isinstance(value, (list, tuple)):
        item = args[0] if args else Any
        out = []
        for i, element in enumerate(value):
            try:
                out.append(conform(element, item))
            except Mismatch as e:
                raise Mismatch(str(e), f"[{i}]{e.where}") from None
        return out
    if origin is dict and isinstance(value, Mapping):
        item = args[1] if args else Any
        out_map = {}
        for key, element in value.items():
            if not isinstance(key, str):
                raise Mismatch(f"keys must be text, got {describe(key)}")
            try:
                out_map[key] = conform(element, item)
            except Mismatch as e:
                raise Mismatch(str(e), f".{key}{e.where}") from None
        return out_map
    hint = {
        bool: "write true or false",
        int: "write a whole number",
        float: "write a number",
        str: "quote it",
        list: "write a YAML list",
        dict: "write a YAML mapping",
    }.get(origin, "")
    raise Mismatch(f"expected {type_name(typ)}, got {describe(value)}" + (f"; {hint}" if hint else ""))


def _without_none(hint: Any) -> Any:
    """`X | None` -> X; any other hint unchanged (a union of several types stays a union)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NoneType]
        if len(rest) == 1:
            return rest[0]
    return hint


def kind_of(hint: Any) -> Any:
    """Coarse kind of a type hint (bool/int/float/str/list/dict/'record'), None when unknown."""
    hint = _without_none(hint)
    origin = typing.get_origin(hint)
    if hint in _SCALARS:
        return hint
    if hint in (list, tuple) or origin in (list, tuple):
        return list
    if hint is dict or origin in (dict, Mapping):
        return dict
    if dataclasses.is_dataclass(hint):
        return "record"
    return None


def item_type(hint: Any) -> Any:
    """The element type of a list hint (`tuple[int, ...]` too); Any when it is not one type."""
    args = [a for a in typing.get_args(_without_none(hint)) if a is not Ellipsis]
    return args[0] if len(args) == 1 else Any


def record_type(hint: Any) -> type | None:
    """The dataclass a hint names (`Job | None` too), whose fields templates may read; else None."""
    hint = _without_none(hint)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def kinds_fit(source_hint: Any, target_type: Any) -> bool:
    src, dst = kind_of(source_hint), kind_of(target_type)
    if src is None or dst is None:
        return True
    if dst is float:
        return src in (int, float)
    if src != dst:
        return False
    if dst is list:
        return kinds_fit(item_type(source_hint), item_type(target_type))
    return True


class Problems:
    """Collects every problem of a playbook so the user fixes them in one go."""

    def __init__(self, source: str):
        self.source = source
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}" if where else message)

    def raise_if_any(self, what: str = "playbook") -> None:
        if len(self.items) == 1:
            raise InputError(f"{what} {self.source}: {self.items[0]}")
        if self.items:
            lines = "\n".join(f"  - {item}" for item in self.items)
            raise InputError(f"{what} {self.source} has {len(self.items)} problems:\n{lines}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
