"""YAML that users write, read strictly and turned into typed dataclasses, with one-line errors.

Shared by the trainer and dflash-ops (stdlib and PyYAML only), so both read YAML the same way:
duplicate keys refused, only true/false booleans (YAML 1.2), every problem one `FILE:LINE` line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Iterable, Mapping

import yaml

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = typing.TypeVar("T", bound="DataclassInstance")  # build() makes dataclasses


class YamlInputError(ValueError):
    """Bad input, said in one line that names the file, the line, the field and the fix."""


def located(filename: str, line: int | str | None) -> str:
    """`FILE:LINE`, `FILE` when the line is unknown, or the command-line flag that set the value."""
    if isinstance(line, str):
        return line
    return f"{filename}:{line}" if line else filename


def show(value: Any) -> str:
    """repr, cut to 60 characters: a message stays one readable line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def kind_of(value: Any) -> str:
    """What a value is, for 'expected X, got ...': 'the text 'abc'', 'a list', 'the boolean true'."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the text {show(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__} ({value})"


def closest_match(word: str, choices: Iterable[str]) -> str | None:
    """The choice `word` was most likely meant to be (a typo), or None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, choices: Iterable[str], quote=repr) -> str:
    """'did you mean 'host'?' for a near miss, else ''."""
    match = closest_match(word, choices)
    return f"did you mean {quote(match)}?" if match is not None else ""


def finite(value: Any) -> float | None:
    """A real, finite number as float, else None (JSON has no NaN; a boolean is no measurement)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


class YamlMap(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    def __init__(self, line: int = 0):
        super().__init__()
        self.line = line
        self.key_lines: dict = {}

    @classmethod
    def of(cls, data: Mapping) -> YamlMap:
        """A plain mapping (from code, not a file) as a YamlMap with no lines, nested ones too."""
        wrapped = cls()
        for key, value in data.items():
            is_plain = isinstance(value, dict) and not isinstance(value, YamlMap)
            wrapped[key] = cls.of(value) if is_plain else value
        return wrapped


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with only true/false as booleans (YAML 1.2): `host_key_policy: off` stays text."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _construct_map(loader: _StrictLoader, node: yaml.MappingNode) -> YamlMap:
    loader.flatten_mapping(node)  # applies `<<: *anchor` merges; later keys win
    result = YamlMap(node.start_mark.line + 1)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a plain name, not a list or mapping", key_node.start_mark
            ) from None
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def _refuse_duplicate_keys(
    node, path: tuple, seen_nodes: set, named_items: Mapping[str, str], filename: str
) -> None:
    """Refuse two equal keys written in one mapping (PyYAML keeps the last); merged keys may be overridden."""
    if id(node) in seen_nodes:  # an alias of a node already checked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, seen_nodes, named_items, filename)
    elif isinstance(node, yaml.MappingNode):
        first_lines: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key_node.tag != _MERGE_TAG:
                line = key_node.start_mark.line + 1
                if key in first_lines:
                    raise YamlInputError(
                        f"{filename}:{line}: {_describe_key(path, key, named_items)} is defined twice "
                        f"(also on line {first_lines[key]}); YAML would silently keep only the last one: "
                        "rename or remove one of them"
                    )
                first_lines[key] = line
            _refuse_duplicate_keys(value_node, path + (key,), seen_nodes, named_items, filename)


def _describe_key(path: tuple, key: str, named_items: Mapping[str, str]) -> str:
    if len(path) == 1 and path[0] in named_items:
        return f"{named_items[path[0]]} {key!r}"
    return f"key {key!r}" + (f" under {'.'.join(map(str, path))}" if path else "")


def parse_yaml(text: str, filename: str, named_items: Mapping[str, str] | None = None) -> Any:
    """Parse YAML text strictly; any problem is one YamlInputError naming `filename` and the line.
    `named_items` ({"targets": "target"}) names what sections hold, for duplicate-key messages."""
    try:
        loader = _StrictLoader(text)  # its reader refuses control bytes (NUL, BEL …) here, and only here
    except yaml.reader.ReaderError as e:
        raise _control_byte(text, filename, e) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, (), set(), named_items or {}, filename)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        column = f" (column {mark.column + 1})" if mark else ""
        problem = " ".join(p for p in (e.context, e.problem) if p)
        where = located(filename, mark.line + 1 if mark else None)
        raise YamlInputError(f"{where}: not valid YAML: {problem}{column}; fix the syntax there") from None
    except yaml.YAMLError as e:
        raise YamlInputError(
            f"{filename}: not valid YAML: {' '.join(str(e).split())}; fix the syntax"
        ) from None
    finally:
        loader.dispose()


def _control_byte(text: str, filename: str, error: yaml.reader.ReaderError) -> YamlInputError:
    position = error.position if isinstance(error.position, int) else 0
    line = text.count("\n", 0, position) + 1
    character = (
        error.character if isinstance(error.character, int) else ord(text[position : position + 1] or " ")
    )
    return YamlInputError(
        f"{located(filename, line)}: character {character:#04x} (a control byte) is not allowed in YAML; "
        "remove it (a copy from a terminal or a binary file?)"
    )


def read_yaml(path: str, named_items: Mapping[str, str] | None = None) -> Any:
    """Read and parse a YAML file; an unreadable file is a YamlInputError too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise YamlInputError(f"{path}: file not found; check the path") from None
    except IsADirectoryError:
        raise YamlInputError(f"{path}: is a directory, not a YAML file; give the file's path") from None
    except PermissionError:
        raise YamlInputError(f"{path}: permission denied; make the file readable") from None
    except UnicodeDecodeError as e:
        raise YamlInputError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise YamlInputError(f"{path}: cannot read it ({e.strerror}); check the file") from None
    return parse_yaml(text, path, named_items)


def parse_value(text: str) -> Any:
    """A `--set KEY=VALUE` value, read by the files' rules; text that is not valid YAML stays as written."""
    try:
        return parse_yaml(text, "the command line")
    except YamlInputError:
        return text


def dotted_lines(data: Any, prefix: str = "") -> dict[str, int]:
    """{"train.lr": 7, ...}: the line of every key in a parsed mapping, nested keys dotted."""
    lines: dict[str, int] = {}
    if isinstance(data, YamlMap):
        for key, value in data.items():
            name = f"{prefix}{key}"
            if key in data.key_lines:
                lines[name] = data.key_lines[key]
            lines.update(dotted_lines(value, name + "."))
    return lines


@dataclasses.dataclass(frozen=True)
class _Place:
    filename: str
    line: int | str  # 0: unknown; a text: the command-line flag that set the value
    path: str  # dotted field path

    def error(self, problem: str) -> YamlInputError:
        return YamlInputError(f"{located(self.filename, self.line)}: `{self.path}` {problem}")

    def child(self, data: Any, key: Any) -> _Place:
        line = getattr(data, "key_lines", {}).get(key, 0)  # none: set by code or a command line
        return _Place(self.filename, line, f"{self.path}.{key}" if self.path else str(key))


def build(cls: type[T], data: Any, filename: str) -> T:
    """Dataclass `cls` from a parsed mapping, every key a field and every value of its type; fields
    with metadata {"internal": True} are not read."""
    if not isinstance(data, dict):
        raise YamlInputError(f"{filename}: expected a mapping of keys, got {kind_of(data)}")
    return _build(cls, data, _Place(filename, getattr(data, "line", 0), ""))


def _build(cls: type[T], data: Any, place: _Place) -> T:
    section = f"`{place.path}`" if place.path else "the top level"
    if not isinstance(data, dict):
        raise place.error(f"must be a mapping of keys, got {kind_of(data)}; write it as {{key: value, ...}}")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    values = {}
    for key, value in data.items():
        here = place.child(data, key)
        if key not in fields:
            match = closest_match(str(key), fields)
            hint = f" Did you mean `{place.child(data, match).path}`?" if match else ""
            raise YamlInputError(
                f"{located(here.filename, here.line)}: unknown key `{here.path}`.{hint} "
                f"Valid keys in {section}: {', '.join(fields)}"
            )
        values[key] = _coerce(hints[key], value, here)
    return cls(**values)


def _coerce(hint: Any, value: Any, place: _Place) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        return None if value is None else _coerce(next(a for a in args if a is not type(None)), value, place)
    if dataclasses.is_dataclass(hint):
        # a hint is a class, never an instance; `section:` alone gives the defaults
        return _build(typing.cast("type[DataclassInstance]", hint), {} if value is None else value, place)
    if origin is list:
        if isinstance(value, str):  # "cuda:1,cuda:2", as given on a command line
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)):
            raise place.error(f"must be a list, got {kind_of(value)}; write it as [a, b, ...]")
        return [
            _coerce(args[0], item, _Place(place.filename, place.line, f"{place.path}[{i}]"))
            for i, item in enumerate(value)
        ]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise place.error(f"must be a mapping, got {kind_of(value)}; write it as {{key: value, ...}}")
        return _plain(value)
    return _scalar(hint, value, place)


def _scalar(hint: Any, value: Any, place: _Place) -> Any:
    # bool is an int subclass in Python: `epochs: true` must not become 1 epoch.
    real_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is bool:
        if isinstance(value, bool):
            return value
        why = " (only true and false are booleans: YAML 1.2)" if isinstance(value, str) else ""
        raise place.error(f"must be true or false, got {kind_of(value)}{why}")
    if hint is int:
        if real_number and isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):  # from a command line
            return int(value)
        raise place.error(f"must be a whole number, got {kind_of(value)}")
    if hint is float:
        if real_number:
            return float(value)
        if isinstance(value, str):  # PyYAML reads `6e-4` (no dot) as text, as YAML 1.1 says
            with contextlib.suppress(ValueError):
                return float(value)
        raise place.error(f"must be a number (like 6e-4), got {kind_of(value)}")
    if hint is str:
        if real_number or isinstance(value, str):
            return str(value)
        raise place.error(f"must be a string, got {kind_of(value)}; quote it")
    raise TypeError(f"typed_yaml cannot build a {hint!r} (field {place.path})")


def _plain(value: Any) -> Any:
    """YamlMaps as plain dicts, so the built object copies and compares like one from code."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value
