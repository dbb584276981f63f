"""OpenAI's (legacy) Completions (`POST /v1/completions`), translated: a raw prompt into a `request.Request`, the
reply's text into `text_completion` JSON or chunks.

Follows OpenAI's API reference as the official `openai` Python package parses it; `logprobs` is the legacy shape
({tokens, token_logprobs, top_logprobs, text_offset}).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from specdec_cli.server.errors import ApiError
from specdec_cli.server.fields import CHAT_ONLY
from specdec_cli.server.http import Context
from specdec_cli.server.openai_base import (
    FINISH_REASONS,
    Generation,
    OpenAIWriter,
    check_logprobs,
    completion_logprobs,
    generation_config,
    sse,
    usage_json,
)
from specdec_cli.server.reply import Content, End, ReplyEvent, ReplyStream, Sse
from specdec_cli.server.request import Fim, Request


class CompletionRequest(Generation):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids (one prompt per request)
    suffix: str | None = None  # fill in the middle: the text after the cursor (the prompt is the text before)
    logprobs: int | None = None  # 0-20, checked in `to_request`
    # refused unless neutral (`fields.REFUSED`)
    best_of: int | None = None
    echo: bool | None = None


def to_request(body: CompletionRequest, ctx: Context) -> Request:
    """The internal `Request` for a Completions body: the prompt as raw text (special tokens parsed, as llama-server:
    Continue's and Tabby's `<|fim_prefix|>...<|fim_middle|>` prompts work) or token ids; with a `suffix`, fill in
    the middle with the model's FIM tokens (as Ollama's `suffix`).

    Raises ApiError (400, naming the field): several prompts, token ids outside the vocabulary, a `suffix` for a
    model without FIM tokens (naming the model) or with a token-id prompt, what the server cannot honour."""
    check_logprobs("logprobs", body.logprobs)
    for name in CHAT_ONLY:
        if (body.model_extra or {}).get(name) is not None:
            raise ApiError(
                400,
                f"{name}: /v1/completions writes text from a raw prompt and cannot honour it. Send it "
                "to /v1/chat/completions.",
                param=name,
            )
    config = generation_config(body, ctx.defaults, ctx.n_ctx, logprobs=body.logprobs)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = ctx.service.check_token_ids(prompt, "prompt")
    elif isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(
                400,
                f"prompt is a list of {len(prompt)} prompts; specdec serve takes one prompt per "
                "request. Send them one by one.",
                param="prompt",
            )
        prompt = prompt[0] if isinstance(prompt[0], str) else ctx.service.check_token_ids(prompt[0], "prompt")
    if body.suffix:
        if not isinstance(prompt, str):
            raise ApiError(
                400, "suffix needs a text prompt (the code before the cursor), not token ids.", param="suffix"
            )
        ctx.service.require_fim("suffix")
        return Request(config=config, fim=Fim(prefix=prompt, suffix=body.suffix), label="completion")
    return Request(config=config, prompt=prompt, label="completion")


class CompletionWriter(OpenAIWriter):
    """`text_completion` JSON, or its chunks, of one reply (a `reply.Writer`; the arguments are
    `openai_base.OpenAIWriter`'s)."""

    ID_PREFIX = "cmpl"
    CHUNK_OBJECT = "text_completion"
    _offset = 0  # characters sent so far (`logprobs.text_offset`)

    def body(self, reply: ReplyStream) -> dict:
        end = reply.end
        assert end is not None  # a whole response is written once the reply is done
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "text": reply.content,
                    "logprobs": completion_logprobs(reply.logprobs) if self.want_logprobs else None,
                    "finish_reason": FINISH_REASONS.get(end.finish),
                }
            ],
            "usage": usage_json(end.stats),
            "specdec": end.stats.specdec(self.method),
        }

    def opening(self) -> list[Sse]:
        return []

    def events(self, event: ReplyEvent) -> list[Sse]:
        if isinstance(event, Content):
            lp = completion_logprobs(event.logprobs, self._offset) if self.want_logprobs else None
            self._offset += len(event.text)
            return [self._chunk(event.text, lp)]
        if isinstance(event, End):
            return [
                self._chunk("", None, finish=FINISH_REASONS.get(event.finish), specdec=event.stats.specdec(self.method))
            ] + self._usage(event.stats)
        return []

    def _chunk(self, text: str, logprobs: dict | None, *, finish: str | None = None, **extra) -> Sse:
        return sse(
            {
                **self._base(),
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }
        )


def routes(app: FastAPI, ctx: Context) -> None:
    """Mount `POST /v1/completions`."""

    @app.post("/v1/completions", dependencies=ctx.auth)
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        request = to_request(body, ctx)
        ctx.ignore(http.url.path, body)
        writer = CompletionWriter(
            ctx.model_id,
            ctx.method,
            logprobs=body.logprobs is not None,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        return await ctx.respond(http, request, writer, stream=bool(body.stream))
