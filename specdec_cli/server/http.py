"""Answering one HTTP request, whatever its API: submit the internal request, wait for it to start, then a JSON body
or a server-sent-event stream written by the dialect's `reply.Writer`.

A request is submitted to the worker (queue full: 429), and the handler waits for the worker's first event:
`Started` (the prompt fit and was evaluated) commits the response (200, streamed or not); `Failed` becomes the
dialect's error JSON (e.g. 400 `context_length_exceeded`). A stream is answered before its reply begins (200 and
headers, then SSE keep-alive comments) when it has to wait behind another request, or when its prompt takes longer
than `STREAM_COMMIT_S` to evaluate (an agent's long first prefill): an agent's read timeout must not fire meanwhile;
an error after that travels in the stream, in the API's shape (the writer's `failure`). A client that goes away is
noticed (its `http.disconnect`:
listened for by the handler until a stream starts, then by sse-starlette) and its generation is cancelled at the next
step, freeing the worker.

Shaped after llama-cpp-python's server (`llama_cpp/server/app.py`: FastAPI + `EventSourceResponse`) and mlx-lm's
`server.py`, which consumes the same stream of records for every route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from specdec_cli.server.errors import ApiError, to_api_error
from specdec_cli.server.fields import Ignored
from specdec_cli.server.jobs import Delta, Done, Event, Failed, Job, Started
from specdec_cli.server.reply import Writer
from specdec_cli.server.request import Defaults, Request
from specdec_cli.server.worker import Worker

ErrorBody = Callable[[ApiError], dict]  # an API's error JSON for an ApiError
# A stream whose prompt is still being evaluated after this many seconds is answered (200) before its reply begins,
# with keep-alive comments meanwhile: coding agents' clients give up on a response whose headers take 300 s (Claude
# Code's Bun fetch, Codex's stream_idle_timeout_ms), and a 20k-token prompt takes minutes on a CPU. A failure after
# that travels in the stream (the writer's `failure`), not as an HTTP status.
STREAM_COMMIT_S = 10.0
KEEPALIVE_S = 5  # seconds between SSE keep-alive comments while a stream waits (in the queue, or for its prefill)


@dataclass
class Context:
    """What a translator's routes need from the app.

    Attributes:
        worker: the serving thread (its `service` holds the model).
        defaults: the server's defaults for what a request leaves out.
        auth: FastAPI dependencies every /v1 route takes (the API key check).
        error_bodies: path prefix → the error JSON of the API served there (`register_errors`); OpenAI's elsewhere.
    """

    worker: Worker
    defaults: Defaults = field(default_factory=Defaults)
    auth: list[Any] = field(default_factory=list)
    error_bodies: dict[str, ErrorBody] = field(default_factory=dict)
    ignored: Ignored = field(default_factory=Ignored)

    def ignore(self, path: str, body: Any) -> None:
        """Log, once per name, the fields of `body` (a pydantic wire model with `extra="allow"`) and of its
        `messages` that nobody here knows: accepted and ignored (`fields.FIELDS`, "any other field")."""
        names = list(body.model_extra or ())
        for m in getattr(body, "messages", None) or ():
            names.extend(f"messages[].{n}" for n in (getattr(m, "model_extra", None) or ()) if n != "cache_control")
        for name in self.ignored.note(names):
            self.worker.log(
                f"{path}: field {name!r} is not one specdec serve knows: accepted and ignored (logged once)"
            )

    @property
    def service(self):
        return self.worker.service

    @property
    def model_id(self) -> str:
        return self.worker.service.model_id

    @property
    def method(self) -> str:
        return self.worker.service.method

    @property
    def n_ctx(self) -> int:
        return self.worker.service.n_ctx

    def register_errors(self, prefix: str, body: ErrorBody) -> None:
        """Errors of requests whose path starts with `prefix` are answered with `body(error)` (the API's own shape)."""
        self.error_bodies[prefix] = body

    def error_body(self, path: str, error: ApiError) -> dict:
        """The error JSON for a request to `path`: its API's shape (`register_errors`), else OpenAI's."""
        for prefix, body in self.error_bodies.items():
            if path.startswith(prefix):
                return body(error)
        return error.body()

    async def respond(
        self,
        http: HttpRequest,
        request: Request,
        writer: Writer,
        *,
        stream: bool,
        on_start: Callable[[Started], None] | None = None,
    ) -> Response:
        """Serve `request` and answer in `writer`'s wire format: a JSON body, or a stream of events.

        `on_start` is called with the worker's `Started` (prompt tokens, how many were cached) before the writer
        writes anything, for a wire format that opens with the prompt's usage (Anthropic's `message_start`).

        The request is checked (`GenerationService.check`: the grammar of its tools and output format) and its prompt
        rendered and tokenized (`GenerationService.tokenized`: apart from the decoding thread, which only decodes)
        before it is queued, so a bad request is a 400 without waiting. Raises ApiError: the request failed before its
        reply began (the app's handlers answer it in the API's shape).
        """
        worker, service = self.worker, self.service
        request = replace(request, scope=getattr(http.state, "key_scope", None))  # the API key's (authenticate)
        param = "messages" if request.is_chat else "prompt"
        # the grammar of 1,500 tools takes a second to compile, a long conversation's template and tokenizing tens of
        # ms: off the event loop (so /health and streams go on) and off the worker (so generations go on)
        try:
            request = await asyncio.to_thread(lambda: service.tokenized(service.check(request)))
        except Exception as e:  # a bad tool or schema, a template that refused the conversation (400) or failed
            api = to_api_error(e, param=param)
            if api.status >= 500:
                raise  # a bug: the app's handler logs it
            worker.log(f"{request.label}: error {api.status}: {api.message}")
            raise api from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:  # on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            job = worker.submit(request, deliver)
        except Exception as e:  # QueueFullError (429), ShuttingDownError (503)
            raise to_api_error(e) from None
        reply = job.reply  # parsed and collected on the worker thread; complete once `Done` came
        # Until the response streams, this handler listens for the client's disconnect (then sse-starlette does).
        if stream and worker.ahead(job):  # waiting behind another: headers now, keep-alive comments meanwhile
            return EventSourceResponse(
                _stream(events, worker, job, writer, on_start=on_start, queued=worker.ahead(job)),
                sep="\n",
                ping=KEEPALIVE_S,
            )
        watcher = asyncio.ensure_future(_cancel_on_disconnect(http, worker, job))
        try:
            try:
                first = await asyncio.wait_for(events.get(), STREAM_COMMIT_S if stream else None)
            except TimeoutError:  # a long prefill: answer now, keep-alive comments until the reply begins
                return EventSourceResponse(
                    _stream(events, worker, job, writer, on_start=on_start), sep="\n", ping=KEEPALIVE_S
                )
            if isinstance(first, Failed):
                raise to_api_error(first.error, param=param)
            if on_start is not None and isinstance(first, Started):
                on_start(first)
            if stream:
                return EventSourceResponse(_stream(events, worker, job, writer, started=True), sep="\n", ping=15)
            while True:
                event = await events.get()
                if isinstance(event, Done):
                    assert reply is not None  # (a job's reply is set before it runs)
                    return JSONResponse(writer.body(reply))
                elif isinstance(event, Failed):
                    raise to_api_error(event.error, param=param)
        finally:
            watcher.cancel()


async def _cancel_on_disconnect(http: HttpRequest, worker: Worker, job: Job) -> None:
    """Wait for the client's `http.disconnect` (the body is already read), then cancel `job`."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            worker.cancel(job)
            return


async def _stream(
    events: asyncio.Queue,
    worker: Worker,
    job: Job,
    writer: Writer,
    *,
    started: bool = False,
    on_start: Callable[[Started], None] | None = None,
    queued: int = 0,
):
    """The server-sent events of a stream: the writer's opening, its events for each reply event, its closing. A
    failure mid-stream is the writer's `failure`. When the client disconnects, sse-starlette cancels this generator;
    `finally` cancels the generation.

    Not `started`: the response was committed before the worker's `Started` (waiting in the queue, or a prompt still
    being evaluated after `STREAM_COMMIT_S`); `Started` (or `Failed`: the writer's `failure`) comes first, meanwhile
    sse-starlette's keep-alive comments flow. `queued` > 0: `queued` requests were ahead of this one; a comment says
    so at once (`: queued N`)."""
    try:
        if queued:
            yield ServerSentEvent(comment=f"queued {queued}")
        if not started:
            first = await events.get()
            if isinstance(first, Failed):
                for sse in writer.failure(to_api_error(first.error)):
                    yield sse
                return
            if on_start is not None and isinstance(first, Started):
                on_start(first)
        for sse in writer.opening():
            yield sse
        while True:
            event = await events.get()
            if isinstance(event, (Delta, Done)):
                batch = event.events
            elif isinstance(event, Failed):
                for sse in writer.failure(to_api_error(event.error)):
                    yield sse
                return
            else:
                continue
            for e in batch:
                for sse in writer.events(e):
                    yield sse
            if isinstance(event, Done):
                for sse in writer.closing():
                    yield sse
                return
    finally:
        worker.cancel(job)  # finished: no-op; client gone: the worker stops it at its next step


def json_error(ctx: Context, path: str, error: ApiError) -> JSONResponse:
    """`error` as the JSON response of the API served at `path`."""
    return JSONResponse(ctx.error_body(path, error), status_code=error.status, headers=getattr(error, "headers", None))
