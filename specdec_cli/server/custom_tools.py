"""Custom tools: a tool whose input is free-form text, held to a grammar (OpenAI's `custom` tools, whose `format` is
text, a Lark grammar or a regex), in the same tool-call format as every function tool.

The format. A custom tool is shown to the model as a function with one string parameter, `input`, and called like any
function in the model's own tool-call format (Qwen2.5's, Hermes'):

    <tool_call>
    {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Update File: bug.py\\n..."}}
    </tool_call>

The JSON string's *decoded* text is held to the tool's grammar by llguidance: the grammar becomes one anchored regex
(`input_pattern`) and the tool's parameters schema gives the string that regex as its `pattern`; llguidance's JSON
compiler escapes the regex (a newline of the input is the two characters `\\n` in the call), so every call the model
can write decodes to an input the grammar accepts. Why not a raw block (`<tool_call>\\napply_patch\\n<raw input>`)?
The model was trained on the JSON format: under `auto` it writes `{"name": ...` after `<tool_call>`, and a raw block
would be a format it never saw; in JSON a custom tool is one more function to it. Why a regex? llguidance holds a JSON
string to a regex (`pattern`), not to a context-free grammar (its Lark dialect has no JSON-quoted sub-grammar:
docs/syntax.md of guidance-ai/llguidance). A Lark grammar without recursion describes a regular language, so it
becomes one regex exactly (Codex's `apply_patch` grammar is one of these); a recursive rule is unrolled
`MAX_DEPTH` levels deep, so what the model writes is still in the grammar's language, only nested less deeply than
the grammar allows. What a regex cannot say (llguidance's `%json`, special tokens `<...>`, `&`/`~` in terminals,
`%declare`, `@sub-grammars`) is a 400 naming the tool's format.

The reply: `CustomInputs` wraps the tool-call parser; a custom tool's call streams its decoded input (not the JSON) as
`Arguments`, and its `CallEnd` carries the raw input (`ToolCall.kind == "custom"`). Past custom calls go back into the
prompt in the same JSON form (`template_arguments`), so the model sees its own format in the conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Optional

from specdec_cli.core.constraint import GrammarError, json_schema
from specdec_cli.server.errors import ApiError
from specdec_cli.server.reply import Arguments, CallEnd, CallStart, ParsedCall, Parser, ReplyEvent
from specdec_cli.server.request import InputGrammar, Tool, ToolCall, Tools

MAX_DEPTH = 3  # how many times a recursive rule may nest in the input
MAX_PATTERN = 200_000  # characters of the regex a grammar becomes; a larger one is a 400
INPUT = "input"  # the one parameter a custom tool is shown with

# llguidance's `%import common.NAME` terminals (parser/src/lark/common.rs of guidance-ai/llguidance, after Lark's
# common.lark), as regexes
COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"(\+|-)?[0-9]+",
    "DECIMAL": r"([0-9]+\.[0-9]*)|(\.[0-9]+)", "_EXP": r"[eE](\+|-)?[0-9]+",
    "FLOAT": r"([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "SIGNED_FLOAT": r"(\+|-)?(([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+)",
    "NUMBER": r"([0-9]+)|([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+",
    "SIGNED_NUMBER": r"(\+|-)?(([0-9]+)|([0-9]+\.[0-9]*|\.[0-9]+)([eE](\+|-)?[0-9]+)?|[0-9]+[eE](\+|-)?[0-9]+)",
    "ESCAPED_STRING": r"\"([^\"\\]|\\.)*\"", "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]", "WORD": r"[A-Za-z]+", "CNAME": r"[_A-Za-z][_A-Za-z0-9]*", "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(\r?\n)+", "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"\/\*[^*]*\*+(?:[^/*][^*]*\*+)*\/", "SQL_COMMENT": r"--[^\n]*",
}


class Unsupported(Exception):
    """A grammar construct a regex cannot express (or a malformed grammar); the message says which and where."""


class _TooLarge(Exception):
    """The regex grew past MAX_PATTERN characters (try fewer levels of recursion)."""


# -- the tool -------------------------------------------------------------------------------------------------------
def input_grammar(syntax: str, definition: Any, *, param: str) -> InputGrammar:
    """A custom tool's `format` of type grammar, checked and turned into the regex its input is held to.

    Args:
        syntax: "lark" (llguidance's Lark dialect, the one OpenAI's custom tools take) or "regex" (Rust regex
            syntax; the whole input must match).
        definition: the grammar text.
        param: the field it came in (for the 400), e.g. "tools.3.format".

    Raises ApiError (400, `param`): an unknown syntax, an empty definition, a construct a regex cannot express, a
    grammar or regex llguidance cannot compile.
    """
    if syntax not in ("lark", "regex"):
        raise ApiError(400, f"{param}.syntax is {syntax!r}: use 'lark' or 'regex'.", param=f"{param}.syntax")
    if not isinstance(definition, str) or not definition.strip():
        raise ApiError(400, f"{param}.definition is empty: give the grammar.", param=f"{param}.definition")
    try:
        pattern = input_pattern(syntax, definition)
    except Unsupported as e:
        raise ApiError(400, f"{param}: {e}", param=f"{param}.definition") from None
    return InputGrammar(syntax, definition, pattern)  # type: ignore[arg-type]


def custom_tool(name: str, description: Optional[str], grammar: Optional[InputGrammar], *, param: str) -> Tool:
    """A custom tool as the internal `Tool`: one string parameter `input`, held to `grammar` (None: any text).

    Raises ApiError (400, `param`): llguidance cannot compile the input's schema (the regex it became)."""
    string: dict[str, Any] = {"type": "string"}
    if grammar is not None:
        string["pattern"] = grammar.pattern
    schema = {"type": "object", "properties": {INPUT: string}, "required": [INPUT], "additionalProperties": False}
    try:
        json_schema(schema, name=param)
    except GrammarError as e:
        raise ApiError(400, f"{param}: llguidance cannot hold the input to this grammar ({e}).", param=param) from None
    return Tool(name, description, schema, kind="custom", grammar=grammar)


def template_arguments(call: ToolCall) -> Any:
    """A past call's arguments as chat templates take them: a custom call's raw input as {"input": text} (the form
    the model writes it in), a function's JSON object (text that is not JSON stays text)."""
    if call.kind == "custom":
        return {INPUT: call.arguments}
    try:
        return json.loads(call.arguments)
    except (json.JSONDecodeError, RecursionError):
        return call.arguments


# -- the grammar as one regex ---------------------------------------------------------------------------------------
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
    raise Unsupported("the grammar is too large to hold its input to (its recursive rules unrolled once exceed "
                      f"{MAX_PATTERN} characters of regex), or its recursion never ends")


_TOKEN = re.compile(r"""
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
""", re.X)


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
    def regex(self, depth: int) -> Optional[str]:
        """The language of `start` as a regex, recursion unrolled `depth` levels; None when nothing is left (every
        derivation recurses deeper) or the regex grows past MAX_PATTERN."""
        ignore = None
        if self.ignore:
            parts = [_Expander(self, depth, None).alternatives(item[1], True) for item in self.ignore]
            if any(p is None for p in parts):
                raise Unsupported("an %ignore pattern refers to a rule")
            ignore = f"(?:{'|'.join(parts)})*"
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
    ignore: Optional[str]  # the %ignore regex, put before each terminal of a rule
    stack: list[str] = field(default_factory=list)

    def name(self, name: str, *, terminal: bool) -> Optional[str]:
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

    def alternatives(self, alternatives: list, terminal: bool) -> Optional[str]:
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

    def item(self, item: tuple, terminal: bool) -> Optional[str]:
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
            raise Unsupported(f"line {line}: cannot read {text[i:i + 20]!r}")
        kind = m.lastgroup
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
            rest = next((t for t in tokens[i + 1:] if t[0] != "nl"), None)
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

    def peek(self) -> Optional[tuple[str, str]]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def expansions(self) -> tuple[list, int]:
        alternatives = [self.sequence()]
        while self.peek() == ("punct", "|"):
            self.i += 1
            alternatives.append(self.sequence())
        return alternatives, self.i

    def sequence(self) -> list:
        items = []
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

    def bounds(self, close: str) -> tuple[int, Optional[int]]:
        self.i += 1  # {
        lo = self.number() if self.peek() and self.peek()[0] == "number" else 0
        hi: Optional[int] = lo
        if self.peek() == ("punct", ","):
            self.i += 1
            hi = self.number() if self.peek() and self.peek()[0] == "number" else None
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
            found = self.peek()[1] if self.peek() else "the end"
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
                    raise Unsupported("a range needs two strings: \"a\"..\"z\"")
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


# -- the reply ------------------------------------------------------------------------------------------------------
_INPUT_HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass
class InputDecoder:
    """The decoded `input` string of a custom call's arguments ({"input": "..."}) as the arguments stream: `feed`
    returns the input text the new piece completes (an escape is held back until it is whole)."""

    _buf: str = ""
    _state: Literal["head", "string", "done"] = "head"
    sent: str = ""

    def feed(self, piece: str) -> str:
        self._buf += piece
        out = []
        if self._state == "head":
            m = _INPUT_HEAD.match(self._buf)
            if m is None:
                return ""
            self._buf = self._buf[m.end():]
            self._state = "string"
        i, buf = 0, self._buf
        while self._state == "string" and i < len(buf):
            c = buf[i]
            if c == '"':
                self._state = "done"
                i += 1
                break
            if c != "\\":
                j = i
                while j < len(buf) and buf[j] not in '"\\':
                    j += 1
                out.append(buf[i:j])
                i = j
                continue
            if i + 1 >= len(buf):
                break  # the escape is not whole yet
            e = buf[i + 1]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 2
                continue
            if e != "u":
                out.append(e)  # not JSON: take it as the character
                i += 2
                continue
            if len(buf) - i < 6:
                break  # wait for the whole \uXXXX
            code = _hex4(buf, i + 2)
            if code is None:
                out.append(e)  # not JSON: take it as the character
                i += 2
                continue
            if 0xD800 <= code < 0xDC00:  # a surrogate pair's first half: its second follows
                if len(buf) - i < 12:
                    break
                low = _hex4(buf, i + 8) if buf[i + 6:i + 8] == "\\u" else None
                if low is not None and 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
            out.append("\ufffd" if 0xD800 <= code < 0xE000 else chr(code))
            i += 6
        self._buf = buf[i:]
        text = "".join(out)
        self.sent += text
        return text

    def finish(self, arguments: str) -> tuple[str, str]:
        """(the whole input, what of it was not sent yet), from the call's complete arguments text (a call cut short
        keeps what was decoded)."""
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            value = None
        whole = value.get(INPUT) if isinstance(value, dict) else None
        if not isinstance(whole, str) or not whole.startswith(self.sent):
            return self.sent, ""
        return whole, whole[len(self.sent):]


def _hex4(text: str, at: int) -> Optional[int]:
    digits = text[at:at + 4]
    return int(digits, 16) if len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits) else None


@dataclass
class CustomInputs:
    """A tool-call parser (`reply.Parser`) whose custom tools' calls carry their decoded input: `CallStart` with
    kind "custom", `Arguments` with pieces of the input text, `CallEnd` with the raw input as the call's arguments.

    Args:
        parser: the request's tool-call parser (`tools.ReplyParser`).
        custom: the names of the request's custom tools.
    """

    parser: Parser
    custom: frozenset[str]
    _decoders: dict[int, InputDecoder] = field(default_factory=dict)

    def feed(self, text: str) -> list[ReplyEvent]:
        return self._map(self.parser.feed(text))

    def close(self, cut: bool = False) -> list[ReplyEvent]:
        return self._map(self.parser.close(cut=cut))

    def _map(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        for e in events:
            if isinstance(e, CallStart) and e.call.name in self.custom:
                self._decoders[e.call.index] = InputDecoder()
                out.append(CallStart(ParsedCall(e.call.index, e.call.id, e.call.name, kind="custom")))
            elif isinstance(e, Arguments) and e.index in self._decoders:
                text = self._decoders[e.index].feed(e.text)
                if text:
                    out.append(Arguments(e.index, text))
            elif isinstance(e, CallEnd) and e.index in self._decoders:
                whole, rest = self._decoders.pop(e.index).finish(e.call.arguments)
                if rest:
                    out.append(Arguments(e.index, rest))
                out.append(CallEnd(ToolCall(e.call.id, e.call.name, whole, kind="custom"), e.index))
            else:
                out.append(e)
        return out


def decode_calls(parser: Parser, tools: Optional[Tools]) -> Parser:
    """`parser`, wrapped in `CustomInputs` when `tools` has custom tools (else as it is)."""
    custom = frozenset(t.name for t in tools.specs if t.kind == "custom") if tools is not None else frozenset()
    return CustomInputs(parser, custom) if custom else parser
