"""Playbooks: ordered step lists in YAML, validated as a whole before anything runs.

A playbook names steps from a `StepRegistry` (the step library lives elsewhere and is passed in),
gives each its parameters, and may make a step conditional on a run option. Parameters may
reference the target, its job and the run options with `{job.cache_dir}`-style templates: a
lookup of plain data fields, never an evaluation; a value is substituted once and never re-parsed,
so hostile text in the inventory stays data.

    description: Stop the job and free its GPUs
    options:
      grace: {type: float, default: 30, help: seconds between the stop signal and kill}
    steps:
      - step: stop_session
        params: {session: "{job.session}", grace_s: "{options.grace}"}
      - step: purge_cache
        when: options.purge          # or "not options.x", or true/false
        params: {paths: ["{job.cache_dir}"]}
      - deploy                       # a bare name: a step with default parameters

A step is `fn(ctx: StepContext, **params) -> StepOutcome | str | None`; it fails by raising a
`DflashOpsError` (e.g. RemoteCommandError, TransportError, StepFailed) or returning
`StepOutcome(ok=False)`. Under dry-run it gets `ctx.dry_run=True` and a transport that can only
describe commands: `ctx.run` records the exact command line and returns None.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import os
import re
import time
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from . import model
from .errors import DflashOpsError, InputError, RemoteCommandError, StepFailed
from .transport.base import Result, Transport

ENV_PLAYBOOK_DIRS = "DFLASH_OPS_PLAYBOOKS"
SHIPPED_PLAYBOOKS = Path(__file__).resolve().parent.parent / "playbooks"
NAMESPACES = ("target", "job", "options")

OK, FAILED, SKIPPED, DRY_RUN, NOT_RUN = "ok", "failed", "skipped", "dry-run", "not-run"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class DryRunViolation(DflashOpsError):
    """A step tried to act on the target during --dry-run (a bug in that step)."""


# ---------------------------------------------------------------------------------------------
# Types of parameters and options: bool, int, float, str, list[X], dict[str, X] (X one of those).

_SCALARS = (bool, int, float, str)
_NoneType = type(None)


class _Mismatch(Exception):
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


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _is_supported_type(typ: Any) -> bool:
    if typ in _SCALARS or typ in (list, dict, Any):
        return True
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is list and len(args) == 1:
        return _is_supported_type(args[0])
    if origin is dict and len(args) == 2:
        return args[0] is str and _is_supported_type(args[1])
    return False


def _conform(value: Any, typ: Any) -> Any:
    """`value` checked against `typ` (ints widen to float, tuples become lists); else _Mismatch."""
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
                out.append(_conform(element, item))
            except _Mismatch as e:
                raise _Mismatch(str(e), f"[{i}]{e.where}") from None
        return out
    if origin is dict and isinstance(value, Mapping):
        item = args[1] if args else Any
        out_map = {}
        for key, element in value.items():
            if not isinstance(key, str):
                raise _Mismatch(f"keys must be text, got {_describe(key)}")
            try:
                out_map[key] = _conform(element, item)
            except _Mismatch as e:
                raise _Mismatch(str(e), f".{key}{e.where}") from None
        return out_map
    hint = {bool: "write true or false", int: "write a whole number", float: "write a number",
            str: "quote it", list: "write a YAML list", dict: "write a YAML mapping"}.get(origin, "")
    raise _Mismatch(f"expected {type_name(typ)}, got {_describe(value)}" + (f"; {hint}" if hint else ""))


def _kind(hint: Any) -> Any:
    """Coarse kind of a type hint (bool/int/float/str/list/dict/'record'), None when unknown."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NoneType]
        return _kind(rest[0]) if len(rest) == 1 else None
    if hint in _SCALARS:
        return hint
    if hint in (list, tuple) or origin in (list, tuple):
        return list
    if hint is dict or origin in (dict, Mapping):
        return dict
    if dataclasses.is_dataclass(hint):
        return "record"
    return None


def _item_hint(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NoneType]
        return _item_hint(rest[0]) if len(rest) == 1 else Any
    args = [a for a in typing.get_args(hint) if a is not Ellipsis]
    return args[0] if len(args) == 1 else Any


def _kinds_fit(source_hint: Any, target_type: Any) -> bool:
    src, dst = _kind(source_hint), _kind(target_type)
    if src is None or dst is None:
        return True
    if dst is float:
        return src in (int, float)
    if src != dst:
        return False
    if dst is list:
        return _kinds_fit(_item_hint(source_hint), _item_hint(target_type))
    return True


# ---------------------------------------------------------------------------------------------
# The step registry.

@dataclasses.dataclass(frozen=True)
class Param:
    """One declared step parameter. `default=REQUIRED` means the playbook must give it."""

    type: Any
    default: Any = REQUIRED
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclasses.dataclass(frozen=True)
class StepSpec:
    name: str
    fn: Callable[..., Any]
    params: Mapping[str, Param]
    doc: str = ""

    def signature(self) -> str:
        """`wait_gpu_free(gpus: list[int], timeout_s: float = 120.0)`, for listings."""
        parts = [f"{k}: {type_name(p.type)}" + ("" if p.required else f" = {p.default!r}")
                 for k, p in self.params.items()]
        return f"{self.name}({', '.join(parts)})"


_STEP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class StepRegistry:
    """Step names -> functions plus their declared parameters, so playbooks can be checked.

        registry = StepRegistry()

        @registry.step("wait_gpu_free", params={"gpus": list[int], "timeout_s": (float, 120.0)})
        def wait_gpu_free(ctx, gpus, timeout_s): ...

    A parameter is declared as a type (required), `(type, default)` or `Param(type, default, help)`.
    """

    def __init__(self) -> None:
        self._steps: dict[str, StepSpec] = {}

    def step(self, name: str, params: Mapping[str, Any] | None = None, doc: str | None = None):
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(name, fn, params, doc)
            return fn
        return register

    def add(self, name: str, fn: Callable[..., Any], params: Mapping[str, Any] | None = None,
            doc: str | None = None) -> StepSpec:
        # Mistakes here are programming errors in the step library: fail loudly at import time.
        if not _STEP_NAME.match(name):
            raise ValueError(f"step name {name!r} must be an identifier")
        if name in self._steps:
            raise ValueError(f"step {name!r} is registered twice")
        declared = {key: _as_param(name, key, spec) for key, spec in (params or {}).items()}
        try:
            inspect.signature(fn).bind(None, **{key: None for key in declared})
        except TypeError as e:
            raise ValueError(f"step {name!r}: function {fn.__name__} does not match its declared "
                             f"parameters {sorted(declared)}: {e}") from None
        spec = StepSpec(name, fn, types.MappingProxyType(declared),
                        doc if doc is not None else inspect.getdoc(fn) or "")
        self._steps[name] = spec
        return spec

    def get(self, name: str) -> StepSpec | None:
        return self._steps.get(name)

    def names(self) -> list[str]:
        return list(self._steps)

    def __contains__(self, name: object) -> bool:
        return name in self._steps

    def __iter__(self):
        return iter(self._steps.values())

    def __len__(self) -> int:
        return len(self._steps)


def _as_param(step: str, key: str, spec: Any) -> Param:
    if isinstance(spec, Param):
        param = spec
    elif isinstance(spec, tuple) and len(spec) == 2:
        param = Param(spec[0], spec[1])
    else:
        param = Param(spec)
    if not _is_supported_type(param.type):
        raise ValueError(f"step {step!r} parameter {key!r}: unsupported type {param.type!r}")
    if not param.required:
        try:
            _conform(param.default, param.type)
        except _Mismatch as e:
            raise ValueError(f"step {step!r} parameter {key!r}: default {e}") from None
    return param


# ---------------------------------------------------------------------------------------------
# Templates: "{job.cache_dir}/inductor", "{{" and "}}" for literal braces.

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
        raise _Mismatch(f"unknown reference {{{ref}}}: it must start with target., job. or options."
                        + _did_you_mean(root, NAMESPACES))
    if root == "options":
        if len(ref.path) != 2:
            raise _Mismatch(f"bad reference {{{ref}}}: write {{options.NAME}}")
        name = ref.path[1]
        if name not in options:
            declared = ", ".join(options) or "none"
            raise _Mismatch(f"unknown option {{{ref}}}: declare {name!r} under options: (declared: "
                            f"{declared})" + _did_you_mean(name, options))
        return options[name].type
    hint: Any = model.Target if root == "target" else model.Job
    walked = root
    for attr in ref.path[1:]:
        record = _record_type(hint)
        if record is None:
            raise _Mismatch(f"bad reference {{{ref}}}: {walked} is of type {type_name(hint)}, it has no fields")
        fields = _public_fields(record)
        if attr not in fields:
            raise _Mismatch(f"unknown reference {{{ref}}}: {walked} has no field {attr!r}"
                            + _did_you_mean(attr, fields) + f" (fields: {', '.join(fields)})")
        hint, walked = fields[attr], f"{walked}.{attr}"
    return hint


def _record_type(hint: Any) -> type | None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not _NoneType]
        return _record_type(rest[0]) if len(rest) == 1 else None
    return hint if dataclasses.is_dataclass(hint) else None


def _check_embeddable(ref: Ref, hint: Any) -> None:
    kind = _kind(hint)
    if kind in ("record", dict) or (kind is list and _kind(_item_hint(hint)) in ("record", dict, list)):
        raise _Mismatch(f"{{{ref}}} is of type {type_name(hint)} and cannot be put inside text; "
                        "reference one of its fields, or make it the whole value")


class _Unresolved(Exception):
    pass


def _lookup(ref: Ref, roots: Mapping[str, Any], target_name: str) -> Any:
    value, walked = roots.get(ref.path[0]), ref.path[0]
    for attr in ref.path[1:]:
        if value is None:
            raise _Unresolved(f"{{{ref}}}: {walked} is not set for target {target_name!r}")
        if isinstance(value, Mapping) and attr in value:
            value = value[attr]
        elif (dataclasses.is_dataclass(value) and not attr.startswith("_")
              and attr in _public_fields(type(value))):
            value = getattr(value, attr)
        else:
            raise _Unresolved(f"{{{ref}}}: {walked} has no field {attr!r}")
        walked = f"{walked}.{attr}"
    if value is None or value == "":
        raise _Unresolved(f"{{{ref}}} is empty for target {target_name!r}; set {walked} in the "
                          "inventory (an empty value would silently change a path or command)")
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


# ---------------------------------------------------------------------------------------------
# The playbook document.

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
            value = None if value is None else (value.get(attr) if isinstance(value, Mapping)
                                                else getattr(value, attr, None))
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


class _Problems:
    """Collects every problem of a playbook so the user fixes them in one go."""

    def __init__(self, source: str):
        self.source, self.items = source, []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{where}: {message}" if where else message)

    def raise_if_any(self, what: str = "playbook") -> None:
        if len(self.items) == 1:
            raise InputError(f"{what} {self.source}: {self.items[0]}")
        if self.items:
            lines = "\n".join(f"  - {item}" for item in self.items)
            raise InputError(f"{what} {self.source} has {len(self.items)} problems:\n{lines}")


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TOP_KEYS = ("description", "options", "steps")
_STEP_KEYS = ("step", "params", "when")
_OPTION_KEYS = ("type", "default", "help")
_OPTION_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def parse_playbook(text: str, source: str = "<string>", name: str | None = None) -> Playbook:
    """Parse and structurally check a playbook (shape, options, templates, `when`).

    Step names and parameters are checked against a registry by `validate_playbook`.
    """
    problems = _Problems(source)
    data, lines = _load_yaml(text, problems)
    problems.raise_if_any()
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        problems.add("", f"expected a mapping with a 'steps:' list at the top, got {got}")
        problems.raise_if_any()
    for key in data:
        if key not in _TOP_KEYS:
            problems.add(f"top-level key {key!r}", f"unknown key{_did_you_mean(str(key), _TOP_KEYS)}; "
                         f"allowed: {', '.join(_TOP_KEYS)}")
    description = data.get("description", "")
    if not isinstance(description, str):
        problems.add("description", f"expected text, got {_describe(description)}")
        description = ""
    options = _parse_options(data.get("options"), problems)
    steps = _parse_steps(data.get("steps", REQUIRED), lines, options, problems)
    problems.raise_if_any()
    if name is None:
        name = Path(source).stem if source != "<string>" else "playbook"
    return Playbook(name, source, description, types.MappingProxyType(options), tuple(steps))


def _load_yaml(text: str, problems: _Problems) -> tuple[Any, list[int | None]]:
    """The document and the 1-based line of each entry of its `steps:` list."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        problems.add("", f"not valid YAML: {e}".replace("\n", " "))
        return None, []
    finally:
        loader.dispose()
    lines: list[int | None] = []
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == "steps" and isinstance(value, yaml.SequenceNode):
                lines = [item.start_mark.line + 1 for item in value.value]
    return data, lines


def _parse_options(raw: Any, problems: _Problems) -> dict[str, OptionSpec]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add("options", f"expected a mapping of option names, got {_describe(raw)}")
        return {}
    options = {}
    for name, decl in raw.items():
        where = f"options.{name}"
        if not isinstance(name, str) or not _STEP_NAME.match(name):
            problems.add(where, "option names must be identifiers (letters, digits, _)")
            continue
        if not isinstance(decl, dict):
            decl = {"default": decl}  # shorthand `purge: true`: the type follows the default
        for key in decl:
            if key not in _OPTION_KEYS:
                problems.add(f"{where}.{key}", f"unknown key{_did_you_mean(str(key), _OPTION_KEYS)}; "
                             f"allowed: {', '.join(_OPTION_KEYS)}")
        default = decl.get("default", REQUIRED)
        if "type" in decl:
            typ = _OPTION_TYPES.get(decl["type"]) if isinstance(decl["type"], str) else None
            if typ is None:
                problems.add(f"{where}.type", f"unknown type {decl['type']!r}; use one of "
                             f"{', '.join(_OPTION_TYPES)}")
                continue
        elif default is REQUIRED or default is None:
            problems.add(where, "give a default or a type: (bool, int, float or str)")
            continue
        else:
            typ = type(default)
            if typ not in _OPTION_TYPES.values():
                problems.add(f"{where}.default", f"must be a bool, number or text, got {_describe(default)}")
                continue
        if default is not REQUIRED:
            try:
                default = _conform(default, typ)
            except _Mismatch as e:
                problems.add(f"{where}.default", str(e))
                continue
        help_text = decl.get("help", "")
        options[name] = OptionSpec(name, typ, default, help_text if isinstance(help_text, str) else "")
    return options


def _parse_steps(raw: Any, lines: list[int | None], options: Mapping[str, OptionSpec],
                 problems: _Problems) -> list[StepEntry]:
    if raw is REQUIRED:
        problems.add("", "no 'steps:' list; add one with at least one step")
        return []
    if not isinstance(raw, list):
        problems.add("steps", f"expected a list of steps (`- step: NAME`), got {_describe(raw)}")
        return []
    if not raw:
        problems.add("steps", "the list is empty; add at least one step")
    entries = []
    for i, item in enumerate(raw):
        number, line = i + 1, lines[i] if i < len(lines) else None
        at = f"step {number}" + (f" (line {line})" if line else "")
        if isinstance(item, str):
            item = {"step": item}
        if not isinstance(item, dict):
            problems.add(at, f"expected a step name or a mapping with 'step:', got {_describe(item)}")
            continue
        if "step" not in item:
            keys = list(item)
            hint = (f"; write `- step: {keys[0]}` and put its parameters under `params:`"
                    if len(keys) == 1 else "; add `step: NAME`")
            problems.add(at, "missing 'step:'" + hint)
            continue
        name = item["step"]
        if not isinstance(name, str) or not _STEP_NAME.match(name):
            problems.add(f"{at}: step", f"expected a step name, got {_describe(name)}")
            continue
        entry = StepEntry(number, name, {}, None, line)
        at = entry.where()
        for key in item:
            if key not in _STEP_KEYS:
                problems.add(f"{at}: {key}", f"unknown key{_did_you_mean(str(key), _STEP_KEYS)}; allowed: "
                             f"{', '.join(_STEP_KEYS)} (step parameters go under params:)")
        params = item.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            problems.add(f"{at}: params", f"expected a mapping of parameter names, got {_describe(params)}")
            params = {}
        for key, value in params.items():
            for where, text in _refs_in(value):
                _check_template(text, options, f"{at}: params.{key}{where}", problems)
        when = _parse_when(item["when"], options, f"{at}: when", problems) if "when" in item else None
        entries.append(dataclasses.replace(entry, params=types.MappingProxyType(dict(params)), when=when))
    return entries


def _check_template(text: str, options: Mapping[str, OptionSpec], where: str, problems: _Problems) -> None:
    try:
        parts = parse_template(text)
        for part in parts:
            if isinstance(part, Ref):
                hint = _static_ref_type(part, options)
                if len(parts) > 1:
                    _check_embeddable(part, hint)
    except _Mismatch as e:
        problems.add(where, str(e))


_WHEN = re.compile(r"(not\s+)?\{?\s*([^{}\s]+)\s*\}?\Z")


def _parse_when(raw: Any, options: Mapping[str, OptionSpec], where: str, problems: _Problems) -> Condition | None:
    if isinstance(raw, bool):
        return Condition(str(raw).lower(), literal=raw)
    m = _WHEN.match(raw.strip()) if isinstance(raw, str) else None
    if m is None or not _REF_TEXT.match(m.group(2)):
        problems.add(where, f"expected `options.NAME`, `not options.NAME` or true/false, got {_describe(raw)}")
        return None
    ref = Ref(tuple(m.group(2).split(".")))
    try:
        _static_ref_type(ref, options)
    except _Mismatch as e:
        problems.add(where, str(e))
        return None
    return Condition(raw.strip(), ref, negate=bool(m.group(1)))


# ---------------------------------------------------------------------------------------------
# Finding playbooks.

def playbook_search_dirs(playbook_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                         inventory_path: str | os.PathLike | None = None,
                         environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where playbooks are looked up by name, first match wins: --playbook-dir, $DFLASH_OPS_PLAYBOOKS
    (os.pathsep-separated), <inventory's dir>/playbooks, then the playbooks shipped with dflash-ops.
    A directory the user named explicitly must exist."""
    environ = os.environ if environ is None else environ
    explicit = [playbook_dir] if isinstance(playbook_dir, (str, os.PathLike)) else list(playbook_dir or [])
    dirs: list[Path] = []
    for d in explicit:
        if not Path(d).is_dir():
            raise InputError(f"--playbook-dir {d}: no such directory; give a directory holding NAME.yaml files")
    dirs += [Path(d) for d in explicit]
    for d in filter(None, environ.get(ENV_PLAYBOOK_DIRS, "").split(os.pathsep)):
        if not Path(d).is_dir():
            raise InputError(f"${ENV_PLAYBOOK_DIRS}: {d} is not a directory; fix or unset the variable")
        dirs.append(Path(d))
    if inventory_path is not None and (Path(inventory_path).parent / "playbooks").is_dir():
        dirs.append(Path(inventory_path).parent / "playbooks")
    dirs.append(SHIPPED_PLAYBOOKS)
    unique: list[Path] = []
    for d in dirs:
        if d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def list_playbooks(search_dirs: Sequence[str | os.PathLike]) -> dict[str, Path]:
    """name -> file of every playbook found; an earlier directory shadows a later one."""
    found: dict[str, Path] = {}
    for d in search_dirs:
        if Path(d).is_dir():
            for path in sorted(Path(d).iterdir()):
                if path.suffix in (".yaml", ".yml") and path.is_file():
                    found.setdefault(path.stem, path)
    return found


def load_playbook(name_or_path: str | os.PathLike, search_dirs: Sequence[str | os.PathLike] | None = None,
                  registry: StepRegistry | None = None) -> Playbook:
    """A playbook by name (searched in `search_dirs`, default `playbook_search_dirs()`) or by path;
    checked against `registry` too when one is given."""
    text_name = os.fspath(name_or_path)
    looks_like_path = ("/" in text_name or os.sep in text_name or text_name.endswith((".yaml", ".yml")))
    if looks_like_path:
        path = Path(text_name)
        if not path.is_file():
            raise InputError(f"playbook file {text_name} not found; give an existing .yaml file or a playbook name")
    else:
        dirs = playbook_search_dirs() if search_dirs is None else search_dirs
        available = list_playbooks(dirs)
        if text_name not in available:
            names = ", ".join(sorted(available)) or "none"
            raise InputError(f"no playbook named {text_name!r}{_did_you_mean(text_name, available)}; "
                             f"available: {names} (searched {', '.join(str(d) for d in dirs)})")
        path = available[text_name]
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"playbook {path}: cannot read it: {e}") from None
    playbook = parse_playbook(text, str(path), path.stem)
    if registry is not None:
        validate_playbook(playbook, registry)
    return playbook


# ---------------------------------------------------------------------------------------------
# Checking a playbook against a registry, and binding run options.

def validate_playbook(playbook: Playbook, registry: StepRegistry) -> None:
    """Every step exists and gets exactly its declared parameters with fitting types; raises one
    InputError listing every problem, naming file, step number, step name and field."""
    problems = _Problems(playbook.source)
    for entry in playbook.steps:
        at = entry.where()
        spec = registry.get(entry.step)
        if spec is None:
            problems.add(at, f"unknown step {entry.step!r}{_did_you_mean(entry.step, registry.names())}; "
                         f"known steps: {', '.join(registry.names())}")
            continue
        for key, value in entry.params.items():
            if key not in spec.params:
                takes = ", ".join(spec.params) or "no parameters"
                problems.add(f"{at}: params.{key}", f"unknown parameter{_did_you_mean(str(key), spec.params)}; "
                             f"{entry.step} takes: {takes}")
                continue
            _check_param_type(value, spec.params[key].type, playbook.options, f"{at}: params.{key}", problems)
        for key, param in spec.params.items():
            if param.required and key not in entry.params:
                problems.add(f"{at}: params.{key}", f"missing required parameter ({type_name(param.type)}); "
                             f"add `{key}: ...` under params:")
    problems.raise_if_any()


def _check_param_type(value: Any, typ: Any, options: Mapping[str, OptionSpec], where: str,
                      problems: _Problems) -> None:
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
                problems.add(where, f"{{{parts[0]}}} is of type {type_name(hint)} but the parameter "
                             f"takes {type_name(typ)}; embed it in text or reference another field")
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
            problems.add(f"option {name!r}", f"playbook {playbook.name} has no such option"
                         f"{_did_you_mean(name, playbook.options)}; it declares: {declared}")
            continue
        typ = playbook.options[name].type
        try:
            values[name] = _conform(_from_text(value, typ) if isinstance(value, str) else value, typ)
        except _Mismatch as e:
            problems.add(f"option {name!r}", str(e))
    for name, value in values.items():
        if value is REQUIRED:
            problems.add(f"option {name!r}", f"required ({type_name(playbook.options[name].type)}) and not given")
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


# ---------------------------------------------------------------------------------------------
# Running.

@dataclasses.dataclass
class StepOutcome:
    """What a step returns: a one-line message, the commands it ran (or would run), data for later
    steps (`ctx.results[step_name]`), and ok=False to fail without raising."""

    message: str = ""
    commands: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    ok: bool = True

    @classmethod
    def failed(cls, message: str, **kwargs: Any) -> "StepOutcome":
        return cls(message, ok=False, **kwargs)


def _ignore(_message: str) -> None:
    pass


@dataclasses.dataclass
class StepContext:
    """Everything a step may use. The caller builds one per target; the engine hands each step a
    copy with `options` bound, `dry_run` set, `step`/`number` filled and a fresh `commands` list."""

    target: Any = None  # model.Target
    transport: Transport | None = None
    job: Any = None  # model.Job; defaults to target.job
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dry_run: bool = False
    log: Callable[[str], None] = _ignore
    status: Callable[[str], None] = _ignore  # a transient progress line; each replaces the last
    step: str = ""
    number: int = 0
    commands: list[str] = dataclasses.field(default_factory=list)
    results: dict[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.job is None and self.target is not None:
            self.job = getattr(self.target, "job", None)

    @property
    def target_name(self) -> str:
        name = getattr(self.target, "name", None) or getattr(self.transport, "name", None)
        return name or "?"

    def run(self, script: str, *, timeout: float = 60.0, check: bool = True,
            stdin: bytes | None = None) -> Result | None:
        """Run `script` on the target and record its exact command line. Under dry-run: only
        record it and return None (a step must not depend on output it cannot have)."""
        transport = self._transport()
        self.commands.append(transport.command_line(script, timeout))
        if self.dry_run:
            return None
        runner = transport.check if check else transport.run
        return runner(script, timeout=timeout, step=self.step or "run", stdin=stdin)

    def run_on_host(self, script: str, *, timeout: float = 60.0, check: bool = True) -> Result | None:
        """Like run, but on the Proxmox host of a pct target (real pids, the host's nvidia-smi)."""
        transport = self._transport()
        self.commands.append(transport.host_command_line(script, timeout))
        if self.dry_run:
            return None
        result = transport.run_on_host(script, timeout=timeout, step=self.step or "run")
        if check and not result.ok:
            raise RemoteCommandError(self.target_name, self.step or "run", result)
        return result

    def put(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        """Write `data` to `remote_path` on the target (atomically); under dry-run only record it."""
        transport = self._transport()
        self.commands.append(f"# put {len(data)} bytes -> {remote_path} (mode {mode:04o})")
        if not self.dry_run:
            transport.put(data, remote_path, mode=mode, step=self.step or "put")

    def _transport(self) -> Transport:
        if self.transport is None:
            raise StepFailed(f"[{self.target_name}] {self.step}: no transport to reach the target")
        return self.transport


class DryRunTransport(Transport):
    """Stands in for the real transport under --dry-run: describes commands, refuses to act, so a
    step that forgets to check ctx.dry_run fails instead of touching the target."""

    def __init__(self, real: Transport):
        super().__init__(real.name)
        self.real = real

    def run(self, script: str, timeout: float = 60, step: str = "run", stdin: bytes | None = None) -> Result:
        raise DryRunViolation(f"[{self.name}] {step}: tried to run a command during --dry-run "
                              "(the step must use ctx.run or check ctx.dry_run)")

    def put(self, data: bytes, remote_path: str, mode: int = 0o644, step: str = "put") -> None:
        raise DryRunViolation(f"[{self.name}] {step}: tried to write {remote_path} during --dry-run")

    def interactive(self, script: str) -> int:
        raise DryRunViolation(f"[{self.name}]: tried to attach a terminal during --dry-run")

    def command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.command_line(script, timeout)

    def host_command_line(self, script: str, timeout: float = 60) -> str:
        return self.real.host_command_line(script, timeout)


@dataclasses.dataclass(frozen=True)
class StepReport:
    number: int
    step: str
    status: str  # ok | failed | skipped | dry-run | not-run
    seconds: float = 0.0
    message: str = ""
    commands: tuple[str, ...] = ()
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class PlaybookResult:
    playbook: str
    target: str
    dry_run: bool
    steps: tuple[StepReport, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def failed(self) -> StepReport | None:
        return next((s for s in self.steps if s.status == FAILED), None)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def summary(self) -> str:
        total, mode = len(self.steps), " (dry run)" if self.dry_run else ""
        bad = self.failed
        if bad is None:
            done = sum(s.status in (OK, DRY_RUN) for s in self.steps)
            return (f"[{self.target}] {self.playbook}{mode}: ok, {done} of {total} steps run, "
                    f"{total - done} skipped ({self.seconds:.1f}s)")
        return (f"[{self.target}] {self.playbook}{mode}: FAILED at step {bad.number}/{total} {bad.step} "
                f"after {self.seconds:.1f}s: {bad.message}")


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress event: a step starts, logs a line, or ends (with its report)."""

    event: str  # start | log | status (transient) | end
    number: int
    total: int
    step: str
    target: str = ""
    message: str = ""
    report: StepReport | None = None


def format_progress(p: Progress, with_target: bool = False, show_commands: bool = True) -> str:
    """`[3/7] wait_gpu_free ... ok (4.2s) GPUs 1,2,3 free`; dry-run lists the commands below."""
    head = (f"[{p.target}] " if with_target else "") + f"[{p.number}/{p.total}] {p.step} ..."
    if p.event == "start":
        return head
    if p.event in ("log", "status"):
        return (f"[{p.target}] " if with_target else "") + f"      {p.message}"
    r = p.report
    assert r is not None
    line = f"{head} {r.status}"
    if r.status in (OK, FAILED, DRY_RUN):
        line += f" ({r.seconds:.1f}s)"
    if r.status == SKIPPED:
        return f"{line} ({r.message})"
    if r.message:
        first, *rest = r.message.splitlines()
        line += f" {first}" + "".join(f"\n      {x}" for x in rest)
    if show_commands and r.status == DRY_RUN:
        for command in r.commands:
            line += "\n      $ " + command.replace("\n", "\n        ")
    return line


@dataclasses.dataclass(frozen=True)
class _Planned:
    entry: StepEntry
    spec: StepSpec
    params: Mapping[str, Any]
    skip_reason: str = ""


def plan_playbook(playbook: Playbook, registry: StepRegistry, ctx: StepContext
                  ) -> tuple[dict[str, Any], list[_Planned]]:
    """Validate, bind options, decide `when`, and fill in every parameter of every step that will
    run: all input problems surface here, before the first step touches anything."""
    validate_playbook(playbook, registry)
    options = bind_options(playbook, ctx.options)
    roots = {"target": ctx.target, "job": ctx.job, "options": options}
    problems = _Problems(playbook.source)
    planned = []
    for entry in playbook.steps:
        spec = registry.get(entry.step)
        assert spec is not None
        if entry.when is not None and not entry.when.holds(roots):
            planned.append(_Planned(entry, spec, {}, entry.when.why_not()))
            continue
        params = {}
        for key, param in spec.params.items():
            if key not in entry.params:
                params[key] = copy.deepcopy(param.default)
                continue
            where = f"{entry.where()}: params.{key}"
            try:
                params[key] = _conform(render(entry.params[key], roots, ctx.target_name), param.type)
            except _Unresolved as e:
                problems.add(where, str(e))
            except _Mismatch as e:
                problems.add(where + e.where, f"after filling in templates: {e}")
        planned.append(_Planned(entry, spec, params))
    problems.raise_if_any()
    return options, planned


def run_playbook(playbook: Playbook, registry: StepRegistry, ctx: StepContext, dry_run: bool = False,
                 on_progress: Callable[[Progress], None] | None = None) -> PlaybookResult:
    """Run the steps in order and stop at the first failure; later steps are reported `not-run`.

    Raises InputError (nothing has run) for any problem in the playbook, options or templates.
    Step failures do not raise: they are in the result (`result.ok`, `result.failed`).
    """
    options, planned = plan_playbook(playbook, registry, ctx)
    dry_run = dry_run or ctx.dry_run
    emit = on_progress or (lambda _p: None)
    transport = DryRunTransport(ctx.transport) if dry_run and ctx.transport is not None else ctx.transport
    base = dataclasses.replace(ctx, options=types.MappingProxyType(options), dry_run=dry_run,
                               transport=transport, results={})
    total, target, reports = len(planned), ctx.target_name, []
    started = time.monotonic()
    failed = False
    for item in planned:
        number, name = item.entry.number, item.entry.step

        def progress(event: str, message: str = "", report: StepReport | None = None,
                     _number: int = number, _name: str = name) -> None:
            emit(Progress(event, _number, total, _name, target, message, report))

        if failed or item.skip_reason:
            report = StepReport(number, name, NOT_RUN if failed else SKIPPED, message=item.skip_reason)
            reports.append(report)
            progress("end", report=report)
            continue
        progress("start")
        step_ctx = dataclasses.replace(base, step=name, number=number, commands=[],
                                       log=lambda message, _p=progress: _p("log", message),
                                       status=lambda message, _p=progress: _p("status", message))
        report = _call_step(item, step_ctx, dry_run)
        base.results[name] = report.data
        reports.append(report)
        progress("end", report=report)
        failed = report.status == FAILED
    return PlaybookResult(playbook.name, target, dry_run, tuple(reports), time.monotonic() - started)


def _call_step(item: _Planned, ctx: StepContext, dry_run: bool) -> StepReport:
    started = time.monotonic()
    error: BaseException | None = None
    try:
        outcome = item.spec.fn(ctx, **copy.deepcopy(item.params))
        if outcome is None or isinstance(outcome, str):
            outcome = StepOutcome(outcome or "")
        elif not isinstance(outcome, StepOutcome):
            raise TypeError(f"step {item.spec.name} returned {_describe(outcome)}; expected StepOutcome")
        status = (DRY_RUN if dry_run else OK) if outcome.ok else FAILED
        message, data, extra = outcome.message, dict(outcome.data), list(outcome.commands)
    except DflashOpsError as e:
        status, message, data, extra, error = FAILED, str(e), {}, [], e
    except Exception as e:  # a bug in a step: stop here and show it rather than run on blindly
        status, message, data, extra, error = FAILED, f"{type(e).__name__}: {e}", {}, [], e
    return StepReport(item.entry.number, item.entry.step, status, time.monotonic() - started,
                      message, tuple(ctx.commands + extra), data, error)
