"""No function is longer than a screen: 60 lines in the packages, 80 in the benchmarks (decorators and
docstrings included), read from the source's AST."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def long_functions(folder: str, limit: int) -> list[str]:
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > limit:
                    found.append(
                        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - start + 1})"
                    )
    return found


@pytest.mark.parametrize("folder, limit", [("dflash_ops", 60), ("trainer", 60), ("benchmarks", 80)])
def test_no_function_is_longer_than_its_limit(folder, limit):
    assert long_functions(folder, limit) == []


def test_a_long_function_is_found(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert long_functions("pkg", 60) == ["pkg/m.py:1 long (62)"]
