"""Custom tools: a tool whose input is free-form text, held to a grammar (OpenAI's `custom` tools, whose `format` is
text, a Lark grammar or a regex), in the same tool-call format as every function tool.

The format. A custom tool is shown to the model as a function with one string parameter, `input`, and called like any
function in the model's own tool-call format (Qwen2.5's, Hermes'):

    <tool_call>
    {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Update File: bug.py\\n..."}}
    </tool_call>

The JSON string's *decoded* text is held to the tool's grammar by llguidance: the grammar becomes one anchored regex
(`core.lark_regex.input_pattern`, which says why a regex and how recursion is unrolled) and the tool's parameters
schema gives the string that regex as its `pattern`; llguidance's JSON compiler escapes the regex (a newline of the
input is the two characters `\\n` in the call), so every call the model can write decodes to an input the grammar
accepts. Why not a raw block (`<tool_call>\\napply_patch\\n<raw input>`)? The model was trained on the JSON format:
under `auto` it writes `{"name": ...` after `<tool_call>`, and a raw block would be a format it never saw; in JSON a
custom tool is one more function to it. What a regex cannot say (llguidance's `%json`, special tokens `<...>`,
`&`/`~` in terminals, `%declare`, `@sub-grammars`) is a 400 naming the tool's format.

The reply: `CustomInputs` wraps the tool-call parser; a custom tool's call streams its decoded input (not the JSON) as
`Arguments`, and its `CallEnd` carries the raw input (`ToolCall.kind == "custom"`). Past custom calls go back into the
prompt in the same JSON form (`template_arguments`), so the model sees its own format in the conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from specdec_cli.core.constraint import GrammarError, json_schema
from specdec_cli.core.lark_regex import Unsupported, input_pattern
from specdec_cli.server.errors import ApiError
from specdec_cli.server.reply import Arguments, CallEnd, CallStart, ParsedCall, Parser, ReplyEvent
from specdec_cli.server.request import InputGrammar, Tool, ToolCall, Tools

INPUT = "input"  # the one parameter a custom tool is shown with


# -- the tool -------------------------------------------------------------------------------------------------------
def input_grammar(syntax: Any, definition: Any, *, param: str) -> InputGrammar:
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
    return InputGrammar(syntax, definition, pattern)


def custom_tool(name: str, description: str | None, grammar: InputGrammar | None, *, param: str) -> Tool:
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
            self._buf = self._buf[m.end() :]
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
                low = _hex4(buf, i + 8) if buf[i + 6 : i + 8] == "\\u" else None
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
        return whole, whole[len(self.sent) :]


def _hex4(text: str, at: int) -> int | None:
    digits = text[at : at + 4]
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


def decode_calls(parser: Parser, tools: Tools | None) -> Parser:
    """`parser`, wrapped in `CustomInputs` when `tools` has custom tools (else as it is)."""
    custom = frozenset(t.name for t in tools.specs if t.kind == "custom") if tools is not None else frozenset()
    return CustomInputs(parser, custom) if custom else parser
