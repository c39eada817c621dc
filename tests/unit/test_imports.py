"""The package's import graph has no circle.

A circle means no module of it can be read, tested or moved without the others, and it is what a late
import inside a function usually hides. So the graph counts every import the code makes when it runs:
module-level and function-level alike, relative ones resolved, ``from package import name`` as an import
of the submodule when ``name`` is one. Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import canaryd

PACKAGE = Path(canaryd.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: every one in the tree but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports."""
    modules = _modules(root)

    def within(name: str) -> str | None:  # the module ``name`` names, or its nearest enclosing one
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges.update(t for target in targets if (t := within(target)) and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def _describe(graph: dict[str, set[str]], circle: list[str]) -> str:
    inside = set(circle)
    arrows = [f"{a} -> {b}" for a in circle for b in sorted(graph[a] & inside)]
    return f"{', '.join(circle)} ({'; '.join(arrows)})"


def test_the_package_has_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Each rule of the graph, on a package made to show it: a circle through a function-level import and
    a relative one is found, and one through a ``TYPE_CHECKING`` import is not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")  # the submodule, in a function
    (pkg / "sub" / "b.py").write_text("from .. import a\n")  # relative, two levels
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]
