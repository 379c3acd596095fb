"""The packages' rooms stand on floors: no import circle between modules, and no two folders that import
each other (lazy imports inside functions count too). `__main__` is the entry point, above every floor."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def import_graph(package: str) -> tuple[dict[str, Path], dict[str, set[str]]]:
    """(module name -> file, module -> the package's modules it imports), from the source's AST."""
    files = {}
    for path in (REPO / package).rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in files.items():
        if name.endswith("__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return files, edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["trainer", "dflash_ops"])
def test_no_module_imports_itself_in_a_circle(package):
    _, edges = import_graph(package)
    assert circles(edges) == []


@pytest.mark.parametrize("package", ["trainer", "dflash_ops"])
def test_folders_stand_on_floors(package):
    files, edges = import_graph(package)
    room = {name: str(path.parent.relative_to(REPO)) for name, path in files.items()}
    folders: dict[str, set[str]] = collections.defaultdict(set)
    for name, targets in edges.items():
        for target in targets:
            if room[name] != room[target]:
                folders[room[name]].add(room[target])
    assert circles(folders) == [], "a folder imports one that imports it back (directly or around)"


def test_the_checker_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
