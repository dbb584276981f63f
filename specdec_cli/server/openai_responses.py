"""OpenAI's Responses API (`POST /v1/responses`), translated: the wire body into a `request.Request`, the reply's events
into the `response` object or its stream of typed events. What Codex CLI, openai-agents and the openai client's
`responses.create` / `responses.stream` / `responses.parse` speak.

Follows OpenAI's API reference as the official `openai` Python package parses it (`types/responses/`:
`response_create_params.py`, `response.py`, `response_stream_event.py`), checked against what Codex CLI 0.169,
openai-agents 0.24 and openai 3.57 send and need back (captured with `clients/agent_capture.py`). Shaped after
llama-server's `server_chat_convert_responses_to_chatcmpl` (a Responses body becomes one chat conversation) and its
`to_json_oaicompat_resp[_stream]` (the same results written back as Responses events).

In: `input` as a string or items — messages of any role (`developer` and `system` are system turns; consecutive
system turns are joined, so every chat template takes them), `function_call` / `custom_tool_call` items (merged into
the assistant turn before them, as llama-server does), their `*_output` items (tool turns), `reasoning` items (left
out of the prompt: the model reasons in its own text or not at all), `item_reference` to an item of a held response;
`instructions` (the first system turn); function tools in the flat format, `namespace` tools flattened (a call names
its namespace again on the way out: Codex needs it), `custom` tools (free-form input held to their Lark or regex
grammar: `custom_tools`); hosted tools a local server cannot run (`web_search`, `file_search`, ...) are left out of
the prompt, said so once in the server log, never a 400.

Out: a `message` item for the reply's text, a `function_call` or `custom_tool_call` item per call, `usage` with
`input_tokens_details.cached_tokens` (the prompt tokens found in the KV cache), `status` "incomplete" with
`incomplete_details.reason` "max_output_tokens" when a limit cut the reply, and specdec's statistics (`specdec`).
Streamed: response.created, response.in_progress, then per item response.output_item.added, its content
(response.content_part.added, response.output_text.delta..., response.output_text.done, response.content_part.done;
or response.function_call_arguments.delta... / .done; or response.custom_tool_call_input.delta... / .done),
response.output_item.done, and last response.completed (or response.incomplete), every event with its
`sequence_number`; a failure after the stream began is response.failed.

State: `previous_response_id` continues a response this process still holds (`ResponseStore`: the last
`STORE_SIZE` responses created with `store` not false, their input and output items); anything else is a 400 that
says so. Field policy (STYLE.md, habit 12): a field that changes what comes back is implemented or refused with a 400
naming it (`background`, `conversation`, `prompt`, a `tool_choice` forcing a hosted tool); fields that only inform are
accepted: `store`, `include` (only "message.output_text.logprobs" changes the output, and is implemented),
`reasoning`, `text.verbosity`, `prompt_cache_key`, `prompt_cache_retention`, `client_metadata`, `metadata`,
`service_tier`, `truncation`, `user`, `safety_identifier`, `max_tool_calls` (it bounds hosted tool calls, of which
there are none), `context_management`, and unknown vendor extras.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from specdec_cli.core.constraint import GrammarError, json_schema
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.server.custom_tools import custom_tool, input_grammar
from specdec_cli.server.errors import ApiError, loads
from specdec_cli.server.http import Context
from specdec_cli.server.openai_base import (
    Sampling,
    chat_logprobs,
    check_logprobs,
)
from specdec_cli.server.reading import (
    Named,
    allowed_tools_mode,
    choose,
    content_text,
    format_name,
    function_tool,
    json_output,
    tool_name,
)
from specdec_cli.server.reply import (
    Arguments,
    CallEnd,
    CallStart,
    Content,
    End,
    PieceLogprob,
    ReplyEvent,
    ReplyStream,
    Sse,
    new_id,
)
from specdec_cli.server.request import OPENAI, Message, Output, Request, SamplingValues, Tool, ToolCall, ToolMode, Tools
from specdec_cli.server.tools import NAME

STORE_SIZE = 64  # responses held for previous_response_id
ID_DIGITS = 32  # hex digits of a Responses id after its prefix (resp_, msg_, fc_, ctc_)
LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the text's log-probabilities
CALL_ITEMS = {
    "function_call": ("fc", "arguments", "response.function_call_arguments"),
    "custom_tool_call": ("ctc", "input", "response.custom_tool_call_input"),
}
"""A call item's type → its id prefix, the field its text streams into, and the prefix of its stream events."""
# tool types a local server cannot run: left out of the prompt (logged once), never a 400
HOSTED = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer",
    "computer_use",
    "computer_use_preview",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "programmatic_tool_calling",
)
# input items of hosted tools' calls: they cannot be replayed to the model here (left out, logged once)
HOSTED_ITEMS = (
    "web_search_call",
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "code_interpreter_call",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "tool_search_call",
    "tool_search_output",
    "additional_tools",
    "compaction",
    "program",
    "program_output",
)
SYSTEM_ROLES = ("system", "developer")


# -- the wire format ------------------------------------------------------------------------------------------------
class TextConfig(BaseModel):
    """`text`: the reply's format (`format`: text, json_object, json_schema) and `verbosity` (a hint: informs)."""

    model_config = ConfigDict(extra="allow")
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(Sampling):
    """The body of `POST /v1/responses` (openai-python `ResponseCreateParams`; temperature, top_p, top_k, min_p, seed
    from `openai_base.Sampling`). Unknown fields (vendor extras such as Codex's `client_metadata`) are accepted and
    ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None  # 0-20, with include "message.output_text.logprobs"
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    include: list[str] | None = None
    # inform only (accepted)
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # change what comes back and need state or services specdec serve does not have: refused unless neutral
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


# field -> (neutral values, why it is refused otherwise)
REFUSED: dict[str, tuple[tuple, str]] = {
    "background": ((False,), "specdec serve answers while you wait; it has no background responses to poll"),
    "conversation": ((), "specdec serve keeps no conversations; send the items as input (or previous_response_id)"),
    "prompt": ((), "specdec serve has no stored prompt templates; send the prompt as input and instructions"),
}


# -- the response store ---------------------------------------------------------------------------------------------
@dataclass
class Held:
    """A response this process holds: its id, its full conversation as input items (its own input, the input of
    the responses it continued, then its output items), and the response object itself."""

    id: str
    items: list[dict]
    response: dict


class ResponseStore:
    """The last `capacity` responses (created with `store` not false), oldest dropped first: what
    `previous_response_id` and `item_reference` can name. In memory, for this process's life. Thread-safe: requests
    are translated off the event loop (`to_request` in a thread) while finished responses are put on it."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, Held] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, held: Held) -> None:
        with self._lock:
            self._held[held.id] = held
            self._held.move_to_end(held.id)
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)

    def get(self, response_id: str) -> Held | None:
        with self._lock:
            return self._held.get(response_id)

    def item(self, item_id: str) -> dict | None:
        """The held input or output item with this `id` (the newest response first)."""
        with self._lock:
            for held in reversed(self._held.values()):
                for item in held.items:
                    if isinstance(item, dict) and item.get("id") == item_id:
                        return item
        return None


# -- body → Request -------------------------------------------------------------------------------------------------
@dataclass
class Names:
    """Tool names as the model sees them (flat) and as the client gave them (a namespace and a name).

    A namespaced function keeps its bare name when no other tool has it, else becomes `namespace__name`."""

    original: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # flat -> (namespace, name)
    kinds: dict[str, str] = field(default_factory=dict)  # flat -> "function" | "custom"

    def flat(self, namespace: str | None, name: str) -> str:
        """The flat name of a tool (or of a past call to one that is no longer offered)."""
        for flat, (ns, n) in self.original.items():
            if ns == namespace and n == name:
                return flat
        return name if namespace is None else f"{namespace}__{name}"

    def restore(self, flat: str) -> tuple[str | None, str]:
        return self.original.get(flat, (None, flat))


@dataclass
class Translation:
    """A Responses body translated: the internal request and what the writer needs to answer in the body's terms."""

    request: Request
    names: Names
    items: list[dict]  # the conversation as input items (previous response's, then this body's), for the store
    hosted: tuple[str, ...]  # hosted tool types and items left out


def to_request(body: ResponsesRequest, ctx: Context, store: ResponseStore) -> Translation:
    """The internal `Request` for a Responses body.

    Raises ApiError (400, naming the field): a refused field, an unknown `previous_response_id` or
    `item_reference`, a malformed input item or tool, a tool_choice that cannot be honoured, a schema or grammar
    llguidance cannot compile, parts other than text.
    """
    for name, (neutral, why) in REFUSED.items():
        value = getattr(body, name)
        if value is not None and value not in neutral:
            raise ApiError(400, f"{name} = {json.dumps(value)[:60]}: {why}. Leave {name} out.", param=name)
    options = body.stream_options or {}
    if options.get("include_obfuscation"):
        raise ApiError(
            400,
            "stream_options.include_obfuscation = true: specdec serve does not pad its stream "
            "events. Leave it out, or send false.",
            param="stream_options.include_obfuscation",
        )
    if body.input is None:
        raise ApiError(400, "input is missing: send a string or a list of input items.", param="input")
    items: list[dict] = []
    if body.previous_response_id is not None:
        held = store.get(body.previous_response_id)
        if held is None:
            raise ApiError(
                400,
                f"Previous response with id {body.previous_response_id!r} not found: specdec serve "
                f"holds the last {store.capacity} responses of this process (those created with store "
                "not false), in memory. Send the whole conversation as input instead.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items.extend(held.items)
    new = (
        [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
        if isinstance(body.input, str)
        else list(body.input)
    )
    base = len(items)
    for i, item in enumerate(new):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            found = store.item(str(item.get("id")))
            if found is None:
                raise ApiError(
                    400,
                    f"input.{i} refers to item {item.get('id')!r}, which no response held by this "
                    "server has. Send the item itself.",
                    param=f"input.{i}.id",
                )
            item = found
        items.append(item)
    tools, names, hosted_tools = tools_of(body)
    messages, hosted_items = messages_of(items, body.instructions, names, base)
    include = body.include or []
    if body.top_logprobs is not None:
        check_logprobs("top_logprobs", body.top_logprobs)
    logprobs = (body.top_logprobs or 0) if LOGPROBS in include else None
    limit = ctx.defaults.limit(body.max_output_tokens, ctx.n_ctx)
    sent = SamplingValues(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed
    )
    sampling = ctx.defaults.sampling(OPENAI, sent)
    config = GenerationConfig(max_tokens=limit, sampling=sampling, logprobs=logprobs)
    request = Request(config=config, messages=messages, tools=tools, output=output_of(body.text), label="responses")
    return Translation(request, names, items, tuple(dict.fromkeys(hosted_tools + hosted_items)))


TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """The text of a message's content or a tool's output: a string, or text parts joined by blank lines (a refusal
    part is its text). Raises ApiError (400) naming an image, file or audio part."""
    return content_text(content, where, refusal_ok=True, kinds=TEXT_PARTS, sep="\n\n")


def messages_of(items: list, instructions: Any, names: Names, base: int = 0) -> tuple[tuple[Message, ...], tuple]:
    """The conversation of `instructions` and input `items` as internal messages, and the hosted-tool item types
    left out. `base`: how many of `items` came from the previous response (the rest are `input.{i - base}`).

    Raises ApiError (400) naming the item: an unknown item type, a message of an unknown role, a call without
    call_id or name, parts other than text.
    """
    out: list[Message] = []
    skipped: list[str] = []
    if instructions is not None:
        if isinstance(instructions, str):
            text = instructions
        else:
            text = "\n\n".join(
                _text(it.get("content"), f"instructions.{j}.content")
                for j, it in enumerate(instructions)
                if isinstance(it, dict)
            )
        if text:
            out.append(Message("system", text))

    def where(i: int) -> str:
        return f"input.{i - base}" if i >= base else f"previous_response_id (item {i})"

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"{where(i)} is not an input item (an object).", param=where(i))
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _text(item.get("content"), f"{where(i)}.content")
            if role in SYSTEM_ROLES:
                if out and out[-1].role == "system" and not out[-1].tool_calls:
                    out[-1] = Message("system", f"{out[-1].content}\n\n{text}")
                else:
                    out.append(Message("system", text))
            elif role in ("user", "assistant"):
                out.append(Message(role, text))
            else:
                raise ApiError(
                    400,
                    f"{where(i)}.role is {role!r}: use 'user', 'assistant', 'system' or 'developer'.",
                    param=f"{where(i)}.role",
                )
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise ApiError(400, f"{where(i)}: a {kind} item needs call_id and name.", param=where(i))
            flat = names.flat(item.get("namespace"), name)
            if kind == "function_call":
                arguments = _string(item.get("arguments"), f"{where(i)}.arguments")
                with contextlib.suppress(json.JSONDecodeError):  # text that is not JSON stays text
                    loads(arguments, f"{where(i)}.arguments")  # too deep: 400 (it is parsed for the template)
                call = ToolCall(call_id, flat, arguments)
            else:
                call = ToolCall(call_id, flat, _string(item.get("input"), f"{where(i)}.input"), kind="custom")
            if out and out[-1].role == "assistant":  # the calls of one turn join its text (llama-server does)
                last = out[-1]
                out[-1] = Message("assistant", last.content, tool_calls=(*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", tool_calls=(call,)))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(
                    400,
                    f"{where(i)}: a {kind} item needs the call_id of the call it answers.",
                    param=f"{where(i)}.call_id",
                )
            out.append(Message("tool", _text(item.get("output"), f"{where(i)}.output"), tool_call_id=call_id))
        elif kind == "reasoning":
            continue  # the client's copy of reasoning the model did not do here (or did in its text)
        elif kind in HOSTED_ITEMS:
            skipped.append(kind)
        elif kind == "item_reference":
            raise ApiError(400, f"{where(i)}: an item_reference inside a held response.", param=where(i))
        else:
            raise ApiError(
                400,
                f"{where(i)}.type {kind!r} is not an input item type specdec serve reads (message, "
                "function_call, function_call_output, custom_tool_call, custom_tool_call_output, "
                "reasoning, item_reference).",
                param=f"{where(i)}.type",
            )
    return tuple(out), tuple(skipped)


def _string(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    raise ApiError(400, f"{where} is not a string.", param=where)


def tools_of(body: ResponsesRequest) -> tuple[Tools | None, Names, tuple[str, ...]]:
    """The tools the model may call (function and custom tools, namespaces flattened), their names, and the hosted
    tool types left out.

    Raises ApiError (400, naming the field): a malformed tool, a repeated name, parameters or a grammar llguidance
    cannot compile, a `tool_choice` naming a tool that is not there or forcing a hosted tool.
    """
    names = Names()
    hosted: list[str] = []
    found: list[tuple[str | None, dict, str]] = []  # (namespace, tool, where)
    for i, tool in enumerate(body.tools or ()):
        where = f"tools.{i}"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in ("function", "custom"):
            found.append((None, tool, where))
        elif kind == "namespace":
            ns = tool.get("name")
            if not isinstance(ns, str) or not NAME.match(ns):
                raise ApiError(
                    400,
                    f"{where}.name {ns!r} is not a namespace name (letters, digits, _ and -).",
                    param=f"{where}.name",
                )
            for j, inner in enumerate(tool.get("tools") or ()):
                inner_kind = inner.get("type") if isinstance(inner, dict) else None
                if inner_kind in ("function", "custom"):
                    found.append((ns, inner, f"{where}.tools.{j}"))
                elif isinstance(inner_kind, str):
                    hosted.append(inner_kind)
                else:
                    raise ApiError(400, f"{where}.tools.{j} is not a tool.", param=f"{where}.tools.{j}")
        elif isinstance(kind, str):
            hosted.append(kind)
        else:
            raise ApiError(400, f'{where} is not a tool ({{"type": "function", "name", ...}}).', param=where)
    bare = [t.get("name") for _, t, _ in found]
    specs: list[Tool] = []
    for ns, tool, where in found:
        name = tool.get("name")
        flat = name if ns is None or bare.count(name) == 1 else f"{ns}__{name}"
        if tool["type"] == "function":
            specs.append(
                function_tool(
                    where,
                    name,
                    tool.get("description"),
                    tool.get("parameters"),
                    strict=tool.get("strict"),
                    taken=names.original,
                    flat=flat,
                )
            )
        else:
            flat, description = tool_name(where, name, tool.get("description"), taken=names.original, flat=flat)
            specs.append(
                custom_tool(flat, description, _custom_format(tool.get("format"), f"{where}.format"), param=where)
            )
        assert isinstance(flat, str) and isinstance(name, str)  # (`tool_name` checked both above)
        names.original[flat] = (ns, name)
        names.kinds[flat] = tool["type"]
    if body.parallel_tool_calls not in (None, True, False):
        raise ApiError(400, "parallel_tool_calls is not a boolean.", param="parallel_tool_calls")
    choice = body.tool_choice
    if not specs:
        if choice not in (None, "auto", "none"):
            raise ApiError(
                400,
                "tool_choice asks for a tool call, but no tool specdec serve can call was given "
                f"(function or custom tools; left out: {', '.join(hosted) or 'none'}).",
                param="tool_choice",
            )
        return None, names, tuple(hosted)
    mode, named, single = _choice(choice, names, [t.name for t in specs])
    parallel = body.parallel_tool_calls is not False and not single
    return choose(specs, mode, named, parallel=parallel), names, tuple(hosted)


def _custom_format(fmt: Any, where: str):
    """A custom tool's `format`: None or {"type": "text"} (any text), or {"type": "grammar", "syntax", "definition"}."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise ApiError(
            400,
            f'{where} is not a custom tool format ({{"type": "text"}} or {{"type": "grammar", '
            '"syntax": "lark" | "regex", "definition": ...}}).',
            param=where,
        )
    return input_grammar(fmt.get("syntax"), fmt.get("definition"), param=where)


def _choice(choice: Any, names: Names, flat: list[str]) -> tuple[ToolMode, list[Named] | None, bool]:
    """(mode, the tools it names by their flat names: None for all, one named tool forced) of a Responses
    `tool_choice`; `reading.choose` checks the names."""
    if choice is None or choice == "auto":
        return "auto", None, False
    if choice in ("none", "required"):
        return choice, None, False
    if not isinstance(choice, dict):
        raise ApiError(
            400,
            f"tool_choice {json.dumps(choice)[:60]} is not 'auto', 'none', 'required' or an object.",
            param="tool_choice",
        )
    kind = choice.get("type")

    def resolve(entry: dict, where: str) -> Named:
        """The tool `entry` names: its flat name, or a namespaced tool's by its own name when only one has it."""
        name = entry.get("name")
        matches = [f for f, (ns, n) in names.original.items() if n == name]
        return Named(matches[0] if name not in flat and len(matches) == 1 else name, where, f"{where}.name")

    if kind in ("function", "custom"):
        return "required", [resolve(choice, "tool_choice")], True
    if kind == "allowed_tools":
        mode = allowed_tools_mode(choice.get("mode"), "tool_choice.mode")
        allowed = []
        for i, entry in enumerate(choice.get("tools") or ()):
            entry_kind = entry.get("type") if isinstance(entry, dict) else None
            if entry_kind in ("function", "custom"):
                allowed.append(resolve(entry, f"tool_choice.tools.{i}"))
            elif entry_kind == "namespace":
                allowed += [
                    Named(f, f"tool_choice.tools.{i}", f"tool_choice.tools.{i}.name")
                    for f, (ns, _) in names.original.items()
                    if ns == entry.get("name")
                ]
        if not allowed:
            if mode == "required":
                raise ApiError(
                    400,
                    "tool_choice.tools allows no function or custom tool, and mode is 'required'.",
                    param="tool_choice.tools",
                )
            return "none", None, False
        return mode, [n for i, n in enumerate(allowed) if all(m.name != n.name for m in allowed[:i])], False
    raise ApiError(
        400,
        f"tool_choice forces the tool type {kind!r}, which specdec serve cannot run (it runs no "
        "hosted tools). Use 'auto', 'required', or a function or custom tool.",
        param="tool_choice",
    )


def output_of(text: TextConfig | None) -> Output | None:
    """The constraint `text.format` puts on the reply's text: None for text; JSON for json_object / json_schema
    (always enforced, `strict` or not; `description` informs).

    Raises ApiError (400, param "text.format..."): an unknown type, a bad name, a schema llguidance cannot compile.
    """
    return json_output(text.format if text is not None else None, "text.format", _json_schema_output)


def _json_schema_output(fmt: dict) -> Output:
    """`text.format` of type json_schema (its name and schema at its top level), checked, as an `Output`."""
    name = format_name(fmt.get("name"), "text.format.name")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(
            400, "text.format.schema is missing: give the JSON schema of the reply.", param="text.format.schema"
        )
    try:
        return Output(schema, json_schema(schema, name="text.format"), name=name, description=fmt.get("description"))
    except GrammarError as e:
        raise ApiError(400, str(e), param="text.format.schema") from None


# -- reply → wire ---------------------------------------------------------------------------------------------------
def usage_json(end: End) -> dict:
    """The Responses `usage`: input tokens (and those found in the KV cache), output tokens (none reasoning)."""
    r = end.stats.run
    return {
        "input_tokens": r.n_prompt,
        "input_tokens_details": {"cached_tokens": r.n_cached},
        "output_tokens": r.n_generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.n_prompt + r.n_generated,
    }


class ResponsesWriter:
    """The `response` object, or its stream of events, of one reply (a `reply.Writer`).

    Args:
        body: the request (echoed in the response: instructions, tools, tool_choice, text, ...).
        translation: the request's translation (tool names to restore, the conversation to hold).
        model: the model id the response names. method: the drafter (specdec's statistics).
        on_done: called with the finished response object and the conversation's input items plus its output
            items (the store keeps them).
    """

    def __init__(
        self,
        body: ResponsesRequest,
        translation: Translation,
        model: str,
        method: str,
        on_done: Callable[[dict, list[dict]], None],
    ) -> None:
        self.id = new_id("resp", digits=ID_DIGITS)
        self.created = int(time.time())
        self.req, self.tr, self.model, self.method = body, translation, model, method
        self.want_logprobs = translation.request.config.logprobs is not None
        self.on_done = on_done
        self.output: list[dict] = []  # items, as they stand
        self._seq = 0
        self._message: int | None = None  # output index of the open message
        self._calls: dict[int, int] = {}  # call index -> output index
        self._held: int | None = None  # a finished call's output index, its output_item.done held for End
        self._pending_logprobs: list[PieceLogprob] = []

    # -- a whole response
    def body(self, reply: ReplyStream) -> dict:
        end = reply.end
        assert end is not None  # a whole response is written once the reply is done
        if reply.content or not reply.calls:
            item = self._message_item(new_id("msg", digits=ID_DIGITS), reply.content, "completed")
            if self.want_logprobs:
                item["content"][0]["logprobs"] = chat_logprobs(reply.logprobs)
            self.output.append(item)
        for call in reply.calls:
            self.output.append(self._call_item(call.id, call.name, call.kind, call.arguments, "completed"))
        if end.truncated and self.output:
            self.output[-1]["status"] = "incomplete"
        return self._finish(end)

    # -- a stream
    def opening(self) -> list[Sse]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def events(self, event: ReplyEvent) -> list[Sse]:
        out: list[Sse] = []
        if isinstance(event, Content):
            self._pending_logprobs.extend(event.logprobs)
            if not event.text:
                return out
            out += self._release()
            if self._message is None:
                out += self._open_message()
            index = self._message
            assert index is not None  # (opened above)
            part = self.output[index]["content"][0]
            part["text"] += event.text
            logprobs = chat_logprobs(self._pending_logprobs) if self.want_logprobs else []
            if self.want_logprobs:
                part["logprobs"] += logprobs
            self._pending_logprobs = []
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.output[index]["id"],
                    output_index=index,
                    content_index=0,
                    delta=event.text,
                    logprobs=logprobs,
                )
            )
        elif isinstance(event, CallStart):
            out += self._release() + self._close_message("completed")
            c = event.call
            item = self._call_item(c.id, c.name, c.kind, "", "in_progress")
            self.output.append(item)
            self._calls[c.index] = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        elif isinstance(event, Arguments):
            index = self._calls[event.index]
            item = self.output[index]
            _, field, events = CALL_ITEMS[item["type"]]
            item[field] += event.text
            out.append(self._event(f"{events}.delta", item_id=item["id"], output_index=index, delta=event.text))
        elif isinstance(event, CallEnd):
            index = self._calls[event.index]
            item = self.output[index]
            _, field, events = CALL_ITEMS[item["type"]]
            item[field] = event.call.arguments
            named = {"name": item["name"]} if item["type"] == "function_call" else {}  # OpenAI names only these
            out.append(
                self._event(f"{events}.done", item_id=item["id"], output_index=index, **named, **{field: item[field]})
            )
            out += self._release()
            self._held = index  # done once we know whether a limit cut it
        elif isinstance(event, End):
            status = "incomplete" if event.truncated else "completed"
            if self._held is not None:
                out += self._release(status)
            out += self._close_message(status)
            if not self.output:  # an empty reply is still one (empty) message
                out += self._open_message() + self._close_message(status)
            response = self._finish(event)
            kind = "response.incomplete" if event.truncated else "response.completed"
            out.append(self._event(kind, response=response))
        return out

    def closing(self) -> list[Sse]:
        return []  # the stream ends after response.completed (no [DONE])

    def failure(self, error: Any) -> list[Sse]:
        response = self._response("failed")
        response["error"] = {"code": error.code or error.type, "message": error.message}
        return [self._event("response.failed", response=response)]

    # -- pieces
    def _open_message(self) -> list[Sse]:
        item = self._message_item(new_id("msg", digits=ID_DIGITS), "", "in_progress")
        self.output.append(item)
        self._message = index = len(self.output) - 1
        shown = {**item, "content": []}
        return [
            self._event("response.output_item.added", output_index=index, item=shown),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _close_message(self, status: str) -> list[Sse]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.output[index]
        item["status"] = status
        part = item["content"][0]
        return [
            self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            ),
            self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
            self._event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _release(self, status: str = "completed") -> list[Sse]:
        """The held call's output_item.done (`status`: "incomplete" when a limit cut the reply right after it)."""
        if self._held is None:
            return []
        index, self._held = self._held, None
        self.output[index]["status"] = status
        return [self._event("response.output_item.done", output_index=index, item=_copy(self.output[index]))]

    def _message_item(self, item_id: str, text: str, status: str) -> dict:
        return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_text_part(text)]}

    def _call_item(self, call_id: str, flat: str, kind: str, text: str, status: str) -> dict:
        namespace, name = self.tr.names.restore(flat)
        item_type = "custom_tool_call" if kind == "custom" else "function_call"
        prefix, field, _ = CALL_ITEMS[item_type]
        item = {
            "id": new_id(prefix, digits=ID_DIGITS),
            "type": item_type,
            "status": status,
            "call_id": call_id,
            "name": name,
            field: text,
        }
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def _finish(self, end: End) -> dict:
        status = "incomplete" if end.truncated else "completed"
        response = self._response(status)
        response["output"] = [_copy(item) for item in self.output]
        response["usage"] = usage_json(end)
        if end.truncated:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["completed_at"] = int(time.time())
        response["specdec"] = end.stats.specdec(self.method)
        self.on_done(response, self.tr.items + response["output"])
        return response

    def _response(self, status: str) -> dict:
        b, sampling = self.req, self.tr.request.config.sampling
        text = {
            "format": (b.text.format if b.text and b.text.format else {"type": "text"}),
            "verbosity": (b.text.verbosity if b.text and b.text.verbosity else "medium"),
        }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "completed_at": None,
            "error": None,
            "incomplete_details": None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": (b.reasoning or {}).get("summary")},
            "service_tier": "default",
            "store": b.store is not False,
            "temperature": sampling.temperature,
            "text": text,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": list(b.tools or []),
            "top_logprobs": b.top_logprobs,
            "top_p": sampling.top_p,
            "truncation": b.truncation or "disabled",
            "usage": None,
            "user": b.user,
            "metadata": b.metadata or {},
            "prompt_cache_key": b.prompt_cache_key,
            "safety_identifier": b.safety_identifier,
        }

    def _event(self, kind: str, **fields) -> Sse:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return {"event": kind, "data": json.dumps(data, ensure_ascii=False)}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


# -- the routes -----------------------------------------------------------------------------------------------------
def routes(app: FastAPI, ctx: Context, *, store: ResponseStore | None = None) -> None:
    """Mount `POST /v1/responses` and `GET /v1/responses/{id}` (a held response), over one `ResponseStore`."""
    store = store if store is not None else ResponseStore()
    noted: set[tuple[str, ...]] = set()

    @app.post("/v1/responses", dependencies=ctx.auth)
    async def responses(body: ResponsesRequest, http: HttpRequest) -> Response:
        tr = await asyncio.to_thread(to_request, body, ctx, store)  # tools' schemas compile off the event loop
        if tr.hosted and tr.hosted not in noted:  # said once per set, not on every turn of an agent's session
            noted.add(tr.hosted)
            ctx.worker.log(
                f"responses: left out of the prompt, as a local server cannot run them: {', '.join(tr.hosted)}"
            )

        def keep(response: dict, items: list[dict]) -> None:
            if body.store is not False:
                store.put(Held(response["id"], items, response))

        writer = ResponsesWriter(body, tr, ctx.model_id, ctx.method, keep)
        return await ctx.respond(http, tr.request, writer, stream=bool(body.stream))

    @app.get("/v1/responses/{response_id}", dependencies=ctx.auth)
    async def retrieve(response_id: str) -> dict:
        held = store.get(response_id)
        if held is None:
            raise ApiError(
                404,
                f"No response with id {response_id!r}: specdec serve holds the last "
                f"{store.capacity} responses of this process (created with store not false).",
                param="response_id",
                code="not_found",
            )
        return held.response
