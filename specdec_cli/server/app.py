"""The ASGI app: OpenAI's routes over the worker, with FastAPI, server-sent events (sse-starlette) and uvicorn.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (and /v1/models/{id}), GET /health.

A request is validated (an invalid field, or what the engine cannot honour: 400 naming it), submitted to the worker (queue full:
429), and the handler waits for the worker's first event: `Started` (the prompt fit and was evaluated) commits the
response (200, streamed or not); `Failed` becomes the error JSON (e.g. 400 `context_length_exceeded`). A client that
goes away is noticed (its `http.disconnect`: listened for by the handler until a stream starts, then by
sse-starlette) and its generation is cancelled at the next step, freeing the worker.

Shaped after llama-cpp-python's server (`llama_cpp/server/app.py`: FastAPI + `EventSourceResponse`, Bearer key,
OpenAI error JSON) and vLLM's OpenAI server (validation errors answered in OpenAI's error shape).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_cli import __version__
from specdec_cli.server import schema
from specdec_cli.server.errors import ApiError, to_api_error
from specdec_cli.server.worker import Delta, Done, Event, Failed, GenRequest, Job, Started, Worker

def create_app(worker: Worker, *, defaults: schema.Defaults = schema.Defaults(), api_key: Optional[str] = None,
               max_body_bytes: Optional[int] = None) -> FastAPI:
    """The app serving `worker`'s model.

    Args:
        defaults: sampling and max tokens for requests that leave them out.
        api_key: when set, every /v1 route needs `Authorization: Bearer <api_key>` (401 otherwise); /health does not.
        max_body_bytes: larger request bodies get 413 (default: 64 bytes per context token, at least 1 MiB).
    """
    service = worker.service
    model_id, method, n_ctx = service.model_id, service.method, service.n_ctx
    created = int(time.time())
    app = FastAPI(title="specdec serve", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes or max(1 << 20, 64 * n_ctx))

    # -- errors: everything leaves as OpenAI's error JSON ---------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (f"Unknown path {request.url.path}. specdec serve offers POST /v1/chat/completions, "
                       "POST /v1/completions, GET /v1/models and GET /health.")
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    # -- authentication ----------------------------------------------------------------------------------------------
    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(credentials.strip().encode(), api_key.encode()):
            raise ApiError(401, "Invalid or missing API key: send the header `Authorization: Bearer KEY` with the "
                           "key given to specdec serve --api-key.", code="invalid_api_key")

    auth = [Depends(authenticate)]

    # -- routes ----------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, "method": method, "busy": worker.busy, "queued": worker.queued}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_id, created)]}

    @app.get("/v1/models/{name}", dependencies=auth)
    async def model(name: str) -> dict:
        if name != model_id:
            raise ApiError(404, f"The model {name!r} does not exist: this server serves {model_id!r}.",
                           param="model", code="model_not_found")
        return _model_card(model_id, created)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: schema.ChatRequest, request: Request) -> Response:
        tools = schema.chat_tools(body)
        config = schema.generation_config(body, defaults, n_ctx, tools=tools, tags=service.tool_tags)
        parse_calls = tools is not None and tools.mode != "none"
        gen = GenRequest("chat", config, messages=schema.chat_messages(body),
                         prediction=schema.prediction_text(body), tools=tools.specs if tools else (),
                         parse_calls=parse_calls)
        # a bare or fenced JSON call only under auto without response_format (`tools.grammar`)
        reply = schema.ChatReply(parse_calls, config.logprobs is not None,
                                 loose_calls=parse_calls and tools.mode == "auto" and body.response_format is None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(request, worker, gen, stream=bool(body.stream), include_usage=include_usage,
                              model_id=model_id, method=method, reply=reply)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: schema.CompletionRequest, request: Request) -> Response:
        config = schema.generation_config(body, defaults, n_ctx)
        gen = GenRequest("completion", config, prompt=schema.completion_prompt(body))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _respond(request, worker, gen, stream=bool(body.stream), include_usage=include_usage,
                              model_id=model_id, method=method)

    return app


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specdec"}


def validation_error(errors: list[dict]) -> ApiError:
    """OpenAI's error for pydantic's validation errors: 400 `invalid_request_error`, for a body that is not JSON
    (code invalid_json) or naming the invalid field (`param`, e.g. "messages.0.role") and what is wrong with it, as
    OpenAI answers (its client raises BadRequestError); never 422."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"The request body is not valid JSON: {first.get('msg', '')} "
                        f"(at character {loc[0] if loc else '?'}).", code="invalid_json")
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # as OpenAI answers a field it does not know
        return ApiError(400, f"Unrecognized request argument supplied: {param}. specdec serve implements OpenAI's "
                        "fields (and top_k, min_p); leave it out.", param=param, code="unknown_parameter")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}{first.get('msg', 'invalid value')}{more}.", param=param, code="invalid_value")


async def _respond(request: Request, worker: Worker, gen: GenRequest, *, stream: bool, include_usage: bool,
                   model_id: str, method: str, reply: Optional[schema.ChatReply] = None) -> Response:
    """Submit `gen`, wait for it to start, then answer: a JSON response, or a stream of chunks. `reply` assembles a
    chat reply (content, tool calls, logprobs); None for completions."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def deliver(event: Event) -> None:  # on the worker thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    param = "messages" if gen.kind == "chat" else "prompt"
    want_logprobs = gen.config.logprobs is not None
    try:
        job = worker.submit(gen, deliver)
    except Exception as e:  # QueueFullError (429), ShuttingDownError (503)
        raise to_api_error(e) from None
    # Until the response streams, this handler listens for the client's disconnect (then sse-starlette does).
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, worker, job))
    try:
        first = await events.get()
        if isinstance(first, Failed):
            raise to_api_error(first.error, param=param)
        writer = schema.ChunkWriter(gen.kind, model_id, include_usage)
        if stream:
            return EventSourceResponse(_chunks(events, worker, job, writer, method, reply, want_logprobs),
                                       sep="\n", ping=15)
        parts: list[str] = []
        logprobs: list = []
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                if reply is not None:
                    reply.add(event.text, event.logprobs)
                else:
                    parts.append(event.text)
                    logprobs.extend(event.logprobs)
            elif isinstance(event, Done):
                if reply is not None:
                    reply.end()
                    body = schema.chat_response(writer.id, model_id, writer.created, reply, event.stats, method)
                else:
                    body = schema.completion_response(writer.id, model_id, writer.created, "".join(parts),
                                                      event.stats, method, logprobs if want_logprobs else None)
                return JSONResponse(body)
            elif isinstance(event, Failed):
                raise to_api_error(event.error, param=param)
    finally:
        watcher.cancel()


async def _cancel_on_disconnect(request: Request, worker: Worker, job: Job) -> None:
    """Wait for the client's `http.disconnect` (the body is already read), then cancel `job`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            worker.cancel(job)
            return


async def _chunks(events: asyncio.Queue, worker: Worker, job: Job, writer: schema.ChunkWriter, method: str,
                  reply: Optional[schema.ChatReply], want_logprobs: bool):
    """The SSE data lines of a stream: the role chunk, content / tool-call / text chunks, the finish chunk (with
    `specdec`), the usage chunk when asked, `[DONE]`. A failure mid-stream is sent as `{"error": ...}` (the openai
    client raises APIError on it). When the client disconnects, sse-starlette cancels this generator; `finally`
    cancels the generation."""
    try:
        opening = writer.first()
        if opening is not None:
            yield json.dumps(opening)
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                if reply is None:
                    yield json.dumps(writer.text(event.text, event.logprobs if want_logprobs else None))
                    continue
                for chunk in writer.chat(reply, reply.add(event.text, event.logprobs), event.logprobs):
                    yield json.dumps(chunk)
            elif isinstance(event, Done):
                if reply is not None:
                    for chunk in writer.chat(reply, reply.end()):
                        yield json.dumps(chunk)
                yield json.dumps(writer.finish(event.stats, method, reply))
                if writer.include_usage:
                    yield json.dumps(writer.usage(event.stats))
                yield "[DONE]"
                return
            elif isinstance(event, Failed):
                yield json.dumps(to_api_error(event.error).body())
                return
    finally:
        worker.cancel(job)  # finished: no-op; client gone: the worker stops it at its next step


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 (read up to the limit, then replayed to the app)."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        too_large = length is not None and length.isdigit() and int(length) > self.max_bytes
        body = bytearray()
        while not too_large:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            too_large = len(body) > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            err = ApiError(413, f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
                           code="request_too_large")
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# -- running it ---------------------------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = a free port; read it back with `getsockname`).

    Raises OSError (address in use, permission denied, unknown host) for the caller to turn into a UsageError.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, *, on_exit: Callable[[], None] | None = None, log_level: str = "warning"):
    """A uvicorn `Server` for `app` (no access log: the worker logs one line per request). `on_exit` runs first when
    a signal (Ctrl-C, SIGTERM) asks the server to stop, so running generations end after their current step."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    # sse-starlette cuts every stream when uvicorn is asked to stop, mid-chunk. Here the worker's `stop` ends each
    # stream itself (a last `{"error": ...}` event with code shutting_down, after the current step), so its drain is
    # not needed; without it, streams end cleanly instead of as a truncated response.
    AppStatus.disable_automatic_graceful_drain()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=10,
                            lifespan="off")
    return _Server(config)


def base_url(sock: socket.socket) -> str:
    """http://HOST:PORT/v1 of a bound socket."""
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/v1"

