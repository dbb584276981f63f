"""OpenAI's request fields (pydantic models) and the response / chunk JSON the server sends.

Follows OpenAI's API reference for Chat Completions and (legacy) Completions, as the official `openai` Python
package parses them: `chat.completion`, `chat.completion.chunk` (the first chunk carries the role, the last choice
chunk the finish_reason; with `stream_options.include_usage` every chunk has `"usage": null` and one more chunk with
`"choices": []` carries the usage), `text_completion`. Fields the server does not use (`user`, `logprobs`,
`frequency_penalty`, ...) are accepted and ignored, as llama-cpp-python's and vLLM's servers do; `n` > 1 is refused.

specdec adds one field to each response (and to the last choice chunk of a stream): `specdec`, the request's
speculation statistics (`specdec_json`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specdec_cli.engine import GenerationConfig
from specdec_cli.sampling import SamplingParams
from specdec_cli.serve.errors import ApiError
from specdec_cli.serve.service import RequestStats

# The engine's finish reasons → OpenAI's: an end-of-generation token or a stop string is "stop"; the token budget or
# a full context window is "length".
FINISH_REASONS = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}
MAX_STOP_STRINGS = 16


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None


class Prediction(_Lenient):
    """OpenAI predicted outputs: `{"type": "content", "content": "..."}` (or a list of text parts)."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Generation(_Lenient):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)  # not OpenAI's; llama.cpp's and vLLM's servers accept it too
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)  # idem
    seed: Optional[int] = Field(None, ge=-1, le=2**63 - 1)  # -1 = random, as llama.cpp's server
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1)


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    prediction: Optional[Prediction] = None


class CompletionRequest(_Generation):
    prompt: Union[str, list[str]]


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


def _text(content: Union[str, list[TextPart], None]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def chat_messages(req: ChatRequest) -> tuple[dict[str, str], ...]:
    """The messages as the chat template takes them: text content; `developer` (OpenAI's newer name) → `system`."""
    return tuple({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)}
                 for m in req.messages)


def prediction_text(req: ChatRequest) -> Optional[str]:
    """The predicted output's text, or None without a prediction."""
    return _text(req.prediction.content) if req.prediction is not None else None


def completion_prompt(req: CompletionRequest) -> str:
    """The prompt string; a list is accepted with exactly one string (one prompt per request)."""
    if isinstance(req.prompt, str):
        return req.prompt
    if len(req.prompt) != 1:
        raise ApiError(400, f"prompt is a list of {len(req.prompt)} strings; specdec serve takes one prompt per "
                       "request. Send them one by one.", param="prompt")
    return req.prompt[0]


def generation_config(req: Union[ChatRequest, CompletionRequest], defaults: Defaults, n_ctx: int) -> GenerationConfig:
    """The engine's `GenerationConfig` for a request. Raises ApiError (400) for what the engine cannot honour."""
    if req.n != 1:
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
    return GenerationConfig(max_tokens=limit, stop=stop, sampling=sampling)


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


def chat_response(rid: str, model: str, created: int, text: str, stats: RequestStats, method: str) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": openai_finish(stats)}],
        "usage": usage_json(stats),
        "specdec": specdec_json(stats, method),
    }


def completion_response(rid: str, model: str, created: int, text: str, stats: RequestStats, method: str) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": openai_finish(stats)}],
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

    def _chunk(self, choices: list[dict], **extra) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def _choice(self, text: Optional[str], finish: Optional[str], *, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self) -> Optional[dict]:
        """The opening chunk (chat: the assistant role with empty content; completion: none)."""
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def text(self, text: str) -> dict:
        return self._chunk([self._choice(text, None)])

    def finish(self, stats: RequestStats, method: str) -> dict:
        """The last choice chunk: finish_reason, and specdec's statistics."""
        return self._chunk([self._choice(None if self.kind == "chat" else "", openai_finish(stats))],
                           specdec=specdec_json(stats, method))

    def usage(self, stats: RequestStats) -> dict:
        """The usage chunk (`stream_options.include_usage`): no choices."""
        out = self._chunk([])
        out["usage"] = usage_json(stats)
        return out
