"""Constrained generation (structured outputs): grammars and JSON schemas over llguidance.

A `Grammar` is text in llguidance's Lark dialect (docs/syntax.md of guidance-ai/llguidance; `%json {...}` embeds a
JSON schema), made by `json_object`, `json_schema`, `from_lark` or `from_gbnf`, each validated at once so a bad
schema or grammar fails before any model loads (`GrammarError`, one line naming where it is wrong).

A `Constraint` is one generation's grammar state: an llguidance `LLMatcher` over the target's vocabulary (the
`LLTokenizer` the backend builds once, `Backend.lltokenizer`). The engine asks it, per step:
- `forced()`: the tokens the grammar forces next (`compute_ff_tokens`: a schema's next key, closing brackets), a free
  draft; verified like every draft, because forced bytes can tokenize differently from what the model emits;
- `cut(draft)`: the longest prefix of a draft the grammar allows (`validate_tokens`), before it is verified;
- `masks(draft)`: the allowed-token bitmask for every verified row (row i after draft[:i]), int32 [k + 1, ceil(V/32)]
  (llguidance's layout: token t allowed iff bit t % 32 of word t // 32 is set); the matcher is then past the draft;
- `commit(n_accepted, token)`: roll back the drafts verification rejected (`rollback`), then take the target's token;
  a matcher found out of step with the engine (a bug) is rebuilt from the committed tokens and the event logged;
- `done`: the grammar is complete and allows nothing more (or only the end-of-generation token).

This is how llama.cpp (common/llguidance.cpp) and vLLM (structured outputs with speculative decoding: masks for the
draft positions, rollback of what was rejected) use llguidance.

Layout of JSON (`JsonLayout`): with whitespace left free (llguidance's default) a key after a newline is not forced,
because the indentation before it is the model's choice; with one-line JSON (`", "` and `": "` between items, no other
whitespace) every key and separator after a value is forced, and the model writes JSON on one line, as Python's
`json.dumps` does. specdec's default is "inline": docs/design.md, "Structured outputs", says why and what it costs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from specdec_cli.errors import SpecdecError, UsageError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

log = logging.getLogger(__name__)

JsonLayout = Literal["inline", "free"]
LAYOUTS: tuple[str, ...] = ("inline", "free")
DEFAULT_LAYOUT: JsonLayout = "inline"

# llguidance's JSON options per layout (the schema's top-level "x-guidance" key; docs/json_schema.md)
_LAYOUT_OPTIONS: dict[str, dict[str, Any]] = {
    "inline": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "free": {"whitespace_flexible": True},
}


class GrammarError(UsageError):
    """A JSON schema or grammar llguidance cannot compile; the message names the source and where it is wrong."""


class ConstraintStateError(SpecdecError):
    """The grammar's state and the engine's output disagree and could not be rebuilt: a bug in specdec, never the
    user's grammar (an internal error: exit code 1, HTTP 500)."""


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's Lark dialect, validated.

    Attributes:
        lark: the grammar text (`%json {...}` embeds a JSON schema).
        name: where it came from, for messages ("--json-schema s.json", "response_format", "tools").
    """

    lark: str
    name: str


def json_object(*, name: str = "--json-object", layout: JsonLayout = DEFAULT_LAYOUT) -> Grammar:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`), in `layout`."""
    return json_schema({"type": "object"}, name=name, layout=layout)


def json_schema(schema: dict, *, name: str, layout: JsonLayout = DEFAULT_LAYOUT) -> Grammar:
    """A grammar for JSON that validates against `schema` (a JSON Schema as a dict; llguidance's supported subset,
    docs/json_schema.md), in `layout` unless the schema sets its own "x-guidance" options.

    Raises:
        GrammarError: `schema` is not an object, or llguidance cannot compile it; the message names the keyword or
            the JSON path (e.g. `properties.age.type`) where it is wrong.
    """
    if not isinstance(schema, dict):
        raise GrammarError(
            f"{name}: a JSON schema is a JSON object, not {type(schema).__name__}.",
            'Give an object such as {"type": "object", "properties": {...}}.',
        )
    if layout not in _LAYOUT_OPTIONS:
        raise GrammarError(f"{name}: unknown JSON layout {layout!r}.", f"Use one of: {', '.join(LAYOUTS)}.")
    doc = dict(schema)
    doc.setdefault("x-guidance", _LAYOUT_OPTIONS[layout])
    try:
        text = json.dumps(doc, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{name}: the schema cannot be written as JSON ({e}).", "Give a JSON object.") from None
    lark = f"start: %json {text}\n"
    error = _validate(lark)
    if error:
        where = _schema_path(schema, error)
        raise GrammarError(
            f"{name}: {where + ': ' if where else ''}{_schema_message(error)}",
            "Fix the schema (llguidance's supported JSON Schema: docs/json_schema.md).",
        )
    return Grammar(lark=lark, name=name)


def from_lark(text: str, *, name: str) -> Grammar:
    """A grammar in llguidance's Lark dialect (`start:` is the top rule). Raises GrammarError naming the line and
    column where it is wrong."""
    error = _validate(text)
    if error:
        raise GrammarError(
            f"{name}: {_lark_message(error)}",
            "Fix the grammar (llguidance's Lark syntax: docs/syntax.md of guidance-ai/llguidance).",
        )
    return Grammar(lark=text, name=name)


def from_gbnf(text: str, *, name: str) -> Grammar:
    """A GBNF grammar (llama.cpp's grammars/README.md; `root ::= ...`), converted to Lark by llguidance's converter.
    Lark text is accepted too. Raises GrammarError naming where the grammar is wrong."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # GbnfToLarkError (with a position) and the converter's plain Exceptions
        raise GrammarError(f"{name}: {' '.join(str(e).split())}", "Fix the GBNF grammar.") from None
    return from_lark(lark, name=name)


def load(path: str, kind: Literal["json-schema", "grammar"], *, layout: JsonLayout = DEFAULT_LAYOUT) -> Grammar:
    """The grammar of a `--json-schema FILE` or `--grammar FILE` (Lark, or GBNF when it uses `::=`).

    Raises:
        UsageError: the file cannot be read. GrammarError: it is not valid JSON / a valid schema / a valid grammar.
    """
    from pathlib import Path

    option = f"--{kind}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(
            f"{option} {path}: cannot read it ({getattr(e, 'strerror', None) or e}).", "Give a readable UTF-8 file."
        ) from None
    name = f"{option} {path}"
    if kind == "json-schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"{name}: not JSON: {e.msg} (line {e.lineno}, column {e.colno}).", "Give a JSON Schema file."
            ) from None
        return json_schema(schema, name=name, layout=layout)
    if "::=" in text:
        return from_gbnf(text, name=name)
    return from_lark(text, name=name)


def _validate(lark: str) -> str:
    """llguidance's error for a Lark grammar ('' when it compiles), without a tokenizer."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(lark))
    return messages[0] if is_error and messages else ""


def _lark_message(error: str) -> str:
    """llguidance's 'at LINE(COL): what\\n  context' as one line: 'line L, column C: what'."""
    first = error.strip().splitlines()[0] if error.strip() else "invalid grammar"
    head, _, what = first.partition(": ")
    pos = head.removeprefix("at ").strip()
    if "(" in pos and pos.endswith(")") and what:
        line, col = pos[:-1].split("(", 1)
        return f"line {line}, column {col}: {what}"
    return first


def _schema_message(error: str) -> str:
    first = _lark_message(error)
    return first.split("failed to compile JSON schema: ", 1)[-1]


def _schema_path(schema: Any, error: str) -> str:
    """The JSON path (`properties.age.type`) of the first keyword or value the error message quotes, '' if none."""
    message = _schema_message(error)
    best = ""
    for path, key, value in _leaves(schema, ()):
        quoted_key = f"'{key}'" in message or f'"{key}"' in message
        named_value = (
            isinstance(value, (str, int, float))
            and not isinstance(value, bool)
            and (
                f": {value}" in message
                or f"'{value}'" in message
                or f'"{value}"' in message
                or (isinstance(value, str) and value.startswith("#/") and f"'{value[1:]}'" in message)
            )
        )  # a $ref
        if quoted_key or named_value:
            candidate = ".".join(path)
            if len(candidate) > len(best):
                best = candidate  # the deepest match: the keyword itself, not an ancestor
    return best


def _leaves(node: Any, path: tuple[str, ...]):
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, str(key)), str(key), value
            yield from _leaves(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, str(i)))


class Constraint:
    """One generation's grammar state over a target vocabulary: an llguidance `LLMatcher`.

    Args:
        grammar: the `Grammar` to follow.
        tokenizer: the target's llguidance tokenizer (`Backend.lltokenizer()`, built once per model).
        n_vocab: the width of the target's logits rows (>= the tokenizer's vocabulary).

    Raises:
        GrammarError: the grammar does not compile with this vocabulary (e.g. a special token it does not have).
    """

    def __init__(self, grammar: Grammar, tokenizer: LLTokenizer, n_vocab: int) -> None:
        self.grammar = grammar
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self._tokenizer = tokenizer
        self.matcher: LLMatcher = self._new_matcher()
        self._check(f"{grammar.name}: ")
        self._rows = np.zeros((8, self.words), dtype=np.int32)  # grows to the longest verify batch
        self._consumed = 0  # draft tokens the last `masks` consumed
        self._pending: list[int] = []  # those tokens
        self._committed: list[int] = []  # the output so far (to rebuild the matcher from, should it fall out of step)

    def _new_matcher(self) -> LLMatcher:
        from llguidance import LLMatcher

        return LLMatcher(self._tokenizer, LLMatcher.grammar_from_lark(self.grammar.lark), log_level=0)

    def _check(self, prefix: str = "") -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{prefix}{_lark_message(self.matcher.get_error())}", "Fix the grammar or schema.")

    def forced(self) -> np.ndarray:
        """int32 [m]: the tokens the grammar forces next (llguidance's canonical fast-forward tokens; m may be 0)."""
        return np.asarray(self.matcher.compute_ff_tokens(), dtype=np.int32)

    def cut(self, tokens: np.ndarray) -> int:
        """How many of `tokens` (int [k]) the grammar allows in a row from the current state (0..k)."""
        return int(self.matcher.validate_tokens(tokens.tolist())) if len(tokens) else 0

    def masks(self, draft: np.ndarray) -> np.ndarray:
        """The allowed tokens of each verified row: int32 [k + 1, words] bitmask, row i after draft[:i] (draft:
        int [k], all allowed: `cut` it first). Afterwards the matcher is past the draft (`commit` rolls back what
        verification rejects). The array is reused by the next call.

        A draft may complete the grammar and go on with the end-of-generation token (the past-outputs store drafts
        whole earlier replies, their end included). llguidance takes that token on a stopped matcher without
        recording it in its rollback history (vLLM's fix: vllm-project/vllm PR 25905), so nothing is consumed once
        the matcher is stopped (its rows then allow only the end token) and `commit` rolls back only what was.

        Raises ConstraintStateError: a draft token the grammar refuses (`cut` allowed it: a bug)."""
        k = len(draft)
        if self._rows.shape[0] < k + 1:
            self._rows = np.zeros((2 * (k + 1), self.words), dtype=np.int32)
        rows = self._rows[: k + 1]
        nbytes = self.words * 4
        self._consumed = 0
        for i in range(k + 1):
            self.matcher.unsafe_compute_mask_ptr(rows[i].ctypes.data, nbytes)
            if i < k and not self.matcher.is_stopped():
                if not self.matcher.consume_token(int(draft[i])):
                    raise ConstraintStateError(
                        f"{self.grammar.name}: a draft token the grammar refuses reached "
                        f"verification ({self.matcher.get_error()}); a bug in specdec."
                    )
                self._consumed += 1
        self._pending = [int(t) for t in draft[: self._consumed]]
        return rows

    def commit(self, n_accepted: int, token: int) -> None:
        """Verification accepted the first `n_accepted` draft tokens of the last `masks` call: roll back the rest of
        what `masks` consumed, then consume the target's `token` (allowed by its row's mask).

        A matcher that refuses the token is out of step with the engine (a bug, never the user's grammar): it is
        rebuilt from the committed tokens and the event logged. Raises ConstraintStateError when even that fails."""
        self._committed.extend(self._pending[:n_accepted])
        extra = self._consumed - n_accepted
        if extra > 0:
            self.matcher.rollback(extra)
        self._consumed = 0
        self._pending = []
        if self.matcher.consume_token(int(token)) and not self.matcher.is_error():
            self._committed.append(int(token))
            return
        log.warning(
            "%s: the grammar's state was out of step with the output (a bug in specdec); rebuilt from the "
            "%d committed tokens. %s",
            self.grammar.name,
            len(self._committed),
            self.matcher.get_error(),
        )
        self.matcher = self._new_matcher()  # (`reset` keeps an error state)
        if (
            not self.matcher.consume_tokens(self._committed)
            or not self.matcher.consume_token(int(token))
            or self.matcher.is_error()
        ):
            raise ConstraintStateError(
                f"{self.grammar.name}: the grammar's state cannot follow the output "
                f"({self.matcher.get_error()}); a bug in specdec."
            )
        self._committed.append(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more than the end-of-generation token."""
        return self.matcher.is_stopped()


def start(grammar: Grammar | None, tokenizer_of, n_vocab: int) -> Constraint | None:
    """The `Constraint` of a generation, None without a grammar. `tokenizer_of()` returns the target's llguidance
    tokenizer (called only when there is a grammar: building one walks the whole vocabulary)."""
    if grammar is None:
        return None
    return Constraint(grammar, tokenizer_of(), n_vocab)


__all__ = [
    "Constraint",
    "ConstraintStateError",
    "Grammar",
    "GrammarError",
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "JsonLayout",
    "from_gbnf",
    "from_lark",
    "json_object",
    "json_schema",
    "load",
    "start",
]
