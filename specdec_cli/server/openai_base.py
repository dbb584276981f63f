"""What OpenAI's APIs share, for their translators (`openai_chat`, `openai_completions`): the sampling and limit
fields and how they become the engine's `GenerationConfig`, the fields refused unless neutral, `usage`, finish
reasons, log-probabilities (message content, tools and ids: `reading`, `reply.new_id`).

Follows OpenAI's API reference as the official `openai` Python package parses it. Which field informs and which changes
what must come back is `fields.FIELDS`: a field that changes it is implemented or refused with a 400 naming it; one
that only informs is accepted; a field nobody here knows is accepted and ignored (pydantic's `extra="allow"`, logged
once per name by `http.Context.ignore`), as llama-server, vLLM, Ollama and LM Studio do, where OpenAI answers
"Unrecognized request argument". llama.cpp's and vLLM's `top_k` and `min_p` are implemented.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.server.errors import ApiError
from specdec_cli.server.fields import REFUSED
from specdec_cli.server.reply import PieceLogprob, RequestStats, Sse, new_id
from specdec_cli.server.request import OPENAI, Defaults, SamplingValues

# The engine's finish reasons → OpenAI's: an end-of-generation token or a stop string is "stop"; the token budget or
# a full context window is "length".
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class Strict(BaseModel):
    """A wire model that refuses fields it does not declare (a closed shape, e.g. a text part)."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """A wire model that keeps fields it does not declare (`model_extra`), to be accepted and ignored: a request body
    and its messages (`fields`: vendor extras and fields newer than this server only inform)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(Open):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # refused when true (`refuse_unsupported`)


class Sampling(BaseModel):
    """The sampling fields of OpenAI's APIs (Chat Completions, Completions, Responses), with those llama.cpp's and
    vLLM's servers accept too (`top_k`, `min_p`, `seed`); `Defaults.sampling` fills in the server's defaults, else
    the API's documented ones."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's; llama.cpp's and vLLM's servers accept it too
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # idem
    seed: int | None = Field(None, ge=-1, le=2**63 - 1)  # -1 = random, as llama.cpp's server


class Generation(Open, Sampling):
    """The fields Chat Completions and Completions share (unknown ones kept in `model_extra`: accepted, ignored)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)
    user: str | None = None  # a label (accepted: it changes nothing)
    # refused unless neutral (`fields.REFUSED`)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None


def refuse_unsupported(req: Generation) -> None:
    """Raise ApiError (400, `param` = the field) for a field `fields.REFUSED` lists set to anything but a neutral
    value (left out, null, or one of its neutral values), and for a stream option specdec does not honour."""
    for name, (neutral, why) in REFUSED.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if value is None or value in neutral:
            continue
        shown = json.dumps(value)[:60]
        raise ApiError(400, f"{name} = {shown}: {why}. Leave {name} out.", param=name)
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise ApiError(
            400,
            "stream_options.include_obfuscation = true: specdec serve does not pad its stream "
            "chunks. Leave it out, or send false.",
            param="stream_options.include_obfuscation",
        )


def check_logprobs(name: str, n: int | None) -> None:
    """Raise ApiError (400, param `name`) unless `n` (a number of top log-probabilities) is None or 0-20."""
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} = {n}: it must be between 0 and {MAX_TOP_LOGPROBS}.", param=name)


def generation_config(
    req: Generation, defaults: Defaults, n_ctx: int, *, max_tokens: int | None = None, logprobs: int | None = None
) -> GenerationConfig:
    """The engine's `GenerationConfig` for a request's limits, stop strings and sampling (the service adds the
    grammar). Raises ApiError (400) for what the engine cannot honour.

    Args:
        max_tokens: the request's own limit (chat: `max_completion_tokens` or `max_tokens`); None: the server's
            default cap (`Defaults.limit`). Sampling left out: the server's own, else OpenAI's (temperature 1,
            top_p 1).
        logprobs: None (off), 0 (each token's), or the number of top alternatives (checked by the translator).
    """
    refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true.", param="stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise ApiError(400, "stop contains an empty string, which would stop before the first token.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}.", param="stop")
    limit = defaults.limit(max_tokens or req.max_tokens, n_ctx)
    sent = SamplingValues(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed)
    sampling = defaults.sampling(OPENAI, sent)
    return GenerationConfig(max_tokens=limit, stop=stop, sampling=sampling, logprobs=logprobs)


def openai_finish(stats: RequestStats) -> str | None:
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


class OpenAIWriter:
    """What Chat Completions' and Completions' writers (`reply.Writer`s) share: the response's id, creation time,
    model and drafter, and a stream's envelope: every chunk names the id, `CHUNK_OBJECT`, the time and the model
    (`usage: null` when `stream_options.include_usage`, then one chunk of usage after the last), and `[DONE]` ends it.

    Args:
        model: the model id the response names. method: the drafter (specdec's statistics).
        logprobs: the request asked for logprobs. include_usage: `stream_options.include_usage`.
    """

    ID_PREFIX = ""  # the API's id prefix: "chatcmpl", "cmpl"
    CHUNK_OBJECT = ""  # a chunk's `object`

    def __init__(self, model: str, method: str, *, logprobs: bool, include_usage: bool) -> None:
        self.id = new_id(self.ID_PREFIX, sep="-")
        self.created = int(time.time())
        self.model, self.method = model, method
        self.want_logprobs = logprobs
        self.include_usage = include_usage

    def closing(self) -> list[Sse]:
        return [{"data": "[DONE]"}]

    def failure(self, error: ApiError) -> list[Sse]:
        return [sse(error.body())]  # the openai client raises APIError on a chunk with "error"

    def _base(self) -> dict:
        out = {
            "id": self.id,
            "object": self.CHUNK_OBJECT,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def _usage(self, stats: RequestStats) -> list[Sse]:
        """The chunk of usage after the last one, when `include_usage`."""
        return [sse({**self._base(), "choices": [], "usage": usage_json(stats)})] if self.include_usage else []


def sse(obj: dict) -> Sse:
    """One server-sent event carrying `obj` as JSON."""
    return {"data": json.dumps(obj)}


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
    return [
        {
            "token": token_string(e.piece),
            "logprob": _logprob(e.logprob),
            "bytes": list(e.piece),
            "top_logprobs": [{"token": token_string(p), "logprob": _logprob(lp), "bytes": list(p)} for p, lp in e.top],
        }
        for e in entries
    ]


def completion_logprobs(entries: Sequence[PieceLogprob], offset: int = 0) -> dict:
    """The legacy completions' `logprobs`: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
    (offsets in characters of the text, from `offset`)."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_string(e.piece))
        offset += len(e.piece.decode("utf-8", "ignore"))
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [{token_string(p): _logprob(lp) for p, lp in e.top} for e in entries],
        "text_offset": offsets,
    }
