"""The package layout: kdsl's subpackages import each other one way only (no cycle among them), read from every
import of every module, those inside functions too: an import deferred to call time still reaches the package it
names (kdsl.nn's loader once built kdsl.parallel's modules from inside a function while kdsl.parallel imports
kdsl.nn; the loader now stands above both, as kdsl.checkpoint)."""
from __future__ import annotations

import ast
from pathlib import Path

import kdsl

PACKAGE = Path(kdsl.__file__).parent


def _unit(module: str) -> str:
    """kdsl.<subpackage or top-level module>."""
    return ".".join(module.split(".")[:2])


def subpackage_imports() -> dict[str, set[str]]:
    """{kdsl.X: the other kdsl.Y its modules import, at module level or inside a function}."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        source = _unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                if target.startswith("kdsl.") and _unit(target) != source:
                    edges.setdefault(source, set()).add(_unit(target))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_kdsl_subpackages_import_each_other_one_way_only():
    edges = subpackage_imports()
    assert {"kdsl.kernels", "kdsl.schema", "kdsl.ops", "kdsl.aot"} <= set(edges)  # the walk saw the packages
    found = cycles(edges)
    assert not found, "import cycles among kdsl's subpackages: " + "; ".join(
        " -> ".join(component) for component in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
