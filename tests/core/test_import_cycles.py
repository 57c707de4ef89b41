"""The package's import graph: no cycles, and layers that point one way.

Every module of ``fedlap_privacy`` is parsed with :mod:`ast` (not imported), and EVERY import
counts, including those inside functions (deferred imports still make a cycle: they only
hide it from the interpreter until the function runs). Imports under ``if TYPE_CHECKING:``
are left out: they never run. The layers (docs/architecture.md): ``cli`` on top; ``fl`` and
``audit`` below it; the core (``fedlap_privacy/*.py``) below those; ``accountant`` below the
core, importing of the package only the torch-free vocabulary and errors.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fedlap_privacy"
#: the only core modules ``accountant`` may import: torch-free, importing nothing of the package
BASE = ("fedlap_privacy.errors", "fedlap_privacy.vocabulary")
#: the entry point ``python -m fedlap_privacy`` starts the CLI: the one import upwards
ENTRY_POINTS = ("fedlap_privacy.__main__",)


def _module_files() -> dict[str, Path]:
    """Module name -> source file, through the package-dir mapping of pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    out: dict[str, Path] = {}
    for package in config["packages"]:
        top = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / dirs[top] / Path(*package[len(top):].split(".")[1:])
        for file in sorted(folder.glob("*.py")):
            name = package if file.stem == "__init__" else f"{package}.{file.stem}"
            out[name] = file
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module ``tree`` imports (``from a import b``: ``a.b`` if that is a module,
    else ``a``), skipping ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (deferred imports included)."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for name, file in files.items():
        tree = ast.parse(file.read_text(), str(file))
        found = _imports(tree, name, file.stem == "__init__")
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle through the first module of a strongly connected component (BFS back)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {component}")


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("accountant", "fl", "audit", "cli"):
        return parts[1]
    return "base" if module in BASE else "core"


#: the layers each layer may import (its own included)
ALLOWED = {
    "base": {"base"},
    "accountant": {"accountant", "base"},
    "core": {"core", "base", "accountant"},
    "fl": {"fl", "core", "base", "accountant"},
    "audit": {"audit", "core", "base", "accountant"},
    "cli": {"cli", "fl", "audit", "core", "base", "accountant"},
}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in graph.items() if module not in ENTRY_POINTS
        for target in targets if _layer(target) not in ALLOWED[_layer(module)]
    )


def test_the_graph_sees_every_module_and_deferred_imports() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "fedlap_privacy.fl.flower.policy" in graph
    # a deferred import (inside a function) is an edge: the CLI loads training lazily
    assert "fedlap_privacy.fl.engine.simulation" in graph["fedlap_privacy.cli.train"]


def test_the_checker_names_a_cycle_hidden_in_a_function() -> None:
    source = {"p.a": "import p.b\n", "p.b": "def f():\n    from p import a\n"}
    graph = {name: {m for m in _imports(ast.parse(text), name, False) if m in source}
             for name, text in source.items()}
    assert find_cycles(graph) == [["p.a", "p.b", "p.a"]]
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\n"
    assert not set(_imports(ast.parse(typed), "p.b", False)) & {"p.a"}


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers_point_one_way() -> None:
    violations = layer_violations(import_graph())
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("module", BASE)
def test_the_base_imports_nothing_of_the_package(module: str) -> None:
    assert import_graph()[module] == set()
