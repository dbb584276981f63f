"""OpenAI's request fields (pydantic models) and the response / chunk JSON the server sends.

Follows OpenAI's API reference for Chat Completions and (legacy) Completions, as the official `openai` Python
package parses them: `chat.completion`, `chat.completion.chunk` (the first chunk carries the role, the last choice
chunk the finish_reason; with `stream_options.include_usage` every chunk has `"usage": null` and one more chunk with
`"choices": []` carries the usage), `text_completion`.

No field is accepted and ignored. Every field of OpenAI's request is declared here and either implemented or refused
with a 400 that names it (`REFUSED`, `refuse_unsupported`), as OpenAI and llama-server answer what they do not
support; a field OpenAI does not have is refused too (pydantic's `extra="forbid"`: OpenAI answers "Unrecognized
request argument"), except llama.cpp's and vLLM's `top_k` and `min_p`, which specdec implements. Accepted without
effect on the output, because they only label the request: `model` (the server serves one model), `user`,
`safety_identifier`, `prompt_cache_key` (a routing hint: the KV cache keeps the longest common prefix anyway).

specdec adds one field to each response (and to the last choice chunk of a stream): `specdec`, the request's
speculation statistics (`specdec_json`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from specdec_cli.core.constraint import Grammar, GrammarError, json_object, json_schema
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.server.errors import ApiError
from specdec_cli.server.service import PieceLogprob, RequestStats
from specdec_cli.server.tools import (
    NAME, CallStart, Content, ReplyParser, Tags, Tools, check_tools, grammar as tools_grammar,
)

# The engine's finish reasons → OpenAI's: an end-of-generation token or a stop string is "stop"; the token budget or
# a full context window is "length".
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """OpenAI predicted outputs: `{"type": "content", "content": "..."}` (or a list of text parts)."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None  # refused when true (`refuse_unsupported`)


class Message(_Strict):
    """One message of any role; what each role may carry is checked in `chat_messages` (a message of the wrong
    shape gets a 400 naming the field, e.g. `messages.2.tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    audio: Any = None
    function_call: Any = None


class _Generation(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)  # not OpenAI's; llama.cpp's and vLLM's servers accept it too
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)  # idem
    seed: Optional[int] = Field(None, ge=-1, le=2**63 - 1)  # -1 = random, as llama.cpp's server
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(1, ge=1)
    user: Optional[str] = None  # a label (accepted: it changes nothing)
    # refused unless neutral (`REFUSED`)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    prediction: Optional[Prediction] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None  # 0-20, checked in `logprobs_of` (400 naming it)
    safety_identifier: Optional[str] = None  # a label (accepted)
    prompt_cache_key: Optional[str] = None  # a routing hint (accepted: the KV cache keeps common prefixes anyway)
    # refused unless neutral (`REFUSED`)
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    modalities: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Optional[bool] = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]
    logprobs: Optional[int] = None  # 0-20, checked in `logprobs_of`
    # refused unless neutral (`REFUSED`)
    best_of: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None


# field -> (what is neutral, why it is refused otherwise). A field left out, null, or at its neutral value is fine.
REFUSED: dict[str, tuple[tuple, str]] = {
    "frequency_penalty": ((0, 0.0), "specdec serve does not implement repetition penalties (they would change the "
                          "target distribution speculation preserves)"),
    "presence_penalty": ((0, 0.0), "specdec serve does not implement repetition penalties"),
    "logit_bias": (({},), "specdec serve does not implement logit_bias"),
    "audio": ((), "specdec serve generates text only"),
    "modalities": ((["text"],), "specdec serve generates text only"),
    "functions": ((), "functions is OpenAI's deprecated form of tools: send tools"),
    "function_call": ((), "function_call is OpenAI's deprecated form of tool_choice: send tool_choice"),
    "metadata": (({},), "specdec serve does not store completions"),
    "store": ((False,), "specdec serve does not store completions"),
    "moderation": ((), "specdec serve does not moderate"),
    "prompt_cache_options": ((), "specdec serve keeps the KV cache of the longest common prefix on its own"),
    "prompt_cache_retention": ((), "specdec serve keeps the KV cache of the longest common prefix on its own"),
    "reasoning_effort": ((), "specdec serve does not steer reasoning"),
    "verbosity": ((), "specdec serve does not steer verbosity"),
    "web_search_options": ((), "specdec serve does not search the web"),
    "service_tier": (("auto", "default"), "specdec serve has one service tier"),
    "best_of": ((1,), "specdec serve generates one completion per request"),
    "echo": ((False,), "specdec serve does not echo the prompt"),
    "suffix": (("",), "specdec serve does not insert text (suffix)"),
}


def refuse_unsupported(req: Union[ChatRequest, CompletionRequest]) -> None:
    """Raise ApiError (400, `param` = the field) for a field of `REFUSED` set to anything but a neutral value, and
    for a stream option specdec does not honour."""
    for name, (neutral, why) in REFUSED.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if value is None or value in neutral:
            continue
        shown = json.dumps(value)[:60]
        raise ApiError(400, f"{name} = {shown}: {why}. Leave {name} out.", param=name)
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise ApiError(400, "stream_options.include_obfuscation = true: specdec serve does not pad its stream "
                       "chunks. Leave it out, or send false.", param="stream_options.include_obfuscation")


def _text(content: Any, where: str, *, refusal_ok: bool = False) -> str:
    """The text of a message's content: a string, a list of text parts, or null (""). Other parts (images, audio,
    files) get a 400 naming them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} is neither a string nor a list of parts.", param=where)
    out = []
    for i, part in enumerate(content):
        part = part.model_dump() if isinstance(part, BaseModel) else part
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
            out.append(part["text"])
        elif kind == "refusal" and refusal_ok and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in ("image_url", "input_audio", "file", "input_image"):
            raise ApiError(400, f"{where}.{i} is an {kind} part: this model reads text only. Send text parts.",
                           param=f"{where}.{i}.type")
        else:
            raise ApiError(400, f"{where}.{i} is not a text part ({{\"type\": \"text\", \"text\": ...}}).",
                           param=f"{where}.{i}")
    return "".join(out)


def chat_messages(req: ChatRequest) -> tuple[dict[str, Any], ...]:
    """The messages as chat templates take them (Hugging Face's convention): text content; `developer` (OpenAI's
    newer name) → `system`; an assistant's `tool_calls` with `function.arguments` parsed into an object (Qwen2.5's
    template writes them with `tojson`); `tool` messages with their `tool_call_id`.

    Raises ApiError (400) naming the field: parts other than text, a `name` (templates have no place for it), a tool
    message without `tool_call_id`, tool calls that are not functions or whose arguments are not a JSON object, the
    deprecated `function` role, fields a role does not take.
    """
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role == "function":
            raise ApiError(400, f"{where}.role 'function' is OpenAI's deprecated form of 'tool' messages: send role "
                           "'tool' with tool_call_id.", param=f"{where}.role")
        if m.name is not None:
            raise ApiError(400, f"{where}.name: chat templates have no place for participant names. Leave name out.",
                           param=f"{where}.name")
        for field_, allowed in (("tool_calls", {"assistant"}), ("tool_call_id", {"tool"}), ("refusal", {"assistant"}),
                                ("audio", set()), ("function_call", set())):
            if getattr(m, field_) is not None and m.role not in allowed:
                hint = "; send tool_calls" if field_ == "function_call" else ""
                raise ApiError(400, f"{where}.{field_} is not supported on a {m.role} message{hint}.",
                               param=f"{where}.{field_}")
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, f"{where}: a tool message needs tool_call_id (the id of the call it answers).",
                               param=f"{where}.tool_call_id")
            out.append({"role": "tool", "content": _text(m.content, f"{where}.content"),
                        "tool_call_id": m.tool_call_id})
        elif m.role == "assistant":
            text = _text(m.content, f"{where}.content", refusal_ok=True)
            if m.refusal:
                text = text or m.refusal
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if m.tool_calls:
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
            out.append(msg)
        else:
            out.append({"role": "system" if m.role == "developer" else m.role,
                        "content": _text(m.content, f"{where}.content")})
    return tuple(out)


def _tool_call(call: Any, where: str) -> dict:
    """An assistant's past tool call as templates take it: {"id", "type", "function": {"name", "arguments": obj}}."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" or \
            not isinstance(call.get("function"), dict):
        raise ApiError(400, f"{where} is not a function call ({{\"id\", \"type\": \"function\", \"function\": "
                       "{\"name\", \"arguments\"}}).", param=where)
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name is missing.", param=f"{where}.function.name")
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise ApiError(400, f"{where}.function.arguments is not JSON ({e.msg} at character {e.pos}).",
                       param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object.", param=f"{where}.function.arguments")
    return {"id": str(call.get("id") or ""), "type": "function", "function": {"name": name, "arguments": args}}


def prediction_text(req: ChatRequest) -> Optional[str]:
    """The predicted output's text, or None without a prediction."""
    return _text(req.prediction.content, "prediction.content") if req.prediction is not None else None


def completion_prompt(req: CompletionRequest) -> str:
    """The prompt string; a list is accepted with exactly one string (one prompt per request)."""
    if isinstance(req.prompt, str):
        return req.prompt
    if len(req.prompt) != 1:
        raise ApiError(400, f"prompt is a list of {len(req.prompt)} strings; specdec serve takes one prompt per "
                       "request. Send them one by one.", param="prompt")
    return req.prompt[0]


def response_schema(response_format: Optional[dict]) -> tuple[Optional[dict], Optional[Grammar]]:
    """(the JSON schema the reply must follow, its grammar) for OpenAI's `response_format`; (None, None) for text.

    `{"type": "text"}`: free text. `{"type": "json_object"}`: any JSON object. `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}`: JSON valid against `schema` (always enforced,
    `strict` or not; `description` is for the model and the template has no place for it, so it is refused).

    Raises ApiError (400, `param` "response_format..."): an unknown type, a bad name, a schema llguidance cannot
    compile (the message says where).
    """
    if response_format is None:
        return None, None
    kind = response_format.get("type")
    if kind == "text" and set(response_format) == {"type"}:
        return None, None
    if kind == "json_object" and set(response_format) == {"type"}:
        schema = {"type": "object"}
        return schema, json_object(name="response_format")
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'."
                       if kind not in ("text", "json_object") else
                       f"response_format of type {kind!r} takes no other field.", param="response_format.type"
                       if kind not in ("text", "json_object") else "response_format")
    unknown = set(response_format) - {"type", "json_schema"}
    spec = response_format.get("json_schema")
    if unknown or not isinstance(spec, dict):
        raise ApiError(400, "response_format of type 'json_schema' takes one field, json_schema: {\"name\", "
                       "\"schema\", \"strict\"}.", param="response_format")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ApiError(400, f"response_format.json_schema has unknown fields: {', '.join(sorted(unknown))}.",
                       param="response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ApiError(400, f"response_format.json_schema.name {name!r} is not a name (letters, digits, _ and -, "
                       "at most 64).", param="response_format.json_schema.name")
    if spec.get("description") is not None:
        raise ApiError(400, "response_format.json_schema.description: specdec serve cannot show it to the model "
                       "(the chat template has no place for it); put it in a message and leave description out.",
                       param="response_format.json_schema.description")
    if spec.get("strict") not in (None, True, False):
        raise ApiError(400, "response_format.json_schema.strict is not a boolean.",
                       param="response_format.json_schema.strict")
    schema = spec.get("schema", {})
    try:
        return schema, json_schema(schema, name="response_format")
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format") from None


def logprobs_of(req: Union[ChatRequest, CompletionRequest]) -> Optional[int]:
    """`GenerationConfig.logprobs` for a request: None (off), 0 (each token's), or the number of top alternatives.
    Chat: `logprobs: true` with `top_logprobs` (0-20); completions: `logprobs` (0-20)."""
    name, n = ("logprobs", req.logprobs) if isinstance(req, CompletionRequest) else ("top_logprobs", req.top_logprobs)
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} = {n}: it must be between 0 and {MAX_TOP_LOGPROBS}.", param=name)
    if isinstance(req, CompletionRequest):
        return n
    if n is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    return (n or 0) if req.logprobs else None


@dataclass(frozen=True)
class Defaults:
    """The server's defaults for fields a request leaves out (`specdec serve --temperature ...`).

    max_tokens None: until the context window is full (OpenAI's default).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    max_tokens: Optional[int] = None


def chat_tools(req: ChatRequest) -> Optional[Tools]:
    """The request's tools, checked (`tools.check_tools`); None without tools."""
    return check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


def generation_config(req: Union[ChatRequest, CompletionRequest], defaults: Defaults, n_ctx: int, *,
                      tools: Optional[Tools] = None, tags: Tags = Tags()) -> GenerationConfig:
    """The engine's `GenerationConfig` for a request. Raises ApiError (400) for what the engine cannot honour.

    Args:
        tools: the chat request's checked tools (`chat_tools`): the reply is constrained by their grammar.
        tags: how the vocabulary writes `<tool_call>` (`GenerationService.tool_tags`).
    """
    refuse_unsupported(req)
    if req.n not in (None, 1):
        raise ApiError(400, f"n = {req.n}: specdec serve generates one choice per request. Send n = 1, or several "
                       "requests.", param="n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true.", param="stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise ApiError(400, "stop contains an empty string, which would stop before the first token.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}.", param="stop")
    limit = getattr(req, "max_completion_tokens", None) or req.max_tokens or defaults.max_tokens or n_ctx
    seed = defaults.seed if req.seed is None else (None if req.seed == -1 else req.seed)
    sampling = SamplingParams(
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_k=defaults.top_k if req.top_k is None else req.top_k,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        seed=seed,
    )
    grammar = None
    if isinstance(req, ChatRequest):
        schema, grammar = response_schema(req.response_format)
        if tools is not None:
            grammar = tools_grammar(tools, tags, reply=schema)
    return GenerationConfig(max_tokens=limit, stop=stop, sampling=sampling, grammar=grammar, logprobs=logprobs_of(req))


# -- responses --------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def openai_finish(stats: RequestStats) -> Optional[str]:
    return FINISH_REASONS.get(stats.run.finish_reason or "", None)


def usage_json(stats: RequestStats) -> dict:
    """OpenAI's `usage`: prompt, completion, total tokens; the prompt tokens found in the KV cache
    (`prompt_tokens_details.cached_tokens`); the prediction's accepted/rejected tokens."""
    r = stats.run
    return {
        "prompt_tokens": r.n_prompt,
        "completion_tokens": r.n_generated,
        "total_tokens": r.n_prompt + r.n_generated,
        "prompt_tokens_details": {"cached_tokens": r.n_cached},
        "completion_tokens_details": {
            "accepted_prediction_tokens": r.accepted_prediction_tokens,
            "rejected_prediction_tokens": r.rejected_prediction_tokens,
        },
    }


def specdec_json(stats: RequestStats, method: str) -> dict:
    """specdec's extra field: how this request was speculated.

    method: the drafter. drafted / accepted: draft tokens proposed / accepted by the target. acceptance_rate:
    accepted / drafted. tokens_per_pass: output tokens per target forward pass (1.0 = plain decoding).
    target_passes: forward passes in the decode loop. sources: drafted / accepted per drafter source. mean_k: the
    mean draft length chosen. prefill_ms / decode_ms: target prefill / decode loop wall time (ms). tokens_per_s:
    output tokens per second of the decode loop.
    """
    r = stats.run
    return {
        "method": method,
        "drafted": r.n_drafted,
        "accepted": r.n_accepted,
        "acceptance_rate": round(r.acceptance_rate, 4),
        "tokens_per_pass": round(r.tokens_per_pass, 4),
        "target_passes": r.n_target_passes,
        "sources": dict(sorted(r.by_source.items())),
        "mean_k": round(r.mean_k, 3),
        "prefill_ms": round(r.prefill_ms, 2),
        "decode_ms": round(r.decode_ms, 2),
        "tokens_per_s": round(r.tokens_per_s, 2),
        "finish_reason": r.finish_reason,
    }


def token_string(piece: bytes) -> str:
    """A token's text for `logprobs`: its UTF-8 text, or OpenAI's `bytes:\\xNN...` for part of a character."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _logprob(value: float) -> float:
    return max(float(value), -9999.0)  # OpenAI's floor: JSON has no -Infinity


def chat_logprobs(entries: Sequence[PieceLogprob]) -> list[dict]:
    """Chat's `logprobs.content`: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
    return [{"token": token_string(e.piece), "logprob": _logprob(e.logprob), "bytes": list(e.piece),
             "top_logprobs": [{"token": token_string(p), "logprob": _logprob(lp), "bytes": list(p)} for p, lp in e.top]}
            for e in entries]


def completion_logprobs(entries: Sequence[PieceLogprob], offset: int = 0) -> dict:
    """The legacy completions' `logprobs`: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
    (offsets in characters of the text, from `offset`)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_string(e.piece))
        offset += len(e.piece.decode("utf-8", "ignore"))
    return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{token_string(p): _logprob(lp) for p, lp in e.top} for e in entries],
            "text_offset": offsets}


class ChatReply:
    """One chat reply as its records stream: the text split into content and tool calls (`tools.ReplyParser`), the
    log-probabilities kept, and the JSON of a whole response (`response`) or of stream chunks (`chunks`, `finish`).

    Args:
        parse_calls: the request has tools (and tool_choice is not "none"): `<tool_call>` blocks become tool calls.
        logprobs: the request asked for logprobs (then `logprobs.content` is a list, else null).
        loose_calls: a reply that is one bare or fenced JSON call is a call too (`tool_choice` auto).
    """

    def __init__(self, parse_calls: bool, logprobs: bool, *, loose_calls: bool = False) -> None:
        self.parser = ReplyParser(parse_calls, loose=loose_calls)
        self.want_logprobs = logprobs
        self.content: list[str] = []
        self.logprobs: list[PieceLogprob] = []

    def add(self, text: str, logprobs: Sequence[PieceLogprob] = ()) -> list[dict]:
        """The deltas (`choices[0].delta` dicts) for the next text; each is paired with its logprobs by `chunks`."""
        self.logprobs.extend(logprobs)
        return [self._delta(e) for e in self.parser.feed(text)]

    def end(self) -> list[dict]:
        """The deltas of what the parser held back, at the end of the reply."""
        return [self._delta(e) for e in self.parser.close()]

    def _delta(self, event) -> dict:
        if isinstance(event, Content):
            self.content.append(event.text)
            return {"content": event.text}
        if isinstance(event, CallStart):
            c = event.call
            return {"tool_calls": [{"index": c.index, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def finish_reason(self, stats: RequestStats) -> Optional[str]:
        """OpenAI's finish_reason: "tool_calls" when the reply ended (not cut short) after calling tools."""
        reason = openai_finish(stats)
        return "tool_calls" if reason == "stop" and self.parser.calls else reason

    def logprobs_json(self, entries: Optional[Sequence[PieceLogprob]] = None) -> Optional[dict]:
        if not self.want_logprobs:
            return None
        return {"content": chat_logprobs(self.logprobs if entries is None else entries), "refusal": None}

    def message(self) -> dict:
        """The whole reply's `message`: content (null when the reply is only tool calls), tool_calls when any."""
        calls = self.parser.calls
        content = "".join(self.content)
        msg: dict = {"role": "assistant", "content": None if calls and not content else content, "refusal": None}
        if calls:
            msg["tool_calls"] = [c.json() for c in calls]
        return msg


def chat_response(rid: str, model: str, created: int, reply: ChatReply, stats: RequestStats, method: str) -> dict:
    """A `chat.completion` for a reply whose records were all `add`ed (and `end` called)."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": reply.message(), "logprobs": reply.logprobs_json(),
                     "finish_reason": reply.finish_reason(stats)}],
        "usage": usage_json(stats),
        "specdec": specdec_json(stats, method),
    }


def completion_response(rid: str, model: str, created: int, text: str, stats: RequestStats, method: str,
                        logprobs: Optional[Sequence[PieceLogprob]] = None) -> dict:
    """A `text_completion`; `logprobs` None = not asked."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "text": text,
                     "logprobs": None if logprobs is None else completion_logprobs(logprobs),
                     "finish_reason": openai_finish(stats)}],
        "usage": usage_json(stats),
        "specdec": specdec_json(stats, method),
    }


class ChunkWriter:
    """The JSON of one stream's chunks, chat (`chat.completion.chunk`) or completion (`text_completion`)."""

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self._offset = 0  # completions: characters sent so far (`logprobs.text_offset`)

    def _chunk(self, choices: list[dict], **extra) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def first(self) -> Optional[dict]:
        """The opening chunk (chat: the assistant role with empty content; completion: none)."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def chat(self, reply: ChatReply, deltas: list[dict], logprobs: Sequence[PieceLogprob] = ()) -> list[dict]:
        """Chat chunks for `deltas` (`ChatReply.add`); the step's logprobs ride on the first (or on an empty delta
        when the step's text was held back)."""
        if not deltas and reply.want_logprobs and logprobs:
            deltas = [{}]
        return [self._chunk([{"index": 0, "delta": d,
                              "logprobs": reply.logprobs_json(logprobs) if i == 0 and logprobs else None,
                              "finish_reason": None}])
                for i, d in enumerate(deltas)]

    def text(self, text: str, logprobs: Optional[Sequence[PieceLogprob]] = None) -> dict:
        """A completion chunk; `logprobs` None = not asked."""
        lp = None if logprobs is None else completion_logprobs(logprobs, self._offset)
        self._offset += len(text)
        return self._chunk([{"index": 0, "text": text, "logprobs": lp, "finish_reason": None}])

    def finish(self, stats: RequestStats, method: str, reply: Optional[ChatReply] = None) -> dict:
        """The last choice chunk: finish_reason, and specdec's statistics."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None,
                      "finish_reason": reply.finish_reason(stats) if reply is not None else openai_finish(stats)}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": openai_finish(stats)}
        return self._chunk([choice], specdec=specdec_json(stats, method))

    def usage(self, stats: RequestStats) -> dict:
        """The usage chunk (`stream_options.include_usage`): no choices."""
        out = self._chunk([])
        out["usage"] = usage_json(stats)
        return out
