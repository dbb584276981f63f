"""OpenAI's Chat Completions (`POST /v1/chat/completions`), translated: the wire body into a `request.Request`, the
reply's events into `chat.completion` JSON or `chat.completion.chunk` events.

Follows OpenAI's API reference as the official `openai` Python package parses it: the first chunk carries the role,
the last choice chunk the finish_reason (and specdec's statistics); with `stream_options.include_usage` every chunk
has `"usage": null` and one more chunk with `"choices": []` carries the usage; tool calls stream as OpenAI's
`delta.tool_calls` (a call's first delta carries its index, id, type and name, the next ones pieces of
`function.arguments`), as vLLM's Hermes tool parser streams them.

Every field of OpenAI's request is declared here and is what `fields.FIELDS` says: a field that changes what must come
back is implemented or refused with a 400 that names it (`fields.REFUSED`); one that only informs is used where the
model has room (a message's `name` and an assistant's `reasoning_content` and `chat_template_kwargs` and
`reasoning_effort` go to the chat template, a schema's `description` to a system-message line) and otherwise accepted
(`metadata`, `store`, `service_tier`, `cache_control`, labels); a field nobody here knows is accepted and ignored.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import Field

from specdec_cli.core.constraint import GrammarError, json_schema
from specdec_cli.server import reading
from specdec_cli.server.errors import ApiError, loads
from specdec_cli.server.fields import check_template_kwargs
from specdec_cli.server.http import Context
from specdec_cli.server.openai_base import (
    FINISH_REASONS,
    Generation,
    Open,
    OpenAIWriter,
    Strict,
    chat_logprobs,
    check_logprobs,
    generation_config,
    sse,
    usage_json,
)
from specdec_cli.server.reply import Arguments, CallStart, Content, End, PieceLogprob, ReplyEvent, ReplyStream, Sse
from specdec_cli.server.request import Message, Output, Request, Tool, ToolCall, ToolMode, Tools


# -- the wire format ------------------------------------------------------------------------------------------------
class TextPart(Strict):
    type: Literal["text"]
    text: str


class Prediction(Strict):
    """OpenAI predicted outputs: `{"type": "content", "content": "..."}` (or a list of text parts)."""

    type: Literal["content"]
    content: str | list[TextPart]


class ChatMessage(Open):
    """One message of any role; what each role may carry is checked in `messages_of` (a message of the wrong shape
    gets a 400 naming the field, e.g. `messages.2.tool_call_id`). Other fields (`cache_control`, vendor extras) are
    accepted and ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None  # an assistant's reasoning sent back (informs: to the template)


class ChatRequest(Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    prediction: Prediction | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0-20, checked in `to_request` (400 naming it)
    safety_identifier: str | None = None  # a label (accepted)
    prompt_cache_key: str | None = None  # a routing hint (accepted: the KV cache keeps common prefixes anyway)
    chat_template_kwargs: dict[str, Any] | None = None  # llama-server's and vLLM's: to the chat template
    reasoning_effort: str | None = None  # informs: to the chat template
    reasoning: dict[str, Any] | None = None  # {"effort": ...} (OpenRouter's, Responses' shape): as reasoning_effort
    # informs: accepted (`fields.FIELDS`)
    metadata: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    store: bool | None = None
    verbosity: Any = None
    # refused unless neutral (`fields.REFUSED`)
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    moderation: Any = None
    web_search_options: Any = None


# -- body → request -------------------------------------------------------------------------------------------------
def to_request(body: ChatRequest, ctx: Context) -> Request:
    """The internal `Request` for a Chat Completions body. Raises ApiError (400, naming the field) for what the
    server cannot honour or a malformed message, tool or response format."""
    if body.top_logprobs is not None:
        check_logprobs("top_logprobs", body.top_logprobs)
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    config = generation_config(body, ctx.defaults, ctx.n_ctx, max_tokens=body.max_completion_tokens, logprobs=logprobs)
    return Request(
        config=config,
        messages=messages_of(body),
        tools=tools_of(body),
        output=output_of(body.response_format),
        label="chat",
        template_kwargs=template_kwargs_of(body),
        prediction=reading.content_text(body.prediction.content, "prediction.content") if body.prediction else None,
    )


def template_kwargs_of(body: ChatRequest) -> dict[str, Any]:
    """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` (or `reasoning.effort`)
    as llama-server passes it. Raises ApiError (400) for a variable the template's caller sets itself."""
    kwargs = check_template_kwargs(body.chat_template_kwargs, "chat_template_kwargs")
    effort = body.reasoning_effort or (body.reasoning or {}).get("effort")
    if isinstance(effort, str) and "reasoning_effort" not in kwargs:
        kwargs["reasoning_effort"] = effort
    return kwargs


def messages_of(body: ChatRequest) -> tuple[Message, ...]:
    """The conversation: text content; `developer` (OpenAI's newer name) → `system`; an assistant's `tool_calls`
    checked (functions whose arguments are a JSON object); `tool` messages with their `tool_call_id`.

    A message's `name` and an assistant's `reasoning_content` are kept (the template gets them).

    Raises ApiError (400) naming the field: parts other than text, a tool message without `tool_call_id`, tool calls
    that are not functions or whose arguments are not a JSON object, the deprecated `function` role, fields a role does
    not take.
    """
    out = []
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if m.role == "function":
            raise ApiError(
                400,
                f"{where}.role 'function' is OpenAI's deprecated form of 'tool' messages: send role "
                "'tool' with tool_call_id.",
                param=f"{where}.role",
            )
        for field_, allowed in (
            ("tool_calls", {"assistant"}),
            ("tool_call_id", {"tool"}),
            ("refusal", {"assistant"}),
            ("audio", set()),
            ("function_call", set()),
        ):
            if getattr(m, field_) is not None and m.role not in allowed:
                hint = "; send tool_calls" if field_ == "function_call" else ""
                raise ApiError(
                    400, f"{where}.{field_} is not supported on a {m.role} message{hint}.", param=f"{where}.{field_}"
                )
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(
                    400,
                    f"{where}: a tool message needs tool_call_id (the id of the call it answers).",
                    param=f"{where}.tool_call_id",
                )
            out.append(
                Message(
                    "tool",
                    reading.content_text(m.content, f"{where}.content"),
                    name=m.name,
                    tool_call_id=m.tool_call_id,
                )
            )
        elif m.role == "assistant":
            text = reading.content_text(m.content, f"{where}.content", refusal_ok=True)
            if m.refusal:
                text = text or m.refusal
            calls = tuple(_tool_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(m.tool_calls or ()))
            out.append(Message("assistant", text, name=m.name, tool_calls=calls, reasoning=m.reasoning_content))
        else:
            out.append(
                Message(
                    "system" if m.role == "developer" else m.role,
                    reading.content_text(m.content, f"{where}.content"),
                    name=m.name,
                )
            )
    return tuple(out)


def _tool_call(call: Any, where: str) -> ToolCall:
    """An assistant's past tool call ({"id", "type": "function", "function": {"name", "arguments"}}), checked."""
    if (
        not isinstance(call, dict)
        or call.get("type", "function") != "function"
        or not isinstance(call.get("function"), dict)
    ):
        raise ApiError(
            400,
            f'{where} is not a function call ({{"id", "type": "function", "function": {{"name", "arguments"}}}}).',
            param=where,
        )
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name is missing.", param=f"{where}.function.name")
    try:
        args = loads(arguments, f"{where}.function.arguments") if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise ApiError(
            400,
            f"{where}.function.arguments is not JSON ({e.msg} at character {e.pos}).",
            param=f"{where}.function.arguments",
        ) from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object.", param=f"{where}.function.arguments")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(str(call.get("id") or ""), name, text)


def tools_of(body: ChatRequest) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools (`check_tools`)."""
    return check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)


def check_tools(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None) -> Tools | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools.

    Raises:
        ApiError (400) naming the field (`param`): a tool that is not a function, a bad or repeated name, parameters
        that are not a JSON schema llguidance can compile (the message says where), a `tool_choice` naming a tool
        that is not there, `tool_choice` without `tools`.
    """
    if not tools:
        if tools is not None:
            raise ApiError(400, "tools is an empty list: send at least one tool, or leave tools out.", param="tools")
        if tool_choice is not None and tool_choice != "none":
            raise ApiError(400, "tool_choice is only allowed when tools are given.", param="tool_choice")
        return None
    specs: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise ApiError(
                400,
                f"{where}.type is {kind!r}: specdec serve calls tools of type 'function' only.",
                param=f"{where}.type",
            )
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise ApiError(400, f"{where} has unknown fields: {', '.join(sorted(unknown))}.", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function is missing.", param=f"{where}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ApiError(
                400, f"{where}.function has unknown fields: {', '.join(sorted(unknown))}.", param=f"{where}.function"
            )
        specs.append(
            reading.function_tool(
                f"{where}.function",
                fn.get("name"),
                fn.get("description"),
                fn.get("parameters"),
                strict=fn.get("strict"),
                taken=[t.name for t in specs],
                noun="function",
            )
        )
    mode, named = _choice(tool_choice)
    # a named function is called once (as OpenAI answers a forced function; instructor and others read one call)
    single = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    out = reading.choose(specs, mode, named, parallel=parallel_tool_calls is not False and not single)
    if parallel_tool_calls not in (None, True, False):
        raise ApiError(400, "parallel_tool_calls is not a boolean.", param="parallel_tool_calls")
    return out


_TOOL_CHOICES = (  # what `_choice` reads, for its error
    """'auto', 'none', 'required', {"type": "function", "function": {"name": ...}} or {"type": "allowed_tools", ...}"""
)


def _choice(tool_choice: Any) -> tuple[ToolMode, list[reading.Named] | None]:
    """(mode, the functions it names: None for all) of OpenAI's `tool_choice`; `reading.choose` checks the names."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        return "required", [reading.Named(name, "tool_choice", "tool_choice.function.name", "function")]
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        spec = tool_choice.get("allowed_tools") or {}
        mode = reading.allowed_tools_mode(spec.get("mode"), "tool_choice.allowed_tools.mode")
        allowed = []
        for i, tool in enumerate(spec.get("tools") or ()):
            name = ((tool or {}).get("function") or {}).get("name") if isinstance(tool, dict) else None
            where = f"tool_choice.allowed_tools.tools.{i}"
            allowed.append(reading.Named(name, where, where, "function"))
        if not allowed:
            raise ApiError(400, "tool_choice.allowed_tools.tools is empty.", param="tool_choice.allowed_tools.tools")
        return mode, allowed
    raise ApiError(
        400, f"tool_choice {json.dumps(tool_choice)[:80]} is not one of {_TOOL_CHOICES}.", param="tool_choice"
    )


def output_of(response_format: dict | None) -> Output | None:
    """The constraint OpenAI's `response_format` puts on the reply; None for text.

    `{"type": "text"}`: free text. `{"type": "json_object"}`: any JSON object. `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}`: JSON valid against `schema` (always enforced,
    `strict` or not; `description` informs: the service shows it to the model in a system-message line). Other
    fields are accepted and ignored.

    Raises ApiError (400, `param` "response_format..."): an unknown type, a bad name, a schema llguidance cannot
    compile (the message says where).
    """
    return reading.json_output(response_format, "response_format", _json_schema_output)


def _json_schema_output(response_format: dict) -> Output:
    """`response_format` of type json_schema: its `json_schema` object, checked, as an `Output`."""
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(
            400,
            'response_format of type \'json_schema\' needs json_schema: {"name", "schema", "strict", "description"}.',
            param="response_format.json_schema",
        )
    name = reading.format_name(spec.get("name"), "response_format.json_schema.name")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(
            400,
            "response_format.json_schema.description is not a string.",
            param="response_format.json_schema.description",
        )
    if spec.get("strict") not in (None, True, False):
        raise ApiError(
            400, "response_format.json_schema.strict is not a boolean.", param="response_format.json_schema.strict"
        )
    schema = spec.get("schema", {})
    try:
        return Output(schema, json_schema(schema, name="response_format"), name=name, description=description)
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format") from None


# -- reply → wire -----------------------------------------------------------------------------------------------------
class ChatWriter(OpenAIWriter):
    """`chat.completion` JSON, or the `chat.completion.chunk` stream, of one reply (a `reply.Writer`; the arguments
    are `openai_base.OpenAIWriter`'s: with `logprobs`, `logprobs.content` is a list, else null)."""

    ID_PREFIX = "chatcmpl"
    CHUNK_OBJECT = "chat.completion.chunk"

    # -- a whole response
    def body(self, reply: ReplyStream) -> dict:
        end = reply.end
        assert end is not None  # a whole response is written once the reply is done
        msg: dict = {
            "role": "assistant",
            "content": None if reply.calls and not reply.content else reply.content,
            "refusal": None,
        }
        if reply.calls:
            msg["tool_calls"] = [_call_json(c) for c in reply.calls]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "logprobs": self._logprobs(reply.logprobs),
                    "finish_reason": finish_reason(end),
                }
            ],
            "usage": usage_json(end.stats),
            "specdec": end.stats.specdec(self.method),
        }

    # -- a stream
    def opening(self) -> list[Sse]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def events(self, event: ReplyEvent) -> list[Sse]:
        if isinstance(event, Content):
            if not event.text and not (self.want_logprobs and event.logprobs):
                return []
            delta = {"content": event.text} if event.text else {}
            return [self._chunk(delta, self._logprobs(event.logprobs) if event.logprobs else None)]
        if isinstance(event, CallStart):
            c = event.call
            return [
                self._chunk(
                    {
                        "tool_calls": [
                            {
                                "index": c.index,
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.name, "arguments": ""},
                            }
                        ]
                    }
                )
            ]
        if isinstance(event, Arguments):
            return [self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})]
        if isinstance(event, End):
            return [
                self._chunk({}, finish=finish_reason(event), specdec=event.stats.specdec(self.method))
            ] + self._usage(event.stats)
        return []  # CallEnd: nothing of its own in this format

    def _chunk(self, delta: dict, logprobs: dict | None = None, *, finish: str | None = None, **extra) -> Sse:
        return sse(
            {
                **self._base(),
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }
        )

    def _logprobs(self, entries: list[PieceLogprob] | tuple[PieceLogprob, ...]) -> dict | None:
        return {"content": chat_logprobs(entries), "refusal": None} if self.want_logprobs else None


def finish_reason(end: End) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the reply ended (not cut short) after calling tools."""
    return "tool_calls" if end.tool_calls else FINISH_REASONS.get(end.finish)


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# -- the route --------------------------------------------------------------------------------------------------------
def routes(app: FastAPI, ctx: Context) -> None:
    """Mount `POST /v1/chat/completions`."""

    @app.post("/v1/chat/completions", dependencies=ctx.auth)
    async def chat_completions(body: ChatRequest, http: HttpRequest) -> Response:
        request = await asyncio.to_thread(to_request, body, ctx)  # tools' schemas compile off the event loop
        ctx.ignore(http.url.path, body)
        writer = ChatWriter(
            ctx.model_id,
            ctx.method,
            logprobs=request.config.logprobs is not None,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        return await ctx.respond(http, request, writer, stream=bool(body.stream))
