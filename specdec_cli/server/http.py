"""Answering one HTTP request, whatever its API: submit the internal request, wait for it to start, then a JSON body
or a server-sent-event stream written by the dialect's `reply.Writer`.

A request is submitted to the worker (queue full: 429), and the handler waits for the worker's first event:
`Started` (the prompt fit and was evaluated) commits the response (200, streamed or not); `Failed` becomes the
dialect's error JSON (e.g. 400 `context_length_exceeded`). A client that goes away is noticed (its `http.disconnect`:
listened for by the handler until a stream starts, then by sse-starlette) and its generation is cancelled at the next
step, freeing the worker.

Shaped after llama-cpp-python's server (`llama_cpp/server/app.py`: FastAPI + `EventSourceResponse`) and mlx-lm's
`server.py`, which consumes the same stream of records for every route.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from specdec_cli.server.errors import ApiError, to_api_error
from specdec_cli.server.reply import ReplyStream, Writer
from specdec_cli.server.request import Defaults, Request
from specdec_cli.server.worker import Delta, Done, Event, Failed, Job, Worker

ErrorBody = Callable[[ApiError], dict]  # an API's error JSON for an ApiError


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

    async def respond(self, http: HttpRequest, request: Request, writer: Writer, *, stream: bool) -> Response:
        """Serve `request` and answer in `writer`'s wire format: a JSON body, or a stream of events.

        The request is checked (`GenerationService.check`: the grammar of its tools and output format) before it is
        queued, so a bad request is a 400 without waiting. Raises ApiError: the request failed before its reply began
        (the app's handlers answer it in the API's shape).
        """
        worker, service = self.worker, self.service
        request = service.check(request)
        reply = ReplyStream(service.parser(request))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:  # on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        param = "messages" if request.is_chat else "prompt"
        try:
            job = worker.submit(request, deliver)
        except Exception as e:  # QueueFullError (429), ShuttingDownError (503)
            raise to_api_error(e) from None
        # Until the response streams, this handler listens for the client's disconnect (then sse-starlette does).
        watcher = asyncio.ensure_future(_cancel_on_disconnect(http, worker, job))
        try:
            first = await events.get()
            if isinstance(first, Failed):
                raise to_api_error(first.error, param=param)
            if stream:
                return EventSourceResponse(_stream(events, worker, job, writer, reply), sep="\n", ping=15)
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    reply.delta(event.text, event.logprobs)
                elif isinstance(event, Done):
                    reply.done(event.stats)
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


async def _stream(events: asyncio.Queue, worker: Worker, job: Job, writer: Writer, reply: ReplyStream):
    """The server-sent events of a stream: the writer's opening, its events for each reply event, its closing. A
    failure mid-stream is the writer's `failure`. When the client disconnects, sse-starlette cancels this generator;
    `finally` cancels the generation."""
    try:
        for sse in writer.opening():
            yield sse
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                batch = reply.delta(event.text, event.logprobs)
            elif isinstance(event, Done):
                batch = reply.done(event.stats)
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
