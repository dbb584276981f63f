"""The built-in prompt set: every class in CLASSES is packaged and found."""

from __future__ import annotations

import re

import pytest

from specdec_cli.errors import UsageError
from specdec_cli.prompts import CLASSES, builtin


def test_every_class_has_a_prompt():
    kinds = {c.kind for c in builtin()}
    assert kinds == set(CLASSES)


def test_rewrite_class_is_a_whole_file():
    """The rewrite prompt quotes a whole module (150-250 lines) and asks for all of it back."""
    (case,) = builtin(("rewrite",))
    assert case.name == "sched_rename_method"
    code = re.search(r"```python\n(.*)```", case.text, re.S).group(1)
    assert 150 <= code.count("\n") <= 250
    assert "def enterabs(" in code and "self.enterabs(" in code
    assert "complete file" in case.text


def test_unknown_class():
    with pytest.raises(UsageError, match="Use one of: edit, explain, summarize, write, rewrite"):
        builtin(("poems",))
