"""TEMPORARY STUB of helper B1's constraint module (branch `grammar`), the names of the contract only; reverted when
`grammar` is merged."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec_cli.errors import UsageError


class GrammarError(UsageError):
    """A JSON schema or grammar llguidance cannot compile."""


@dataclass(frozen=True)
class Grammar:
    lark: str
    name: str


def _validate(lark: str) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(lark))
    return messages[0] if is_error and messages else ""


def from_lark(text: str, *, name: str) -> Grammar:
    error = _validate(text)
    if error:
        raise GrammarError(f"{name}: {error.strip().splitlines()[0]}", "Fix the grammar.")
    return Grammar(text, name)


def json_schema(schema: dict, *, name: str) -> Grammar:
    if not isinstance(schema, dict):
        raise GrammarError(f"{name}: a JSON schema is a JSON object, not {type(schema).__name__}.", "Give an object.")
    doc = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    lark = f"start: %json {json.dumps(doc)}\n"
    error = _validate(lark)
    if error:
        raise GrammarError(f"{name}: {error.strip().splitlines()[0]}", "Fix the schema.")
    return Grammar(lark, name)


def json_object(*, name: str = "--json") -> Grammar:
    return json_schema({"type": "object"}, name=name)
