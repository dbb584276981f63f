"""A Lark grammar (llguidance's dialect) or a regex as one anchored regex (`input_pattern`): how a custom tool's
text input is held to its grammar (`server.custom_tools`), since llguidance holds a JSON string to a regex (a
schema's `pattern`), not to a context-free grammar (its Lark dialect has no JSON-quoted sub-grammar: docs/syntax.md
of guidance-ai/llguidance). Grammar machinery, like `constraint.py`: nothing here knows about HTTP or tools.

A Lark grammar without recursion describes a regular language, so it becomes one regex exactly (Codex's
`apply_patch` grammar is one of these); a recursive rule is unrolled `MAX_DEPTH` levels deep, so what the model
writes is still in the grammar's language, only nested less deeply than the grammar allows. What a regex cannot say
(llguidance's `%json`, special tokens `<...>`, `&`/`~` in terminals, `%declare`, `@sub-grammars`) raises
`Unsupported`, whose message says which and where.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

MAX_DEPTH = 3  # how many times a recursive rule may nest in the input
MAX_PATTERN = 200_000  # characters of the regex a grammar becomes; a larger one is Unsupported

# llguidance's `%import common.NAME` terminals (parser/src/lark/common.rs of guidance-ai/llguidance, after Lark's
# common.lark), as regexes
COMMON = {
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"(\+|-)?[0-9]+",
    "DECIMAL": r"([0-9]+\.[0-9]*)|(\.[0-9]+)",
    "_EXP": r"[eE](\+|-)?[0-9]+",
    "FLOAT": r"([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "SIGNED_FLOAT": r"(\+|-)?(([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+)",
    "NUMBER": r"([0-9]+)|([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "SIGNED_NUMBER": r"(\+|-)?(([0-9]+)|([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+)",
    "ESCAPED_STRING": r"\"([^\"\\]|\\.)*\"",
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "CR": r"\r",
    "LF": r"\n",
    "NEWLINE": r"(\r?\n)+",
    "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
    "C_COMMENT": r"\/\*[^*]*\*+(?:[^/*][^*]*\*+)*\/",
    "SQL_COMMENT": r"--[^\n]*",
}


class Unsupported(Exception):
    """A grammar construct a regex cannot express (or a malformed grammar); the message says which and where."""


class _TooLarge(Exception):
    """The regex grew past MAX_PATTERN characters (try fewer levels of recursion)."""


def input_pattern(syntax: Literal["lark", "regex"], definition: str, *, depth: int = MAX_DEPTH) -> str:
    """The language of a custom tool's grammar as one anchored regex (Rust regex syntax, what llguidance's JSON
    `pattern` takes): a regex as it is; a Lark grammar with its rules and terminals inlined from `start`, recursion
    unrolled `depth` levels (fewer if the regex would exceed MAX_PATTERN characters).

    Raises Unsupported: what a regex cannot express, a malformed grammar, a grammar too large even unrolled once.
    """
    if syntax == "regex":
        return f"^(?:{definition})$"
    lark = LarkGrammar.parse(definition)
    for d in range(depth, 0, -1):
        body = lark.regex(d)
        if body is not None and len(body) <= MAX_PATTERN:
            return f"^(?:{body})$"
    raise Unsupported(
        "the grammar is too large to hold its input to (its recursive rules unrolled once exceed "
        f"{MAX_PATTERN} characters of regex), or its recursion never ends"
    )


_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r]+|\\\n)
  | (?P<comment>(//|\#)[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsxlu]*)
  | (?P<directive>%[a-z_]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<name>[?!]?[_a-zA-Z](?:[_a-zA-Z0-9]|-(?!>))*)
  | (?P<number>[0-9]+)
  | (?P<special><[^<>\s]+>)
  | (?P<ref>@[\w-]+)
  | (?P<punct>[:|()\[\]{}+*?~,.=&])
""",
    re.X,
)


@dataclass
class LarkGrammar:
    """A Lark grammar (llguidance's dialect) parsed far enough to turn it into a regex.

    Attributes:
        rules: name -> alternatives, each a sequence of items (rules and terminals alike; names starting with an
            upper-case letter or "_" + upper-case are terminals, the rest rules).
        ignore: the `%ignore`d items (allowed between the terminals of rules, and before and after the input).
    """

    rules: dict[str, list] = field(default_factory=dict)
    ignore: list = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> LarkGrammar:
        """Raises Unsupported for what is not expressible as a regex, and for malformed text."""
        grammar = cls()
        for statement in _statements(_tokens(text)):
            grammar._statement(statement)
        if "start" not in grammar.rules:
            raise Unsupported("the grammar has no start rule ('start: ...')")
        return grammar

    # -- parsing
    def _statement(self, toks: list[tuple[str, str]]) -> None:
        kind, value = toks[0]
        if kind == "directive":
            self._directive(value, toks[1:])
            return
        if kind != "name":
            raise Unsupported(f"a statement starts with {value!r}")
        name = value.lstrip("?!")
        i = 1
        if i < len(toks) and toks[i] == ("punct", "."):  # a terminal's priority: NAME.2
            i += 2
        if i < len(toks) and toks[i] == ("punct", "["):  # rule options: name[lazy]
            while i < len(toks) and toks[i] != ("punct", "]"):
                i += 1
            i += 1
        if i < len(toks) and toks[i] == ("punct", "{"):
            raise Unsupported(f"rule {name!r} has parameters (templates)")
        if i >= len(toks) or toks[i] != ("punct", ":"):
            raise Unsupported(f"rule {name!r}: expected ':'")
        if name in self.rules:
            raise Unsupported(f"{name!r} is defined twice")
        alternatives, end = _Items(toks, i + 1).expansions()
        if end != len(toks):
            raise Unsupported(f"rule {name!r}: unexpected {toks[end][1]!r}")
        self.rules[name] = alternatives

    def _directive(self, directive: str, toks: list[tuple[str, str]]) -> None:
        if directive == "%llguidance":
            return  # options for llguidance's own parser (its lexer), no part of the language
        if directive == "%ignore":
            alternatives, end = _Items(toks, 0).expansions()
            self.ignore.append(("group", alternatives))
            return
        if directive == "%import":
            names = [v for k, v in toks if k == "name"]
            if not names or not names[0].startswith("common"):
                raise Unsupported("only '%import common.NAME' is supported")
            path = "".join(v for _, v in toks)
            m = re.fullmatch(r"common\.(\w+)(?:->(\w+))?", path)
            imported = [(m.group(1), m.group(2) or m.group(1))] if m else None
            if imported is None:
                m = re.fullmatch(r"common\(([\w,]+)\)", path)
                imported = [(n, n) for n in m.group(1).split(",")] if m else None
            if imported is None:
                raise Unsupported(f"cannot read '%import {path}'")
            for source, target in imported:
                if source not in COMMON:
                    raise Unsupported(f"'%import common.{source}': no such common terminal")
                self.rules[target] = [[("regex", COMMON[source], "")]]
            return
        raise Unsupported(f"{directive} cannot be expressed as a regex")

    # -- the regex
    def regex(self, depth: int) -> str | None:
        """The language of `start` as a regex, recursion unrolled `depth` levels; None when nothing is left (every
        derivation recurses deeper) or the regex grows past MAX_PATTERN."""
        ignore = None
        if self.ignore:
            parts = [_Expander(self, depth, None).alternatives(item[1], True) for item in self.ignore]
            if any(p is None for p in parts):
                raise Unsupported("an %ignore pattern refers to a rule")
            ignore = f"(?:{'|'.join(p for p in parts if p is not None)})*"
        try:
            body = _Expander(self, depth, ignore).name("start", terminal=False)
        except _TooLarge:
            return None
        if body is None:
            return None
        return f"{body}{ignore}" if ignore else body


@dataclass
class _Expander:
    """Inlines rules into one regex; a rule already `depth` times on the stack yields nothing (None)."""

    grammar: LarkGrammar
    depth: int
    ignore: str | None  # the %ignore regex, put before each terminal of a rule
    stack: list[str] = field(default_factory=list)

    def name(self, name: str, *, terminal: bool) -> str | None:
        alternatives = self.grammar.rules.get(name)
        if alternatives is None:
            raise Unsupported(f"{name!r} is used but not defined")
        is_terminal = terminal or _is_terminal(name)
        if self.stack.count(name) >= self.depth:
            return None
        if is_terminal and name in self.stack:
            raise Unsupported(f"terminal {name!r} refers to itself")
        self.stack.append(name)
        try:
            body = self.alternatives(alternatives, is_terminal)
        finally:
            self.stack.pop()
        if body is not None and self.ignore and is_terminal and not terminal:
            body = f"{self.ignore}{body}"  # a terminal used by a rule: ignored text may come before it
        return body

    def alternatives(self, alternatives: list, terminal: bool) -> str | None:
        out = []
        for sequence in alternatives:
            parts = []
            for item in sequence:
                part = self.item(item, terminal)
                if part is None:
                    break
                parts.append(part)
            else:
                out.append("".join(parts))
        if not out:
            return None
        body = out[0] if len(out) == 1 else "|".join(out)
        if len(body) > MAX_PATTERN:
            raise _TooLarge()
        return f"(?:{body})"

    def item(self, item: tuple, terminal: bool) -> str | None:
        kind = item[0]
        if kind == "string":
            text = _regex_literal(item[1])
            text = f"(?i:{text})" if item[2] else text
            return f"{self.ignore}{text}" if self.ignore and not terminal else text
        if kind == "regex":
            flags = "".join(f for f in item[2] if f in "imsx")
            body = f"(?{flags}:{item[1]})" if flags else f"(?:{item[1]})"
            return f"{self.ignore}{body}" if self.ignore and not terminal else body
        if kind == "range":
            lo, hi = _regex_literal(item[1], in_class=True), _regex_literal(item[2], in_class=True)
            body = f"[{lo}-{hi}]"
            return f"{self.ignore}{body}" if self.ignore and not terminal else body
        if kind == "name":
            return self.name(item[1], terminal=terminal)
        if kind == "group":
            return self.alternatives(item[1], terminal)
        if kind == "repeat":  # ("repeat", inner, lo, hi): hi None = unbounded
            inner = self.item(item[1], terminal)
            lo, hi = item[2], item[3]
            if inner is None:
                return "" if lo == 0 else None
            quant = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((lo, hi))
            if quant is None:
                quant = f"{{{lo},}}" if hi is None else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
            return f"(?:{inner}){quant}"
        raise AssertionError(kind)


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _tokens(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            line = text.count("\n", 0, i) + 1
            raise Unsupported(f"line {line}: cannot read {text[i : i + 20]!r}")
        kind = m.lastgroup
        assert kind is not None  # every alternative of the pattern is a named group
        if kind == "directive" and m.group() in ("%json", "%regex"):
            raise Unsupported(f"{m.group()} cannot be expressed inside a regex")
        if kind == "special":
            raise Unsupported(f"special token {m.group()} cannot be part of a tool's text input")
        if kind == "ref":
            raise Unsupported(f"sub-grammar reference {m.group()} is not supported")
        if kind not in ("ws", "comment"):
            out.append((kind, m.group()))
        i = m.end()
    return out


def _statements(tokens: list[tuple[str, str]]) -> Iterable[list[tuple[str, str]]]:
    """Statements end at a newline outside brackets that is not followed by a line starting with '|'."""
    current: list[tuple[str, str]] = []
    depth = 0
    for i, tok in enumerate(tokens):
        if tok[0] == "nl":
            rest = next((t for t in tokens[i + 1 :] if t[0] != "nl"), None)
            if depth == 0 and rest != ("punct", "|") and current:
                yield current
                current = []
            continue
        if tok[0] == "punct" and tok[1] in "([{":
            depth += 1
        elif tok[0] == "punct" and tok[1] in ")]}":
            depth -= 1
        current.append(tok)
    if current:
        yield current


@dataclass
class _Items:
    """A recursive-descent reader of Lark expansions: alternatives of sequences of (possibly repeated) atoms."""

    toks: list[tuple[str, str]]
    i: int

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def next_kind(self) -> str | None:
        tok = self.peek()
        return tok[0] if tok else None

    def expansions(self) -> tuple[list, int]:
        alternatives = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.i += 1
            alternatives.append(self.sequence())
        return alternatives, self.i

    def sequence(self) -> list:
        items: list = []
        while True:
            tok = self.peek()
            if tok is None or tok in (("punct", "|"), ("punct", ")"), ("punct", "]")):
                return items
            if tok[0] == "arrow":  # an alias names the tree node: no part of the language
                self.i += 2
                continue
            items.append(self.repeated())

    def repeated(self) -> tuple:
        atom = self.atom()
        while True:
            tok = self.peek()
            if tok is not None and tok[0] == "punct" and tok[1] in "?*+":
                self.i += 1
                atom = ("repeat", atom, *{"?": (0, 1), "*": (0, None), "+": (1, None)}[tok[1]])
            elif tok == ("punct", "{"):
                lo, hi = self.bounds("}")
                atom = ("repeat", atom, lo, hi)
            elif tok == ("punct", "~"):
                self.i += 1
                lo = self.number()
                hi = lo
                if self.peek() == ("range", ".."):
                    self.i += 1
                    hi = self.number()
                atom = ("repeat", atom, lo, hi)
            else:
                return atom

    def bounds(self, close: str) -> tuple[int, int | None]:
        self.i += 1  # {
        lo = self.number() if self.next_kind() == "number" else 0
        hi: int | None = lo
        if self.peek() == ("punct", ","):
            self.i += 1
            hi = self.number() if self.next_kind() == "number" else None
        self.expect(close)
        return lo, hi

    def number(self) -> int:
        tok = self.peek()
        if tok is None or tok[0] != "number":
            raise Unsupported(f"expected a number, found {tok[1] if tok else 'the end'!r}")
        self.i += 1
        return int(tok[1])

    def expect(self, punct: str) -> None:
        if self.peek() != ("punct", punct):
            tok = self.peek()
            found = tok[1] if tok else "the end"
            raise Unsupported(f"expected {punct!r}, found {found!r}")
        self.i += 1

    def atom(self) -> tuple:
        tok = self.peek()
        if tok is None:
            raise Unsupported("an expansion ends early")
        kind, value = tok
        self.i += 1
        if kind == "string":
            text = _lark_string(value)
            if self.peek() == ("range", ".."):
                self.i += 1
                end = self.peek()
                if end is None or end[0] != "string":
                    raise Unsupported('a range needs two strings: "a".."z"')
                self.i += 1
                return ("range", text, _lark_string(end[1]))
            return ("string", text, not value.endswith('"'))  # "..."i: case-insensitive
        if kind == "regex":
            body, _, flags = value[1:].rpartition("/")
            return ("regex", body, flags)
        if kind == "name":
            return ("name", value.lstrip("?!"))
        if tok == ("punct", "("):
            alternatives, _ = self.expansions()
            self.expect(")")
            return ("group", alternatives)
        if tok == ("punct", "["):
            alternatives, _ = self.expansions()
            self.expect("]")
            return ("repeat", ("group", alternatives), 0, 1)
        if tok in (("punct", "~"), ("punct", "&")):
            raise Unsupported(f"the '{value}' operator (negation / intersection) cannot be expressed as a regex")
        raise Unsupported(f"unexpected {value!r}")


def _lark_string(token: str) -> str:
    """The text of a Lark string literal ("..." with Python-like escapes, optional trailing i flag)."""
    body = token[1:-1] if token.endswith('"') else token[1:-2]
    try:
        return json.loads('"' + body.replace("\\'", "'").replace("\\x", "\\u00") + '"')
    except json.JSONDecodeError:
        raise Unsupported(f"cannot read the string {token}") from None


_META = set(r"\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str, *, in_class: bool = False) -> str:
    """`text` as a regex matching exactly it (Rust regex syntax)."""
    out = []
    for c in text:
        if c == "\n":
            out.append(r"\n")
        elif c == "\t":
            out.append(r"\t")
        elif c == "\r":
            out.append(r"\r")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{{{ord(c):x}}}")
        elif c in _META or (in_class and c in "^]"):
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)
