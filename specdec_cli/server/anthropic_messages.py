"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), translated: the wire body into a
`request.Request`, the reply's events into Anthropic's `message` JSON or its server-sent events.

Follows Anthropic's API reference (Messages, Count tokens, Streaming Messages, Errors) as the official `anthropic`
Python package parses it (`types/message.py`, `raw_message_stream_event.py`, `usage.py`, `message_delta_usage.py`),
and what Claude Code 2.1 sends (captured with `clients/agent_capture.py claude`). Claude Code adds `?beta=true`
to both paths and probes `HEAD /`; both are answered.

Request → `Request`:
- `system` (a string or text blocks) is the first system message; `cache_control` is accepted (prefix caching is
  automatic). A text block that starts with `x-anthropic-billing-header:` (Claude Code's per-prompt stamp) is left
  out of the prompt, so one agent's system prompt is the same token prefix in every session; llama-server rewrites
  the stamp's `cch=` for the same reason. A `role: "system"` message inside `messages` (Claude Code's
  mid-conversation-system beta, sent for model names it does not know) is folded into the system prompt: chat
  templates take one system message, first.
- `messages`: text blocks become the turn's text (joined with newlines); an assistant's `tool_use` blocks its tool
  calls (`input` as JSON text); a user's `tool_result` blocks tool messages (string or text blocks; an image inside
  one becomes a placeholder line; `is_error` prefixes "Error: "); `thinking` blocks sent back become the assistant's
  `reasoning`; `redacted_thinking` is accepted and left out. Image and document blocks elsewhere are refused (400):
  this server reads text.
- `tools`: client tools (`input_schema`) are offered through the chat template; keywords of their schemas that
  llguidance does not implement (Claude Code's `propertyNames`) are accepted and not enforced. Server tools
  (`web_search_20250305`, `code_execution_...`, any `type` but "custom") are left out of the prompt with one server
  log line, never a 400 (a local server cannot run them; llama-server and Ollama skip them too).
- `tool_choice`: auto → auto, any → required, tool → required of that tool, none → none;
  `disable_parallel_tool_use` → one call.
- `max_tokens`, `stop_sequences` (the one that ended the reply is named in `stop_sequence`), `temperature`,
  `top_p`, `top_k`. A request that leaves temperature out gets the server's `--temperature` (default 0: greedy,
  where speculation pays most), not Anthropic's default of 1.0: the same rule as every dialect of this server, and
  Claude Code never sends one.
- `output_config.format` (`{"type": "json_schema", "schema"}`, also the older top-level `output_format`):
  the reply's text is JSON valid against the schema (`request.Output`).
- Accepted, changing nothing: `model` (any name: this server serves one model), `metadata`, `service_tier`,
  `container`, `thinking` (the served model writes no thinking blocks unless its template does), `context_management`,
  `output_config.effort`, `anthropic-version`, `anthropic-beta`, unknown fields. Refused: a non-empty `mcp_servers`
  (their tools would change the reply; this server cannot reach them).

Reply → wire: content blocks `text` and `tool_use` (ids `toolu_...`), `stop_reason` end_turn / max_tokens /
stop_sequence / tool_use, `usage` with `input_tokens` (evaluated), `cache_read_input_tokens` (reused from the KV or
prompt cache) and `output_tokens`; streamed as `message_start`, `ping`, per block `content_block_start` /
`content_block_delta` (`text_delta`, `input_json_delta`) / `content_block_stop`, `message_delta` (stop reason and
usage), `message_stop`. specdec's statistics ride in `specdec` on the message and on `message_delta`.

Errors on these paths (400 for a bad field, validation, 401, 404, 405, 413, 429, 5xx) are Anthropic's JSON:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`; mid-stream, an `error` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from specdec_cli.core.constraint import GrammarError, json_schema
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.server.errors import ApiError, to_api_error
from specdec_cli.server.http import Context
from specdec_cli.server.jobs import Started
from specdec_cli.server.reading import MISSING, Named, choose, function_tool
from specdec_cli.server.reply import (
    Arguments,
    CallEnd,
    CallStart,
    Content,
    End,
    ReplyEvent,
    ReplyStream,
    Sse,
    new_id,
)
from specdec_cli.server.request import (
    ANTHROPIC,
    Message,
    Output,
    Request,
    SamplingValues,
    Tool,
    ToolCall,
    ToolMode,
    Tools,
)

PATH = "/v1/messages"
BILLING = "x-anthropic-billing-header:"  # Claude Code's per-prompt stamp, the first system block
IMAGE_IN_RESULT = "[an image was here: this model reads text only]"

# HTTP status → Anthropic's error type (docs: Errors); others: invalid_request_error below 500, api_error from 500
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


# -- the wire format ------------------------------------------------------------------------------------------------
class Open(BaseModel):
    """A wire model that accepts fields it does not declare (Anthropic's API grows; clients send betas' fields)."""

    model_config = ConfigDict(extra="allow")


class InputMessage(Open):
    """One message: content is a string or a list of content blocks (checked in `messages_of`, which names the
    block of a 400, e.g. `messages.2.content.0.type`)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class Counted(Open):
    """The fields `/v1/messages/count_tokens` takes (they render the prompt)."""

    model: str
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted (see the module docstring)
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None  # refused when not empty
    context_management: dict[str, Any] | None = None  # accepted


class MessagesRequest(Counted):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # accepted
    service_tier: str | None = None  # accepted
    container: str | dict[str, Any] | None = None  # accepted


# -- wire → Request ---------------------------------------------------------------------------------------------------
def to_request(body: Counted, ctx: Context, *, label: str = "messages") -> Request:
    """The internal `Request` of a Messages (or count_tokens) body.

    Raises ApiError (400, `param` naming the field): a block this server cannot read, a bad tool or tool_choice, a
    schema llguidance cannot compile, non-empty `mcp_servers`, an empty stop sequence.
    """
    if body.mcp_servers:
        raise ApiError(
            400,
            "mcp_servers: specdec serve does not connect to MCP servers (their tools would change "
            "the reply). Run the MCP client on your side and send its tools as tools.",
            param="mcp_servers",
        )
    messages = messages_of(body.system, body.messages)
    tools = tools_of(body.tools, body.tool_choice, log=ctx.worker.log)
    output = output_of(body.output_config, body.output_format)
    if isinstance(body, MessagesRequest):
        stop = tuple(body.stop_sequences or ())
        if any(s == "" for s in stop):
            raise ApiError(400, "stop_sequences contains an empty string.", param="stop_sequences")
        limit = ctx.defaults.limit(body.max_tokens, ctx.n_ctx)
        sampling = ctx.defaults.sampling(
            ANTHROPIC, SamplingValues(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
        )
        config = GenerationConfig(max_tokens=limit, stop=stop, sampling=sampling)
    else:
        config = GenerationConfig(max_tokens=1)
    return Request(config=config, messages=messages, tools=tools, output=output, label=label)


def messages_of(system: str | list[dict] | None, messages: list[InputMessage]) -> tuple[Message, ...]:
    """The conversation: the system prompt (with any `role: "system"` messages folded in) first, then the turns."""
    system_texts = [] if system is None else [_system_text(system)]
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        if m.role == "system":
            system_texts.append(m.content if isinstance(m.content, str) else _texts(m.content, where))
        elif m.role == "user":
            out.extend(_user_turn(m.content, where))
        else:
            out.append(_assistant_turn(m.content, where))
    prompt = "\n\n".join(t for t in system_texts if t)
    return ((Message("system", prompt),) if prompt else ()) + tuple(out)


def _system_text(system: str | list[dict]) -> str:
    if isinstance(system, str):
        return system
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(
                400, f'system.{i} is not a text block ({{"type": "text", "text": ...}}).', param=f"system.{i}"
            )
    return "\n".join(b["text"] for b in system if not b["text"].startswith(BILLING))


def _texts(blocks: list[dict], where: str) -> str:
    """The text of a list that may hold only text blocks."""
    out = []
    for at, kind, block in _blocks(blocks, where):
        if kind != "text":
            raise ApiError(400, f"{at} is a {kind} block; only text blocks are allowed here.", param=f"{at}.type")
        out.append(_text_of(block, at))
    return "\n".join(out)


def _user_turn(content: str | list[dict], where: str) -> list[Message]:
    """A user message: its tool results as tool messages, its text as user messages, in block order."""
    if isinstance(content, str):
        return [Message("user", content)]
    out: list[Message] = []
    text: list[str] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            text.append(_text_of(block, at))
        elif kind == "tool_result":
            if text:
                out.append(Message("user", "\n".join(text)))
                text = []
            out.append(_tool_result(block, at))
        elif kind in ("image", "document", "search_result"):
            raise ApiError(
                400, f"{at} is a {kind} block: this model reads text only. Send text blocks.", param=f"{at}.type"
            )
        else:
            raise ApiError(
                400,
                f"{at} is a {kind!r} block, which a user message cannot hold here (text, tool_result).",
                param=f"{at}.type",
            )
    if text or not out:
        out.append(Message("user", "\n".join(text)))
    return out


def _tool_result(block: dict, where: str) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(400, f"{where}.tool_use_id is missing.", param=f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = _kind(part, f"{where}.content.{k}")
            if kind == "text":
                parts.append(_text_of(part, f"{where}.content.{k}"))
            elif kind in ("image", "document"):
                parts.append(IMAGE_IN_RESULT)
            else:
                raise ApiError(
                    400,
                    f"{where}.content.{k} is a {kind!r} block; a tool result holds text.",
                    param=f"{where}.content.{k}.type",
                )
        text = "\n".join(parts)
    elif content is None:
        text = ""
    else:
        raise ApiError(400, f"{where}.content is neither a string nor a list of blocks.", param=f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return Message("tool", text, tool_call_id=call_id)


def _assistant_turn(content: str | list[dict], where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    text, calls, reasoning = [], [], []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            text.append(_text_of(block, at))
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise ApiError(400, f"{at}.name is missing.", param=f"{at}.name")
            if not isinstance(args, dict):
                raise ApiError(400, f"{at}.input is not an object.", param=f"{at}.input")
            calls.append(ToolCall(str(block.get("id") or ""), name, json.dumps(args, ensure_ascii=False)))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        else:
            raise ApiError(
                400,
                f"{at} is a {kind!r} block, which an assistant message cannot hold here (text, "
                "tool_use, thinking, redacted_thinking).",
                param=f"{at}.type",
            )
    return Message(
        "assistant", "\n".join(text), tool_calls=tuple(calls), reasoning="\n".join(reasoning) if reasoning else None
    )


def _blocks(content: list, where: str) -> Iterator[tuple[str, str, dict]]:
    """(its place, e.g. "messages.2.content.0", its type, the block) of each content block; 400 for one that is not
    a block."""
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        yield at, _kind(block, at), block


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ApiError(400, f"{where} is not a content block (an object with a type).", param=where)
    return block["type"]


def _text_of(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise ApiError(400, f"{where}.text is missing.", param=f"{where}.text")
    return block["text"]


def tools_of(tools: list[dict] | None, tool_choice: dict | None, *, log=print) -> Tools | None:
    """Anthropic's `tools` and `tool_choice`, checked; None without (client) tools. Server tools are left out, with
    one `log` line naming them.

    Raises ApiError (400, naming the field): a client tool without a valid name or `input_schema`, a repeated name,
    a schema llguidance cannot compile, a `tool_choice` of unknown type or naming a tool that is not there.
    """
    specs: list[Tool] = []
    skipped: list[str] = []
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where} is not a tool object.", param=where)
        kind = tool.get("type")
        if kind not in (None, "custom"):  # web_search_20250305, bash_20250124, code_execution_..., mcp_toolset, ...
            skipped.append(f"{tool.get('name', '?')} ({kind})")
            continue
        specs.append(
            function_tool(
                where,
                tool.get("name"),
                tool.get("description"),
                tool.get("input_schema", MISSING),
                taken=[t.name for t in specs],
                schema="input_schema",
                lenient=True,
            )
        )
    if skipped:
        log(f"messages: server tools left out of the prompt (a local server cannot run them): {', '.join(skipped)}")
    if not specs:
        if tool_choice is not None and tool_choice.get("type") not in ("auto", "none"):
            raise ApiError(
                400, "tool_choice asks for a tool call, but no (client) tools are given.", param="tool_choice"
            )
        return None
    choice = tool_choice or {"type": "auto"}
    kind = choice.get("type")
    named = None
    mode: ToolMode
    if kind == "auto":
        mode = "auto"
    elif kind == "any":
        mode = "required"
    elif kind == "none":
        mode = "none"
    elif kind == "tool":
        mode, named = "required", [Named(choice.get("name"), "tool_choice", "tool_choice.name")]
    else:
        raise ApiError(
            400, f"tool_choice.type {kind!r} is not one of 'auto', 'any', 'tool', 'none'.", param="tool_choice.type"
        )
    single = choice.get("disable_parallel_tool_use") is True or kind == "tool"
    return choose(specs, mode, named, parallel=not single)


def output_of(output_config: dict | None, output_format: dict | None) -> Output | None:
    """The JSON schema `output_config.format` (or the older top-level `output_format`) puts on the reply's text.

    Raises ApiError (400): a format that is not `{"type": "json_schema", "schema": {...}}`, a schema llguidance
    cannot compile (the message says where).
    """
    fmt, param = (output_config or {}).get("format"), "output_config.format"
    if fmt is None and output_format is not None:
        fmt, param = output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, f'{param} is not {{"type": "json_schema", "schema": {{...}}}}.', param=param)
    try:
        return Output(fmt["schema"], json_schema(fmt["schema"], name=param))
    except GrammarError as e:
        raise ApiError(400, str(e), param=f"{param}.schema") from None


# -- reply → wire -----------------------------------------------------------------------------------------------------
def stop_reason(end: End) -> str:
    """Anthropic's stop_reason: tool_use (the reply called tools), stop_sequence, max_tokens (the budget or the
    context window), else end_turn."""
    if end.tool_calls:
        return "tool_use"
    return {"stop": "stop_sequence", "length": "max_tokens", "context": "max_tokens"}.get(end.finish, "end_turn")


def usage_json(n_prompt: int, n_cached: int, n_output: int) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens evaluated, `cache_read_input_tokens` those reused
    from the KV or prompt cache (their sum is the prompt), `cache_creation_input_tokens` 0 (caching is automatic)."""
    return {
        "input_tokens": n_prompt - n_cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": n_cached,
        "output_tokens": n_output,
    }


def _end_usage(end: End) -> dict:
    r = end.stats.run
    return usage_json(r.n_prompt, r.n_cached, r.n_generated)


def tool_use_id(call_id: str) -> str:
    """The reply parser's "call_<hex>" as Anthropic's "toolu_<hex>"."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A call's arguments as its `input` object ({} when cut short before they were complete JSON)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageWriter:
    """Anthropic's `message` JSON, or its event stream, of one reply (a `reply.Writer`).

    Args:
        model: the model name the response carries (the request's). method: the drafter (specdec's statistics).
    """

    def __init__(self, model: str, method: str) -> None:
        self.id = new_id("msg")
        self.model, self.method = model, method
        self.started = Started(0)
        self._index = -1  # the content block being streamed
        self._open: str | None = None  # its type, while open

    def start(self, started: Started) -> None:
        """The prompt's numbers, for `message_start` (`Context.respond`'s on_start)."""
        self.started = started

    # -- a whole response
    def body(self, reply: ReplyStream) -> dict:
        end = reply.end
        assert end is not None  # a whole response is written once the reply is done
        content: list[dict] = []
        if reply.content:
            content.append({"type": "text", "text": reply.content})
        content += [
            {"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": _input(c.arguments)}
            for c in reply.calls
        ]
        return {
            **self._message(content, stop_reason(end), end.stats.run.stop),
            "usage": _end_usage(end),
            "specdec": end.stats.specdec(self.method),
        }

    def _message(self, content: list, reason: str | None, stop: str | None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop if reason == "stop_sequence" else None,
        }

    # -- a stream
    def opening(self) -> list[Sse]:
        s = self.started
        message = {**self._message([], None, None), "usage": usage_json(s.n_prompt, s.n_cached, 0)}
        return [_event("message_start", {"message": message}), _event("ping", {})]

    def events(self, event: ReplyEvent) -> list[Sse]:
        if isinstance(event, Content):
            if not event.text:
                return []
            out = [] if self._open == "text" else self._begin({"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStart):
            c = event.call
            return self._begin({"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": {}})
        if isinstance(event, Arguments):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        if isinstance(event, CallEnd):
            return self._close()
        if isinstance(event, End):
            reason = stop_reason(event)
            stop = event.stats.run.stop if reason == "stop_sequence" else None
            return self._close() + [
                _event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": stop},
                        "usage": _end_usage(event),
                        "specdec": event.stats.specdec(self.method),
                    },
                )
            ]
        return []

    def closing(self) -> list[Sse]:
        return [_event("message_stop", {})]

    def failure(self, error: ApiError) -> list[Sse]:
        return [_event("error", error_body(error))]

    def _begin(self, block: dict) -> list[Sse]:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + [_event("content_block_start", {"index": self._index, "content_block": block})]

    def _delta(self, delta: dict) -> Sse:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> list[Sse]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._index})]


def _event(kind: str, data: dict) -> Sse:
    return {"event": kind, "data": json.dumps({"type": kind, **data}, ensure_ascii=False)}


def error_body(error: ApiError) -> dict:
    """Anthropic's error JSON: {"type": "error", "error": {"type", "message"}}, the type from the HTTP status."""
    kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# -- the routes -------------------------------------------------------------------------------------------------------
def routes(app: FastAPI, ctx: Context) -> None:
    """Mount `POST /v1/messages`, `POST /v1/messages/count_tokens` (query strings such as `?beta=true` ignored) and
    `HEAD /` (Claude Code's probe); register Anthropic's error JSON for every path under /v1/messages."""
    ctx.register_errors(PATH, error_body)

    @app.post(PATH, dependencies=ctx.auth)
    async def messages(body: MessagesRequest, http: HttpRequest) -> Response:
        request = await asyncio.to_thread(to_request, body, ctx)  # tools' schemas compile off the event loop
        writer = MessageWriter(body.model, ctx.method)
        return await ctx.respond(http, request, writer, stream=bool(body.stream), on_start=writer.start)

    @app.post(f"{PATH}/count_tokens", dependencies=ctx.auth)
    async def count_tokens(body: Counted) -> dict:
        """{"input_tokens": n}: the prompt's tokens through the chat template, tools included (rendered and
        tokenized on a thread of its own, apart from the model's context: it never waits for a generation)."""
        request = await asyncio.to_thread(to_request, body, ctx, label="count_tokens")
        try:
            n = len(await asyncio.to_thread(ctx.service.prompt_tokens, request))
        except Exception as e:
            raise to_api_error(e, param="messages") from None
        ctx.worker.log(f"count_tokens: {n} prompt tokens")
        return {"input_tokens": n}

    @app.head("/")
    async def probe() -> Response:
        return JSONResponse({})
