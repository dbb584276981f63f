"""The package's layers (issues 26 and 33, docs/architecture.md): the library at the root, the command line in
specdec_cli/cli/, and imports that point down the layer order docs/architecture.md states. Read from the source with
`ast`, so an import inside a function or under `if TYPE_CHECKING:` counts as much as one at the top of a module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import specdec_cli

PACKAGE = Path(specdec_cli.__file__).resolve().parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"  # its layers block (moved from the README, issue 43)
LAYERS_MARKER = "<!-- layers: tests/test_layout.py reads the block below -->"
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
    assert offenders == [], "the library must not draw on a terminal; move this into specdec_cli/cli/:\n" + "\n".join(
        offenders
    )


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


def doc_layers(text: str) -> list[list[str]]:
    """The layer order docs/architecture.md states, top to bottom: the fenced block after `LAYERS_MARKER`, one layer a
    line, its units separated by spaces ("cli/" a subpackage, "assemble" a module at the root, "__init__" the package's
    own __init__); what follows " #" on a line is a comment."""
    lines = text.split(LAYERS_MARKER, 1)[1].split("```", 2)[1].splitlines()[1:]
    return [[unit.rstrip("/") for unit in line.split(" #")[0].split()] for line in lines if line.split(" #")[0].strip()]


def unit_of(module: str) -> str:
    """The unit a module belongs to: its subpackage or root module ("core", "session"), or "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(mods: dict[str, tuple[Path, ast.AST]], layers: list[list[str]]) -> list[str]:
    """Every import from a unit to a unit of the same or a higher layer (other than itself), and every unit the
    layers do not place: as "file:line imports module (layer i -> layer j)" lines."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    out = []
    for name, (path, tree) in mods.items():
        unit = unit_of(name)
        if unit not in rank:
            out.append(f"{path.relative_to(PACKAGE.parent)}: its unit {unit!r} is in no layer of docs/architecture.md")
            continue
        hits = set()
        for imported, line in imports(tree, name, path.name == "__init__.py"):
            if imported.split(".")[0] != PACKAGE.name:
                continue
            target = imported
            while target not in mods and "." in target:  # `from pkg.mod import name`: the module holding the name
                target = target.rsplit(".", 1)[0]
            other = unit_of(target)
            if other != unit and rank.get(other, -1) <= rank[unit]:
                hits.add((line, target))
        for line, target in sorted(hits):  # `from pkg import mod` names pkg and pkg.mod: report the module
            if not any(n == line and t.startswith(target + ".") for n, t in hits):
                other = unit_of(target)
                out.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports {target} "
                    f"({unit}: layer {rank[unit]} -> {other}: layer {rank.get(other)})"
                )
    return out


def test_imports_point_down_the_doc_layers():
    """A module imports only from layers below its own (docs/architecture.md): what two layers share lives
    in the lower one."""
    layers = doc_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    assert [u for layer in layers for u in layer].count("core") == 1
    offenders = upward_imports(modules(), layers)
    assert offenders == [], (
        "imports that climb the layers of docs/architecture.md; move what both need into the lower one:\n"
        + "\n".join(offenders)
    )


def test_the_layer_check_finds_an_upward_import():
    tree = ast.parse("def f():\n    from specdec_cli.session import Session\n")
    mods = {
        "specdec_cli.core.engine": (PACKAGE / "core" / "engine.py", tree),
        "specdec_cli.session": (PACKAGE / "session.py", ast.parse("")),
    }
    assert upward_imports(mods, [["session"], ["core"]]) == [
        "specdec_cli/core/engine.py:2 imports specdec_cli.session (core: layer 1 -> session: layer 0)"
    ]
    assert upward_imports(mods, [["core"], ["session"]]) == []


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
