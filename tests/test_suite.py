"""The test suite's own rules (issue 56): no test module imports another (shared fakes live in `fakes.py`, the server
harness in `helpers.py`, fixtures in `conftest.py`), read from the source with `ast`, so an import inside a function
counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_tests(source: str) -> list[tuple[str, int]]:
    """(module, line) of every import of a test module (`test_*`) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        found += [(n, node.lineno) for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    bad = [
        f"{path.relative_to(TESTS)}:{line} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name, line in imports_of_tests(path.read_text(encoding="utf-8"))
    ]
    assert not bad, "move what is shared into tests/fakes.py or tests/helpers.py:\n" + "\n".join(bad)


def test_the_check_finds_an_import_of_a_test_module():
    source = "import os\nfrom fakes import FakeBackend\n\ndef f():\n    from test_serve import serving\n"
    assert imports_of_tests(source) == [("test_serve", 5)]
    assert imports_of_tests("import tests.server.test_app as t\n") == [("tests.server.test_app", 1)]
