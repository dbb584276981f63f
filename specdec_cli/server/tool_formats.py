"""Tool-call formats: how each chat-template family asks for tool calls, one small class per family.

A `ToolFormat` is what the service needs to serve tools on a template: `render` (the conversation and tools as the
template takes them: past calls and results it cannot render become text), `grammar` (the reply under the request's
tools, in llguidance's Lark dialect: calls constrained to each tool's parameters, so grammar-aware drafting — the
forced tokens drafted free, drafts cut at the first forbidden token — works in every format) and `parser` (the
reply back into text and calls, `reply.Parser`). `detect` picks one from the template's text by substrings, as
llama.cpp's `common_chat_templates_apply` tries its specialised formats first (common/chat.cpp):

| family                | detected by                     | a reply's calls                                            |
|-----------------------|---------------------------------|------------------------------------------------------------|
| Hermes/Qwen2.5/Qwen3  | `<tool_call>`                   | `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>` |
| Llama 3.1/3.2/3.3     | `<|start_header_id|>`+`ipython` | `{"name": N, "parameters": A}` (one per turn)              |
| Mistral 7B v0.3, Nemo | `[TOOL_CALLS]`, no `[ARGS]`     | `[TOOL_CALLS][{"name": N, "arguments": A}, ...]`           |
| Phi-4-mini            | `<|tool|>`                      | `functools[{"name": N, "arguments": A}, ...]`              |
| generic               | anything else                   | JSON: `{"tool_calls": [...]}` or `{"response": "..."}`     |

The generic format (anything else: SmolLM2, Gemma, Mistral 3.2's `[ARGS]`) is llama-server's fallback for templates
without tool support (its old `common_chat_params_init_generic`, and minja's polyfills for the history): the tools
are described in a system message, the reply is JSON held to a schema, past calls are rendered as the JSON the model
wrote and tool results as user text. A model without any chat template (Gemma 3 270M, a base model) cannot chat at
all: the chat template's absence is a 400 before tools matter (`LlamaBackend.format_chat`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from specdec_cli.core.constraint import Grammar, GrammarError, from_lark
from specdec_cli.server.errors import ApiError
from specdec_cli.server.reply import (
    Arguments,
    CallEnd,
    CallStart,
    Content,
    ParsedCall,
    Parser,
    ReplyEvent,
    new_id,
)
from specdec_cli.server.request import Tools
from specdec_cli.server.tools import (
    INLINE,
    ReplyParser,
    StreamingParser,
    Tags,
    call_schema,
    detect_tags,
)
from specdec_cli.server.tools import (
    grammar as hermes_grammar,
)

Tokenize = Callable[[str], list[int]]  # special tokens parsed
Piece = Callable[[int], bytes]


class ToolFormat(Protocol):
    """How one template family takes tools and writes tool calls."""

    @property
    def name(self) -> str:
        """The family's name ("hermes", "llama3", ...)."""
        ...

    def render(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """The conversation (Hugging Face's message dicts, `service.template_messages`) and tools (OpenAI's tool
        dicts, None without tools) as the template should get them."""
        ...

    def grammar(self, tools: Tools, reply: dict | None) -> Grammar | None:
        """The grammar of a reply under `tools` (any mode); `reply`: the JSON schema the reply's text must follow
        (`response_format`), None for free text. None: no constraint. Raises ApiError (400, "tools")."""
        ...

    def parser(self, tools: Tools | None, output: bool) -> Parser:
        """The parser of a reply; `tools` None: no tools (text passes through); `output`: a response format."""
        ...


# -- the families -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hermes:
    """`<tool_call>` blocks (Qwen2.5's, Hermes', Qwen3's template): `tools.grammar` and `tools.ReplyParser`."""

    tags: Tags = Tags()
    name: str = "hermes"

    def render(self, messages, tools):
        return messages, tools

    def grammar(self, tools, reply):
        return hermes_grammar(tools, self.tags, reply=reply)

    def parser(self, tools, output):
        calls = tools is not None and tools.mode != "none"
        return ReplyParser(calls, loose=calls and tools.mode == "auto" and not output)


@dataclass(frozen=True)
class Tag:
    """A marker before the calls (`[TOOL_CALLS]`, `<|python_tag|>`): one special token of the vocabulary (written in
    the grammar by its id, llguidance's `<[id]>`; it may render as no text at all), or literal text."""

    text: str
    token: int | None = None

    @property
    def lark(self) -> str:
        return f"<[{self.token}]>" if self.token is not None else json.dumps(self.text)


def find_tag(text: str, tokenize: Tokenize | None) -> Tag:
    """`text` as one special token when the vocabulary has it (`tokenize` parses special tokens), else as text."""
    ids = tokenize(text) if tokenize is not None else []
    return Tag(text, ids[0]) if len(ids) == 1 and len(text) > 1 else Tag(text)


@dataclass(frozen=True)
class JsonCalls:
    """Calls as JSON objects after a marker: `{"name": N, KEY: {...}}`, in a JSON array when `array`.

    Attributes:
        name: the family. tag: the marker before the calls (None: none); optional_tag: the model may leave it out.
        opener: literal text after the tag ("functools" for Phi-4). key: the arguments' key ("arguments",
        Llama 3's "parameters"). array: calls in `[..., ...]` (else one call per reply).
    """

    name: str
    tag: Tag | None = None
    opener: str = ""
    key: str = "arguments"
    array: bool = True
    optional_tag: bool = False

    def render(self, messages, tools):
        return messages, tools

    def heads(self) -> tuple[str, ...]:
        """The texts a reply with calls starts with (the tag rendered or not), up to the first object's "{"."""
        body = self.opener + ("[{" if self.array else "{")
        return (self.tag.text + body, body) if self.tag is not None else (body,)

    def grammar(self, tools, reply):
        calls = [_call_schema(n, tools.parameters[n], self.key) for n in tools.allowed]
        body = calls[0] if len(calls) == 1 else {"anyOf": calls}
        lines = [f"call: %json {json.dumps({**body, 'x-guidance': INLINE}, ensure_ascii=False)}"]
        more = ' (", " call)*' if tools.parallel else ""
        lines.append(f'calls: {self._opening()} call{more} "]"' if self.array else f"calls: {self._opening()} call")
        plain = "reply" if reply is not None else "TEXT"
        lines.insert(
            0, {"none": f"start: {plain}", "required": "start: calls"}.get(tools.mode, f"start: {plain} | calls")
        )
        if reply is not None:
            lines.append(f"reply: %json {json.dumps({**reply, 'x-guidance': INLINE}, ensure_ascii=False)}")
        lines.append(_text_rule(self.heads()))
        return _lark(lines)

    def _opening(self) -> str:
        """The Lark of what opens the calls: the marker (a special token; or text, one literal with the opener and
        "[": llguidance's lexer is greedy, and TEXT, alive until the call's "{", must die one byte after a complete
        literal for that literal to be taken), optional when `optional_tag`."""
        head = self.opener + ("[" if self.array else "")
        if self.tag is None:
            return json.dumps(head) if head else ""
        if self.tag.token is not None:
            marker = f"{self.tag.lark} {json.dumps(head)}" if head else self.tag.lark
        else:
            marker = json.dumps(self.tag.text + head)
        if not self.optional_tag:
            return marker
        return f"({marker} | {json.dumps(head)})" if head else f"{marker}?"

    def parser(self, tools, output):
        return JsonCallsParser(
            tools is not None and tools.mode != "none", heads=self.heads(), key=self.key, array=self.array
        )


@dataclass(frozen=True)
class Llama3(JsonCalls):
    """Llama 3.x: `{"name": N, "parameters": {...}}` (optionally after `<|python_tag|>`), one call per turn; the
    template raises on an assistant turn with more calls, so such turns are split into one turn per call."""

    name: str = "llama3"
    tag: Tag | None = Tag("<|python_tag|>")
    key: str = "parameters"
    array: bool = False
    optional_tag: bool = True

    def render(self, messages, tools):
        out: list[dict] = []
        for m in messages:
            calls = m.get("tool_calls") or []
            if len(calls) > 1:
                out.extend(
                    {**m, "content": m.get("content") if i == 0 else "", "tool_calls": [c]} for i, c in enumerate(calls)
                )
            else:
                out.append(m)
        return out, tools

    def grammar(self, tools, reply):
        return JsonCalls.grammar(self, replace(tools, parallel=False), reply)


@dataclass(frozen=True)
class MistralV3(JsonCalls):
    """Mistral v3 (7B v0.3, Nemo): `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`; its template refuses call
    ids that are not 9 alphanumerics, so every id is mapped to one (the same id always to the same one)."""

    name: str = "mistral"
    tag: Tag | None = Tag("[TOOL_CALLS]")

    def render(self, messages, tools):
        def nine(call_id: str | None) -> str | None:
            return None if call_id is None else hashlib.sha256(call_id.encode()).hexdigest()[:9]

        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": nine(c.get("id"))} for c in m["tool_calls"]]
            if m.get("tool_call_id") is not None:
                m["tool_call_id"] = nine(m["tool_call_id"])
            out.append(m)
        return out, tools


@dataclass(frozen=True)
class Phi4(JsonCalls):
    """Phi-4-mini: `functools[{"name": N, "arguments": {...}}, ...]` (vLLM's phi4mini tool parser). Its template
    takes the tools as a JSON string in the system message's `tools` key and has no rendering for past calls: they
    become the text the model wrote."""

    name: str = "phi4"
    opener: str = "functools"

    def render(self, messages, tools):
        out = [_calls_as_text(m, lambda calls: "functools" + json.dumps(calls, ensure_ascii=False)) for m in messages]
        if tools:
            listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "tools": listed}
            else:
                out.insert(0, {"role": "system", "content": "", "tools": listed})
        return out, None


@dataclass(frozen=True)
class Generic:
    """Any other template (or one without tool support): the tools described in a system message, the whole reply
    JSON — `{"tool_calls": [{"name": N, "arguments": {...}}, ...]}` or `{"response": TEXT}` — held to a schema,
    the history's calls and results rendered as text (llama-server's generic format).

    Attributes:
        system: the template has a system role (else the tools' description opens the first user message).
    """

    system: bool = True
    name: str = "generic"

    def render(self, messages, tools):
        out: list[dict] = []
        for m in messages:
            if m["role"] == "tool":
                text = json.dumps(
                    {"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m["content"]}},
                    ensure_ascii=False,
                )
                m = {"role": "user", "content": text}
            elif m["role"] == "assistant":  # as the model wrote it (plain text too, when it had the tools)
                m = _calls_as_text(
                    m,
                    lambda calls: json.dumps({"tool_calls": calls}, ensure_ascii=False),
                    plain=(lambda text: json.dumps({"response": text}, ensure_ascii=False)) if tools else None,
                )
            if out and out[-1]["role"] == m["role"] and m["role"] == "user":  # templates that need alternation
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            else:
                out.append(m)
        if tools:
            about = generic_instructions(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + about}
            elif self.system:
                out.insert(0, {"role": "system", "content": about})
            elif out:
                out[0] = {**out[0], "content": about + "\n\n" + out[0]["content"]}
        return out, None

    def grammar(self, tools, reply):
        calls = [call_schema(n, tools.parameters[n]) for n in tools.allowed]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not tools.parallel:
            array["maxItems"] = 1
        branches = {
            "calls": {
                "type": "object",
                "properties": {"tool_calls": array},
                "required": ["tool_calls"],
                "additionalProperties": False,
            },
            "response": {
                "type": "object",
                "properties": {"response": reply if reply is not None else {"type": "string"}},
                "required": ["response"],
                "additionalProperties": False,
            },
        }
        chosen = {"required": ["calls"], "none": ["response"]}.get(tools.mode, ["calls", "response"])
        schema = branches[chosen[0]] if len(chosen) == 1 else {"anyOf": [branches[c] for c in chosen]}
        return _lark([f"start: %json {json.dumps({**schema, 'x-guidance': INLINE}, ensure_ascii=False)}"])

    def parser(self, tools, output):
        return GenericParser(tools is not None)


def generic_instructions(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message that describes `tools` (OpenAI's tool dicts) and the JSON reply (llama-server's words,
    shortened)."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call any of the following tools to satisfy the user's requests:\n" + listed + "\n\n"
        'Respond in JSON format, either with {"tool_calls": [{"name": TOOL_NAME, "arguments": {...}}]} to call '
        'tools, or with {"response": "..."} to reply to the user.'
    )


def detect(template: str | None, tokenize: Tokenize | None = None, piece: Piece | None = None) -> ToolFormat:
    """The tool-call format of a chat template (its Jinja text; None: the model has none), by substrings (see the
    module docstring). `tokenize` (special tokens parsed) and `piece` find the markers that are special tokens."""
    t = template or ""
    if "<tool_call>" in t:
        return Hermes(detect_tags(tokenize, piece) if tokenize is not None and piece is not None else Tags())
    if "[TOOL_CALLS]" in t and "[ARGS]" not in t:
        return MistralV3(tag=find_tag("[TOOL_CALLS]", tokenize))
    if "<|start_header_id|>" in t and "ipython" in t:
        return Llama3(tag=find_tag("<|python_tag|>", tokenize))
    if "<|tool|>" in t:
        return Phi4()
    return Generic(system="System role not supported" not in t)  # Gemma 2's template raises on a system turn


# -- parsers ----------------------------------------------------------------------------------------------------------
_DECODER = json.JSONDecoder()


@dataclass
class _JsonParser(StreamingParser):
    """What the parsers below share: the reply's text accumulates in `_buf` (`_pos`: how far it is read), and calls
    are read as whole JSON objects (`reply.ReplyStream` holds calls until complete anyway). Without `tools`, the text
    passes through."""

    _pos: int = 0
    _mode: str = "start"

    def close(self, cut: bool = False) -> list[ReplyEvent]:
        """The last events; an unfinished call or value (possible only without a grammar) is given as text unless
        `cut` (the token limit ended the reply: then it is dropped)."""
        if not self.tools:
            return []
        out = self._drain(final=True)
        if self._mode in ("calls", "value") and not cut and self._buf[self._pos :]:
            out.append(Content(self._buf[self._pos :]))
        return out

    def _read_calls(self, key: str, *, many: bool = True) -> list[ReplyEvent]:
        """The calls complete in `_buf` from `_pos` (objects separated by "," and whitespace); `_mode` becomes
        "done" at the array's "]" (or after one call when not `many`)."""
        out: list[ReplyEvent] = []
        while self._mode == "calls":
            rest = self._buf[self._pos :]
            self._pos += len(rest) - len(rest.lstrip(" \n,"))
            if self._buf.startswith("]", self._pos):
                self._mode = "done"
                break
            try:
                obj, end = _DECODER.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                break  # not complete yet
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                out.extend(_call_events(self.calls, obj["name"], obj.get(key, {})))
            else:  # not a call (possible only without a grammar)
                out.append(Content(self._buf[self._pos : end]))
            self._pos = end
            if not many:
                self._mode = "done"
        return out


@dataclass
class JsonCallsParser(_JsonParser):
    """Splits a reply that is either text or calls written as JSON objects after one of `heads` (`JsonCalls.heads`:
    the marker, then `[{` or `{`). Text passes through once it cannot be such a start."""

    heads: tuple[str, ...] = ()
    key: str = "arguments"
    array: bool = True

    def _drain(self, *, final: bool) -> list[ReplyEvent]:
        if self._mode == "start":
            s = self._buf.lstrip()
            head = next((h for h in self.heads if s.startswith(h)), None)
            if head is None and not final and any(h.startswith(s) for h in self.heads):
                return []  # it may still become a call
            if head is None:
                self._mode = "text"
            else:
                self._mode, self._pos = "calls", len(self._buf) - len(s) + len(head) - 1  # at the first "{"
        if self._mode == "text":
            out: list[ReplyEvent] = [Content(self._buf[self._pos :])] if self._buf[self._pos :] else []
            self._pos = len(self._buf)
            return out
        return self._read_calls(self.key, many=self.array)


@dataclass
class GenericParser(_JsonParser):
    """Splits the generic format's JSON reply: `{"response": "..."}` streams the string's text as it is written (a
    response format's JSON value is given whole, as its text); `{"tool_calls": [...]}` gives each call when its
    object is complete. A reply that is not that JSON (possible only without a grammar) passes through as text."""

    _sent: str = ""  # the response text already given

    RESPONSE, STRING, CALLS = '{"response": ', '{"response": "', '{"tool_calls": ['

    def _drain(self, *, final: bool) -> list[ReplyEvent]:
        buf = self._buf
        if self._mode == "start":
            if not final and (self.STRING.startswith(buf) or self.CALLS.startswith(buf)):
                return []  # not decided yet
            if buf.startswith(self.STRING):
                self._mode, self._pos = "string", len(self.STRING) - 1
            elif buf.startswith(self.RESPONSE):
                self._mode, self._pos = "value", len(self.RESPONSE)
            elif buf.startswith(self.CALLS):
                self._mode, self._pos = "calls", len(self.CALLS)
            else:
                self._mode = "text"
        out: list[ReplyEvent] = []
        if self._mode == "text":
            if buf[self._pos :]:
                out.append(Content(buf[self._pos :]))
            self._pos = len(buf)
        elif self._mode == "string":
            text, closed = _partial_string(buf, self._pos)
            if text is not None and len(text) > len(self._sent):
                out.append(Content(text[len(self._sent) :]))
                self._sent = text
            if closed:
                self._mode, self._pos = "done", len(buf)
        elif self._mode == "value":
            try:
                _, end = _DECODER.raw_decode(buf, self._pos)
            except json.JSONDecodeError:
                return out
            out.append(Content(buf[self._pos : end]))
            self._mode = "done"
        return out + self._read_calls("arguments")


def _partial_string(buf: str, start: int) -> tuple[str | None, bool]:
    """The JSON string that opens at buf[start] ('"'), decoded as far as it is written: (text, closed)."""
    i, n = start + 1, len(buf)
    while i < n:
        c = buf[i]
        if c == "\\":
            step = 6 if buf.startswith("u", i + 1) else 2
            if i + step > n:
                break  # an escape not complete yet
            i += step
            continue
        if c == '"':
            return json.loads(buf[start : i + 1]), True
        i += 1
    try:
        return json.loads(buf[start:i] + '"'), False
    except json.JSONDecodeError:  # a lone surrogate half of a \\u pair: wait for the rest
        return None, False


def _call_events(calls: list[ParsedCall], name: str, arguments: Any) -> list[ReplyEvent]:
    """A complete call's events; its arguments as one-line JSON with ", " and ": " (as the grammar writes them)."""
    call = ParsedCall(len(calls), new_id("call"), name)
    call.arguments = json.dumps(arguments, ensure_ascii=False)
    calls.append(call)
    return [CallStart(call), Arguments(call.index, call.arguments), CallEnd(call.frozen(), call.index)]


# -- helpers ----------------------------------------------------------------------------------------------------------
def _call_schema(name: str, parameters: Mapping[str, Any], key: str) -> dict:
    """{"name": NAME, KEY: <parameters>}, in that order."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: dict(parameters)},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _text_rule(heads: Sequence[str]) -> str:
    """Free text that does not start like a call (llguidance's lexer is greedy: TEXT must die at a call's start for
    the call's own lexemes to take over)."""
    starts = "|".join(re.escape(h) for h in heads)
    return f"TEXT: /(?s:.*)/ & ~/\\s*({starts})(?s:.*)/"


def _lark(lines: list[str]) -> Grammar:
    try:
        return from_lark("%llguidance {}\n" + "\n".join(lines) + "\n", name="tools")
    except GrammarError as e:
        raise ApiError(400, str(e), param="tools") from None


def _calls_as_text(message: dict, calls_text: Callable[[list], str], plain: Callable[[str], str] | None = None) -> dict:
    """An assistant message whose `tool_calls` the template cannot render, with them written into its content as
    the model wrote them (`calls_text` of [{"name", "arguments"}]); `plain`: how a turn without calls is written."""
    if message["role"] != "assistant":
        return message
    calls = message.get("tool_calls")
    if not calls:
        return {**message, "content": plain(message["content"] or "")} if plain else message
    listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    lead = (message.get("content") or "").strip()
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (lead + "\n" if lead else "") + calls_text(listed)}
