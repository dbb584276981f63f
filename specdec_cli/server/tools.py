"""Tool calls: the request's tools checked, the grammar that constrains the reply, and the reply parsed back into
OpenAI's `tool_calls` as it streams.

The format is the one Qwen2.5's chat template (and Hermes', Qwen3's) asks for, with the arguments as a JSON object:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through its own chat template (`tools=`), which describes them in its system prompt; the
reply is constrained by a grammar in llguidance's Lark dialect (`constraint.from_lark`), one `%json` per tool:

- `required`: the reply is one or more tool calls (one with `parallel_tool_calls: false`), each of an allowed tool
  with arguments valid against its `parameters`; a named function: one call of it; the calls may be followed by
  one newline (the model's own ending before its end token);
- `auto`: free text, optionally followed by such tool calls: once `<tool_call>` is written, what follows is
  constrained like `required`; the free text itself cannot contain `<tool_call>`;
- `none`: free text that cannot contain `<tool_call>`.
When the vocabulary has `<tool_call>` and `</tool_call>` as single tokens (Qwen2.5: user-defined tokens, which
llguidance treats as special tokens), the grammar names those tokens (`<tool_call>`, as llguidance's special-token
syntax), so the model writes the tags the way it was trained to; otherwise they are literal text.

`ReplyParser` splits the reply into content and tool calls as it streams, the way vLLM's Hermes tool parser streams
them (`vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`): a call's first delta carries its index, id, type
and function name; the following ones carry pieces of `function.arguments` (the JSON text exactly as the model wrote
it). The non-streamed reply is the same parser run over the whole text, so both agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from specdec_cli.core.constraint import Grammar, GrammarError, from_lark, json_schema
from specdec_cli.server.errors import ApiError
from specdec_cli.server.reply import Arguments, CallEnd, CallStart, Content, ParsedCall, ReplyEvent, new_id
from specdec_cli.server.request import NO_PARAMETERS, Tools

__all__ = [
    "Arguments",
    "CallEnd",
    "CallStart",
    "Content",
    "ReplyParser",
    "Tags",
    "check_parameters",
    "detect_tags",
    "grammar",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
# llguidance's JSON options: one-line JSON with ", " and ": " between items, as Qwen2.5's template writes the calls
# of earlier turns (Jinja's `tojson`) and as `constraint.json_schema` lays out JSON by default
# "lenient": keywords llguidance does not implement (e.g. propertyNames, in Claude Code's tools) are not enforced
# instead of failing the grammar; `check_parameters` decides beforehand whether a translator allows them
INLINE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
FREE = {"whitespace_flexible": True, "lenient": True}
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"  # a call as a Markdown JSON block (auto only, the whole reply)
FENCED_CALL = FENCE_OPEN + "{"


def check_parameters(parameters: Any, param: str, *, lenient: bool = False) -> dict:
    """A tool's arguments schema, checked: compiled once by llguidance so a bad schema is a 400 that says where
    (`param`: the field it came in, e.g. "tools.0.function.parameters"); None = a tool without parameters.
    `lenient`: keywords llguidance does not implement are accepted and not enforced (llguidance's `lenient`).

    Raises ApiError (400, `param`).
    """
    if parameters is None:
        return dict(NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{param} is not a JSON schema object.", param=param)
    try:
        json_schema({**parameters, "x-guidance": {"lenient": True}} if lenient else parameters, name=param)
    except GrammarError as e:
        raise ApiError(400, str(e), param=param) from None
    return parameters


# -- the grammar ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tags:
    """How the grammar writes `<tool_call>` and `</tool_call>`: as special tokens of the vocabulary (llguidance's
    `<name>` syntax) or as literal text."""

    special: bool = False

    @property
    def open(self) -> str:
        return OPEN if self.special else json.dumps(OPEN)

    @property
    def close(self) -> str:
        return CLOSE if self.special else json.dumps(CLOSE)


def detect_tags(tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes]) -> Tags:
    """`Tags(special=True)` when each tag is one token of the vocabulary that renders as the tag (Qwen2.5's
    user-defined `<tool_call>` 151657 and `</tool_call>` 151658). `tokenize` parses special tokens."""
    for tag in (OPEN, CLOSE):
        ids = tokenize(tag)
        if len(ids) != 1 or piece(ids[0]) != tag.encode():
            return Tags(special=False)
    return Tags(special=True)


def call_schema(name: str, parameters: Mapping[str, Any]) -> dict:
    """The JSON schema of one call's object: {"name": NAME, "arguments": <parameters>}, in that order."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def grammar(tools: Tools, tags: Tags, *, reply: dict | None = None) -> Grammar:
    """The Lark grammar (llguidance's dialect) of a reply under `tools` (see the module docstring).

    Under `auto` the reply may also be one call written as a bare JSON object or in a Markdown JSON block
    (FENCE_OPEN + the object + FENCE_CLOSE), as Qwen2.5-Coder writes calls when its template offers tools (users of
    vLLM and llama.cpp meet the same habit; llama.cpp's Hermes parser accepts both forms): a reply that starts with
    "{" or with a JSON block holding an object is constrained like a call (its whitespace left free: the model's own
    layout), so under `auto` such a reply is always a tool call.

    Args:
        reply: a JSON schema the non-tool reply must follow (`response_format`), or None for free text.

    Raises:
        ApiError (400, param "tools"): llguidance refused the grammar (not expected once each tool's parameters
            compiled on their own).
    """
    params = tools.parameters
    calls = [call_schema(n, params[n]) for n in tools.allowed]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # free text cannot start with "{" or FENCE_OPEN + "{" (then it is a call): llguidance's lexer is greedy, so TEXT
    # must die right there for the call's own lexemes to take over
    fence = r"/(```json\n)?\{(?s:.*)/"
    if tags.special:  # a regex cannot produce a special token: free text never contains <tool_call>
        text = f"TEXT: /(?s:.*)/ & ~{fence}"
    else:
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/ & ~{fence}"
    plain = "reply" if reply is not None else "TEXT"
    more = ' ("\\n" call)*' if tools.parallel else ""
    # the model may end its calls with a newline before its end token (Qwen2.5-Coder does, at p ~ 1): without this
    # optional "\n" the newline could only start another call, and the grammar forced one (a loop to max_tokens)
    more += ' "\\n"?'
    lines = ["%llguidance {}"]
    if tools.mode == "none":
        lines.append(f"start: {plain}")
    elif tools.mode == "required":
        lines.append(f"start: call{more}")
    elif reply is not None:
        lines.append(f"start: reply | call{more}")
    elif tags.special:
        lines.append(f"start: TEXT | fenced | free_arguments | TEXT call{more}")
    else:  # the text before the first call ends lazily, at the first <tool_call>
        lines.append(f"start: TEXT | fenced | free_arguments | lead call_body{more}")
        lines.append(f"lead[lazy]: /(?s:.*){re.escape(OPEN)}/ & ~{fence}")
    lines.append(f"call: {tags.open} call_body")
    lines.append(f'call_body: "\\n" arguments "\\n" {tags.close}')
    lines.append(f"arguments: %json {json.dumps({**body, 'x-guidance': INLINE}, ensure_ascii=False)}")
    lines.append(f"fenced: {json.dumps(FENCE_OPEN)} free_arguments {json.dumps(FENCE_CLOSE)}")
    lines.append(f"free_arguments: %json {json.dumps({**body, 'x-guidance': FREE}, ensure_ascii=False)}")
    if reply is not None:
        lines.append(f"reply: %json {json.dumps({**reply, 'x-guidance': INLINE}, ensure_ascii=False)}")
    lines.append(text)
    try:
        return from_lark("\n".join(lines) + "\n", name="tools")
    except GrammarError as e:
        raise ApiError(400, str(e), param="tools") from None


# -- the reply ------------------------------------------------------------------------------------------------------


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


@dataclass
class StreamingParser:
    """What the reply parsers share: without `tools` the reply's text passes through as content; with them it
    accumulates in `_buf` and `_drain` gives the events that what has come so far decides (`final`: the reply ended);
    `calls`: the calls parsed so far."""

    tools: bool
    calls: list[ParsedCall] = field(default_factory=list)
    _buf: str = ""

    def feed(self, text: str) -> list[ReplyEvent]:
        """Events for the next piece of reply text (possibly none: text is held back while it could be a call)."""
        if not self.tools:
            return [Content(text)] if text else []
        self._buf += text
        return self._drain(final=False)

    def _drain(self, *, final: bool) -> list[ReplyEvent]:
        raise NotImplementedError


@dataclass
class ReplyParser(StreamingParser):
    """Splits a reply into content and tool calls as its text streams (`feed`), then `close`.

    With `tools` off it passes the text through as content. With tools on: text outside `<tool_call>` blocks is
    content, except whitespace before a call or at the end of a reply with calls (trailing whitespace is held back
    until text follows it); a block's `{"name": ..., "arguments": ...}` becomes a `ToolCall`, announced
    (`CallStart`) once its name is complete and then streamed as `Arguments` pieces: the JSON text of `arguments`
    exactly as written, trailing whitespace excluded. A block without that shape (possible only without a grammar)
    is given back as content, or as a call when it parses as JSON of that shape. With `loose`, a reply that starts
    with "{" or with FENCED_CALL is one call (`grammar` under auto).
    """

    loose: bool = field(default=False, kw_only=True)
    _state: Literal["text", "head", "args"] = "text"
    _spaces: str = ""  # whitespace-only content held back
    _args_sent: int = 0  # characters of the current call's arguments already sent
    _fresh: bool = True  # nothing decided yet: the reply may be a fenced call
    _open: str = OPEN  # the current block's tags: <tool_call> ... </tool_call>, or a fenced call's
    _close: str = CLOSE

    def close(self, cut: bool = False) -> list[ReplyEvent]:
        """Events for what was held back, at the end of the reply. `cut` (max_tokens or the context ended it): a
        call still unfinished gives nothing (the arguments written so far are not JSON); without `cut`, it ends
        with what was written (possible only without a grammar)."""
        if not self.tools:
            return []
        if cut and self._state != "text":  # `feed` drained all it could: what is left is the unfinished call
            return []
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        while True:
            if self._state == "text" and self._fresh and self.loose:
                if FENCED_CALL.startswith(self._buf) and not final:
                    return out  # it may still become a fenced call
                self._fresh = False
                if self._buf.startswith(FENCED_CALL):
                    self._buf = self._buf[len(FENCE_OPEN) :]
                    self._open, self._close, self._state = FENCE_OPEN, FENCE_CLOSE, "head"
                elif self._buf.startswith("{"):  # a bare object: the whole reply is the call
                    self._open, self._close, self._state = "", "", "head"
                continue
            if self._state == "text":
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = 0 if final else _held_tag_prefix(self._buf)
                    self._text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    if final and self._spaces and not self.calls:
                        out.append(Content(self._spaces))
                    return out
                self._text(self._buf[:at], out)
                self._spaces = ""  # whitespace next to a call is not content
                self._buf = self._buf[at + len(OPEN) :]
                self._open, self._close, self._state = OPEN, CLOSE, "head"
            elif self._state == "head":
                m = _HEAD.match(self._buf)
                end = self._buf.find(self._close) if self._close else -1
                if m is not None and m.end() == len(self._buf) and not final:
                    return out  # whitespace may still follow "arguments":
                if m is None or (0 <= end < m.end()):
                    if end >= 0 or final:  # not the expected shape
                        block = self._buf[:end] if end >= 0 else self._buf
                        self._fallback(block, self._close if end >= 0 else "", out)
                        self._buf = self._buf[end + len(self._close) :] if end >= 0 else ""
                        self._state = "text"
                        continue
                    return out
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = m.group(1)
                self._start(name, out)
                self._buf = self._buf[m.end() :]
                self._state = "args"
            else:  # args: the text up to the wrapper's closing brace before </tool_call>
                end = self._buf.find(self._close) if self._close else -1
                call = self.calls[-1]
                if end >= 0:
                    args = self._buf[:end].rstrip()
                    args = args[:-1].rstrip() if args.endswith("}") else args
                    self._send_args(call, args, out)
                    out.append(CallEnd(call.frozen(), call.index))
                    self._buf = self._buf[end + len(self._close) :]
                    self._state = "text"
                    continue
                if final:
                    args = self._buf.rstrip()
                    if not self._close and args.endswith("}"):  # a bare object's own closing brace
                        args = args[:-1].rstrip()
                    self._send_args(call, args, out)
                    out.append(CallEnd(call.frozen(), call.index))
                    self._buf = ""
                    return out
                self._send_args(call, self._buf[: _held_args_tail(self._buf, self._close)], out)
                return out

    def _start(self, name: str, out: list[ReplyEvent]) -> ParsedCall:
        call = ParsedCall(len(self.calls), new_id("call"), name)
        self.calls.append(call)
        self._args_sent = 0
        out.append(CallStart(call))
        return call

    def _send_args(self, call: ParsedCall, args: str, out: list[ReplyEvent]) -> None:
        piece = args[self._args_sent :]
        if piece:
            call.arguments += piece
            self._args_sent += len(piece)
            out.append(Arguments(call.index, piece))

    def _text(self, text: str, out: list[ReplyEvent]) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            out.append(Content(self._spaces + body))
            self._spaces = ""
        self._spaces += text[len(body) :]  # trailing whitespace waits for what follows it

    def _fallback(self, block: str, close: str, out: list[ReplyEvent]) -> None:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
            call = self._start(obj["name"], out)
            self._send_args(call, json.dumps(obj["arguments"], ensure_ascii=False), out)
            out.append(CallEnd(call.frozen(), call.index))
        else:
            self._text(self._open + block + close, out)


def _held_tag_prefix(text: str) -> int:
    """Length of the end of `text` that could be the start of `<tool_call>` (held back until known)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _held_args_tail(text: str, close: str) -> int:
    """Where to stop sending arguments: before trailing whitespace, and before a last `}` followed only by
    whitespace and the start of the closing tag `close` (it may be the wrapper's closing brace)."""
    end = len(text.rstrip())
    brace = text.rfind("}", 0, end)
    if brace >= 0:
        rest = text[brace + 1 :].lstrip()
        if close.strip().startswith(rest):
            end = len(text[:brace].rstrip())
    return end
