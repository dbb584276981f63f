"""llama.cpp's fill-in-the-middle endpoint (`POST /infill`), translated: the body into a `request.Request` with a
`request.Fim`, the reply's text into llama-server's completion JSON or its `data: {...}` stream. For editors that
talk to llama-server: llama.vim and llama.vscode.

Follows llama-server (tools/server/server.cpp `handle_infill`, server-task.cpp `to_json_non_oaicompat[_partial]`):
request `input_prefix`, `input_suffix`, `input_extra` [{"filename", "text"}], `prompt` (the current line before the
cursor), `n_predict` (-1: the server's default limit; 0: only evaluate the prompt, llama.vim's cache warm-up),
`stream`, `stop`, `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `response_fields` (answer only these, a nested
`timings/prompt_n` flattened to that key); sampling left out is llama.cpp's default (`request.LLAMA_CPP`: temperature
0.8, top_k 40, top_p 0.95, min_p 0.05) unless `specdec serve` was started with its own. The prompt is laid out as
llama-server lays it out, repo-level FIM included (`fim.fim_prompt`). Response: {index, content, tokens, id_slot,
stop, model, tokens_predicted, tokens_evaluated, generation_settings, prompt, has_new_line, truncated, stop_type
("eos" | "limit" | "word"), stopping_word, tokens_cached, timings {prompt_n, prompt_ms, prompt_per_token_ms,
prompt_per_second, predicted_n, predicted_ms, predicted_per_token_ms, predicted_per_second}} and specdec's `specdec`
statistics. Errors: llama-server's {"error": {"code", "message", "type"}}.

`t_max_predict_ms` is applied as llama-server applies it: once the generation has run that long, the reply ends
after the next token holding a newline (`stop_type` "limit"; `GenerationConfig.line_time_ms`). `t_max_prompt_ms` +
`t_max_predict_ms` are also the request's deadline: the scheduler serves earlier deadlines first
(`Request.deadline_ms`). Accepted and not applied (they pick samplers llama.cpp has and specdec does not, or slots):
`n_indent`, `samplers`, `cache_prompt` (the KV cache keeps the longest common prefix anyway), `id_slot`; any other
field is accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel, Field

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.server.errors import ApiError
from specdec_cli.server.http import Context
from specdec_cli.server.openai_base import MAX_STOP_STRINGS, Open
from specdec_cli.server.reply import Content, End, ReplyEvent, ReplyStream, Sse
from specdec_cli.server.request import LLAMA_CPP, Fim, Request, SamplingValues

STOP_TYPES = {"eog": "eos", "stop": "word", "length": "limit", "context": "limit"}


class ExtraChunk(BaseModel):
    filename: str = "tmp"
    text: str = ""


class InfillRequest(Open):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""
    n_predict: int = Field(-1, ge=-1)
    max_tokens: int | None = Field(None, ge=1)  # llama-server takes it as n_predict's alias
    stream: bool = False
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=5.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    response_fields: list[str] | None = None
    t_max_predict_ms: int | None = None  # after this many ms of generation, end at the next newline
    t_max_prompt_ms: int | None = None  # with t_max_predict_ms, the deadline the scheduler orders by
    # accepted, not applied (module docstring)
    n_indent: int | None = None
    samplers: Any = None
    cache_prompt: bool | None = None
    id_slot: int | None = None


def to_request(body: InfillRequest, ctx: Context) -> Request:
    """The internal `Request` for an `/infill` body: a repo-level `Fim`. Raises ApiError (400): a model without FIM
    tokens (naming it), too many stop strings."""
    ctx.service.require_fim("input_suffix")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(s for s in body.stop or () if s)
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}.", param="stop")
    asked = body.max_tokens or (body.n_predict if body.n_predict > 0 else None)
    limit = 1 if body.n_predict == 0 else ctx.defaults.limit(asked, ctx.n_ctx)  # 0: evaluate the prompt, warm up
    sent = SamplingValues(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed
    )
    sampling = ctx.defaults.sampling(LLAMA_CPP, sent)
    fim = Fim(
        prefix=body.input_prefix,
        suffix=body.input_suffix,
        prompt=body.prompt,
        repo=True,
        extra=tuple((c.filename, c.text) for c in body.input_extra),
    )
    budget = [t for t in (body.t_max_prompt_ms, body.t_max_predict_ms) if t is not None and t > 0]
    lines = float(body.t_max_predict_ms) if body.t_max_predict_ms is not None and body.t_max_predict_ms > 0 else None
    config = GenerationConfig(max_tokens=limit, stop=stop, sampling=sampling, line_time_ms=lines)
    return Request(config=config, fim=fim, label="infill", deadline_ms=float(sum(budget)) if budget else None)


class InfillWriter:
    """llama-server's completion JSON, or its stream of `data: {...}` objects, for one reply (a `reply.Writer`).

    Args:
        model: the model id. method: the drafter (specdec's statistics). fields: `response_fields` (None: all).
        warm_up: `n_predict` was 0 (the reply's text is dropped: only the prompt was wanted in the cache).
    """

    def __init__(self, model: str, method: str, *, fields: list[str] | None, warm_up: bool) -> None:
        self.model, self.method, self.fields, self.warm_up = model, method, fields, warm_up

    def body(self, reply: ReplyStream) -> dict:
        assert reply.end is not None  # a whole response is written once the reply is done
        return self._select(self._final(reply.end, "" if self.warm_up else reply.content))

    def opening(self) -> list[Sse]:
        return []

    def events(self, event: ReplyEvent) -> list[Sse]:
        if isinstance(event, Content) and event.text and not self.warm_up:
            return [
                _sse(
                    {
                        "index": 0,
                        "content": event.text,
                        "tokens": [],
                        "stop": False,
                        "id_slot": 0,
                        "tokens_predicted": 0,
                        "tokens_evaluated": 0,
                    }
                )
            ]
        if isinstance(event, End):
            return [_sse(self._select(self._final(event, "")))]
        return []

    def closing(self) -> list[Sse]:
        return []

    def failure(self, error: ApiError) -> list[Sse]:
        return [_sse(error_body(error))]

    def _final(self, end: End, content: str) -> dict:
        r = end.stats.run
        predicted_n = 0 if self.warm_up else r.n_generated
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": predicted_n,
            "tokens_evaluated": r.n_prompt,
            "generation_settings": {"n_predict": -1},
            "prompt": "",
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": STOP_TYPES.get(end.finish, "eos"),
            "stopping_word": "",
            "tokens_cached": r.n_cached + predicted_n,
            "timings": {
                "prompt_n": r.n_prompt - r.n_cached,
                "prompt_ms": round(r.prefill_ms, 3),
                "prompt_per_token_ms": _per(r.prefill_ms, r.n_prompt - r.n_cached),
                "prompt_per_second": _rate(r.n_prompt - r.n_cached, r.prefill_ms),
                "predicted_n": predicted_n,
                "predicted_ms": round(r.decode_ms, 3),
                "predicted_per_token_ms": _per(r.decode_ms, predicted_n),
                "predicted_per_second": _rate(predicted_n, r.decode_ms),
            },
            "specdec": end.stats.specdec(self.method),
        }

    def _select(self, obj: dict) -> dict:
        """Only `response_fields`, a nested path "a/b" flattened to the key "a/b" (as llama-server answers)."""
        if not self.fields:
            return obj
        out = {}
        for path in self.fields:
            value: Any = obj
            for key in path.split("/"):
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                out[path] = value
        return out


def _per(ms: float, n: int) -> float:
    return round(ms / n, 3) if n else 0.0


def _rate(n: int, ms: float) -> float:
    return round(1e3 * n / ms, 3) if ms > 0 else 0.0


def _sse(obj: dict) -> Sse:
    return {"data": json.dumps(obj)}


def error_body(error: ApiError) -> dict:
    """llama-server's error JSON: {"error": {"code": status, "message", "type"}}."""
    return {"error": {"code": error.status, "message": error.message, "type": error.type}}


def routes(app: FastAPI, ctx: Context) -> None:
    """Mount `POST /infill` (and its errors in llama-server's shape)."""
    ctx.register_errors("/infill", error_body)

    @app.post("/infill", dependencies=ctx.auth)
    async def infill(body: InfillRequest, http: HttpRequest) -> Response:
        request = to_request(body, ctx)
        ctx.ignore(http.url.path, body)
        writer = InfillWriter(ctx.model_id, ctx.method, fields=body.response_fields, warm_up=body.n_predict == 0)
        return await ctx.respond(http, request, writer, stream=body.stream)
