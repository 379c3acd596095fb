"""Strict YAML for the files users write (inventory, playbooks): a key written twice in one
mapping is refused (PyYAML would keep the last silently), only true/false are booleans (YAML 1.2),
and mappings remember their lines so a mistake can be reported as FILE:LINE."""

from __future__ import annotations

import re

import yaml

from .errors import InputError


class YamlMap(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    def __init__(self, line: int = 0):
        super().__init__()
        self.line = line
        self.key_lines: dict = {}


class _DuplicateKey(Exception):
    def __init__(self, where: str, key, first_line: int, line: int):
        super().__init__(key)
        self.where, self.key, self.first_line, self.line = where, key, first_line, line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that reads only true/false as booleans, as YAML 1.2 does: `host_key_policy: off`
    must stay the text 'off', and `no`/`on` never turn into booleans."""


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


def _refuse_duplicate_keys(node, path: tuple, seen_nodes: set) -> None:
    """PyYAML silently keeps the last of two equal keys; we refuse them. Only keys written in the
    same mapping count: keys pulled in by a `<<: *anchor` merge may be overridden."""
    if id(node) in seen_nodes:  # an alias of a node already checked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, seen_nodes)
    elif isinstance(node, yaml.MappingNode):
        first_lines: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key_node.tag != _MERGE_TAG:
                line = key_node.start_mark.line + 1
                if key in first_lines:
                    raise _DuplicateKey(_describe_key(path, key), key, first_lines[key], line)
                first_lines[key] = line
            _refuse_duplicate_keys(value_node, path + (key,), seen_nodes)


def _describe_key(path: tuple, key: str) -> str:
    if path in (("targets",), ("groups",)):
        return f"{path[0][:-1]} {key!r}"
    return f"key {key!r}" + (f" under {'.'.join(map(str, path))}" if path else "")


def parse_yaml(text: str, filename: str):
    """Parse YAML text strictly; any problem is one InputError naming `filename` and the line."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, (), set())
        return loader.construct_document(node)
    except _DuplicateKey as e:
        raise InputError(
            f"{filename}:{e.line}: {e.where} is defined twice (also on line {e.first_line}); "
            f"YAML would silently keep only the last one: rename or remove one of them"
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{filename}:{mark.line + 1}" if mark else filename
        column = f" (column {mark.column + 1})" if mark else ""
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise InputError(f"{where}: not valid YAML: {problem}{column}; fix the syntax there") from None
    except yaml.YAMLError as e:
        raise InputError(f"{filename}: not valid YAML: {_one_line(str(e))}; fix the syntax") from None
    finally:
        loader.dispose()


def read_yaml(path: str):
    """Read and parse a YAML file; unreadable files are InputErrors too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: file not found; check the path") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a YAML file; give the file's path") from None
    except PermissionError:
        raise InputError(f"{path}: permission denied; make the file readable") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    return parse_yaml(text, path)


def _one_line(text: str) -> str:
    return " ".join(text.split())
