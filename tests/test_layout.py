"""The package's layers (issue 26, README "How it works inside"): the library at the root, the command line in
specdec_cli/cli/. Read from the source with `ast`, so an import inside a function or under `if TYPE_CHECKING:`
counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import specdec_cli

PACKAGE = Path(specdec_cli.__file__).resolve().parent
FRONT_END = "cli"  # the only subpackage that may draw on a terminal or parse a command line
TERMINAL_LIBRARIES = {"typer", "rich", "click"}


def imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `tree`, wherever it is; relative imports made absolute."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            out += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return out


def modules() -> dict[str, tuple[Path, ast.AST]]:
    """Every module of the package by dotted name: (file, parsed source)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return out


def test_nothing_outside_the_cli_imports_typer_or_rich():
    offenders = []
    for name, (path, tree) in modules().items():
        if name.split(".")[1:2] == [FRONT_END]:
            continue
        for imported, line in imports(tree, name, path.name == "__init__.py"):
            if imported.split(".")[0] in TERMINAL_LIBRARIES:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert offenders == [], "the library must not draw on a terminal; move this into specdec_cli/cli/:\n" + \
        "\n".join(offenders)


def test_nothing_outside_the_cli_imports_the_cli():
    """The library and the server never reach into the command line (which draws on Rich): only `__main__` (the
    entry point) imports `specdec_cli.cli`."""
    offenders = []
    for name, (path, tree) in modules().items():
        if name.split(".")[1:2] == [FRONT_END] or name == "specdec_cli.__main__":
            continue
        for imported, line in imports(tree, name, path.name == "__init__.py"):
            if imported.split(".")[:2] == ["specdec_cli", FRONT_END]:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert offenders == [], "only specdec_cli/__main__.py may import the command line:\n" + "\n".join(offenders)


def test_no_import_cycles():
    mods = modules()
    graph = {}
    for name, (path, tree) in mods.items():
        targets = {m for m, _ in imports(tree, name, path.name == "__init__.py") if m in mods}
        # a package's __init__ is imported on the way to its modules: that arrow is not a design dependency
        graph[name] = {m for m in targets if m != name and not name.startswith(m + ".") and m != PACKAGE.name}
    assert strongly_connected(graph) == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph` (Tarjan's strongly connected components with more than one node), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
