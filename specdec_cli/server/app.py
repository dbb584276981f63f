"""The ASGI app: each API's routes over the worker, with FastAPI, server-sent events (sse-starlette) and uvicorn.

Routes: GET /health, GET /v1/models (and /v1/models/{id}), and each translator's: POST /v1/chat/completions
(`openai_chat`), POST /v1/completions (`openai_completions`), POST /v1/responses and GET /v1/responses/{id}
(`openai_responses`), POST /v1/messages and /v1/messages/count_tokens (`anthropic_messages`), POST /infill
(`llama_infill`: llama.cpp's fill-in-the-middle, for editors). A translator turns its API's body into the one internal
`request.Request` and the reply's events into its wire format; `http.Context.respond` does the rest, the same for
every API. Errors leave in the shape of the API they were sent to (`http.Context.error_body`): an invalid field or
what the engine cannot honour is a 400 naming it, never 422.

Shaped after llama-cpp-python's server (`llama_cpp/server/app.py`: FastAPI + `EventSourceResponse`, Bearer key,
OpenAI error JSON) and vLLM's OpenAI server (validation errors answered in OpenAI's error shape).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from specdec_cli import __version__
from specdec_cli.server import anthropic_messages, llama_infill, openai_chat, openai_completions, openai_responses
from specdec_cli.server.access import AccessGuard, HostCheck, OriginCheck, cors_options
from specdec_cli.server.errors import ApiError, internal, openai_error_body, to_api_error
from specdec_cli.server.http import Context, json_error
from specdec_cli.server.request import Defaults
from specdec_cli.server.worker import Worker

# each mounts its routes: `routes(app, ctx)`
TRANSLATORS = (openai_chat, openai_completions, openai_responses, anthropic_messages, llama_infill)
BODY_TIMEOUT_S = 30.0  # a request body pausing longer between two parts is a slow client's: 408


def create_app(
    worker: Worker,
    *,
    defaults: Defaults = Defaults(),
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int | None = None,
    bind_host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
    body_timeout: float = BODY_TIMEOUT_S,
) -> FastAPI:
    """The app serving `worker`'s model.

    Args:
        defaults: sampling and max tokens for requests that leave them out.
        api_key: a key or several; when set, every /v1 route needs `Authorization: Bearer KEY` or `x-api-key: KEY`
            (Anthropic's header; 401 otherwise); /health does not. A request's key is its scope (`Request.scope`):
            the caches of one key's conversations never serve another's.
        max_body_bytes: larger request bodies get 413 (default: 64 bytes per context token, at least 1 MiB).
        bind_host, allowed_hosts, cors_origins: who may reach it (`access`): on a loopback `bind_host` only local
            `Host` names and `allowed_hosts`; browser `Origin`s only those `cors_origins` allows (403 otherwise).
        body_timeout: seconds a request body may pause between two of its parts (408 after).
    """
    service = worker.service
    model_id, method, n_ctx = service.model_id, service.method, service.n_ctx
    created = int(time.time())
    app = FastAPI(title="specdec serve", version=__version__, docs_url=None, redoc_url=None)
    ctx: Context  # made below, once the routes' dependencies exist
    error_body = lambda path, err: ctx.error_body(path, err)  # noqa: E731 (ctx is made below)
    app.state.error_body = error_body  # for `make_server`'s refusals beyond --max-connections
    # middleware added last runs first: the access check, then CORS, then the body limit
    app.add_middleware(
        BodyLimit, max_bytes=max_body_bytes or max(1 << 20, 64 * n_ctx), error_body=error_body, timeout=body_timeout
    )
    origins = OriginCheck(cors_origins)
    app.add_middleware(CORSMiddleware, **cors_options(origins))
    app.add_middleware(AccessGuard, hosts=HostCheck(bind_host, allowed_hosts), origins=origins, error_body=error_body)

    # -- authentication ----------------------------------------------------------------------------------------------
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())

    async def authenticate(request: Request) -> None:
        if not keys:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        bearer = credentials.strip() if scheme.lower() == "bearer" else None
        for given in (bearer, request.headers.get("x-api-key")):
            if given is None:
                continue
            match = None
            for key in keys:  # every key compared, in constant time
                if secrets.compare_digest(given.encode(), key.encode()):
                    match = key
            if match is not None:
                request.state.key_scope = hashlib.blake2b(match.encode(), digest_size=8).hexdigest()
                return
        raise ApiError(
            401,
            "Invalid or missing API key: send the header `Authorization: Bearer KEY` (or "
            "`x-api-key: KEY`) with the key given to specdec serve --api-key.",
            code="invalid_api_key",
        )

    ctx = Context(worker, defaults, auth=[Depends(authenticate)])

    # -- errors: everything leaves as its API's error JSON --------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return json_error(ctx, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return json_error(ctx, request.url.path, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            routes = [cast(APIRoute, r) for r in app.routes]  # (routes with methods have a path)
            paths = ", ".join(
                sorted(
                    {
                        f"{m} {r.path}"
                        for r in routes
                        for m in getattr(r, "methods", ())
                        if m in ("GET", "POST") and r.path != "/v1/models/{name}"
                    }
                )
            )
            message = f"Unknown path {request.url.path}. specdec serve offers {paths}."
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(
            ctx.error_body(request.url.path, err), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        worker.log(f"{request.url.path}: {internal(exc)}")  # the client gets no internal message
        return json_error(ctx, request.url.path, to_api_error(exc))

    # -- routes ----------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        """{"status": "ok", "model", "method", "busy", "queued", "queue": `Worker.status()` (waiting, bound, lanes,
        each running request's age and tokens, the Retry-After a refused request would get), and with a real model
        "kv": `GenerationService.kv_memory()` (lanes, tokens per lane, bytes per token, bytes in all; for a recurrent
        or hybrid target its kind, rollback and recurrent-state snapshots' bytes per lane)}."""
        queue = worker.status()
        body = {
            "status": "ok",
            "model": model_id,
            "method": method,
            "busy": queue["running"] is not None,
            "queued": queue["waiting"],
            "queue": queue,
        }
        kv = worker.service.kv_memory()
        if kv["bytes"] or kv.get("kind"):  # a recurrent or hybrid target: its snapshots' memory too
            body["kv"] = kv
        return body

    @app.get("/v1/models", dependencies=ctx.auth)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_id, created)]}

    @app.get("/v1/models/{name}", dependencies=ctx.auth)
    async def model(name: str) -> dict:
        if name != model_id:
            raise ApiError(
                404,
                f"The model {name!r} does not exist: this server serves {model_id!r}.",
                param="model",
                code="model_not_found",
            )
        return _model_card(model_id, created)

    for translator in TRANSLATORS:
        translator.routes(app, ctx)
    return app


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specdec"}


def validation_error(errors: Sequence[dict]) -> ApiError:
    """The error for pydantic's validation errors: 400 `invalid_request_error`, for a body that is not JSON (code
    invalid_json) or naming the invalid field (`param`, e.g. "messages.0.role") and what is wrong with it, as OpenAI
    answers (its client raises BadRequestError); never 422."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(
            400,
            f"The request body is not valid JSON: {first.get('msg', '')} (at character {loc[0] if loc else '?'}).",
            code="invalid_json",
        )
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # as OpenAI answers a field it does not know
        return ApiError(
            400,
            f"Unrecognized request argument supplied: {param}. specdec serve implements OpenAI's "
            "fields (and top_k, min_p); leave it out.",
            param=param,
            code="unknown_parameter",
        )
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return ApiError(400, f"{where}{first.get('msg', 'invalid value')}{more}.", param=param, code="invalid_value")


@dataclass
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 (read up to the limit, then replayed to the app),
    one that pauses more than `timeout` seconds between two parts 408 (a slow client must not hold a connection), its
    JSON made by `error_body(path, error)` (the API's shape; default: OpenAI's)."""

    app: Callable
    max_bytes: int
    error_body: Callable[[str, ApiError], dict] = openai_error_body
    timeout: float = BODY_TIMEOUT_S

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        too_large = length is not None and length.isdigit() and int(length) > self.max_bytes
        body = bytearray()
        while not too_large:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                err = ApiError(
                    408, f"The request body paused for more than {self.timeout:g} s.", code="request_timeout"
                )
                await JSONResponse(
                    self.error_body(scope.get("path", ""), err), status_code=408, headers={"Connection": "close"}
                )(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            too_large = len(body) > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            err = ApiError(
                413,
                f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
                code="request_too_large",
            )
            await JSONResponse(self.error_body(scope.get("path", ""), err), status_code=413)(scope, receive, send)
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


HEADER_TIMEOUT_S = 10.0  # a connection must send a request's headers within this (slowloris), seconds
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this, seconds (uvicorn's default)
MAX_CONNECTIONS = 128  # open connections at once (`--max-connections`); beyond: 503 (`_protocol`)


def make_server(
    app: FastAPI,
    *,
    on_exit: Callable[[], None] | None = None,
    log_level: str = "warning",
    max_connections: int = MAX_CONNECTIONS,
    header_timeout: float = HEADER_TIMEOUT_S,
):
    """A uvicorn `Server` for `app` (no access log: the worker logs one line per request). `on_exit` runs first when
    a signal (Ctrl-C, SIGTERM) asks the server to stop, so running generations end after their current step.

    Slow clients are bounded: a connection that has not sent a whole request's headers `header_timeout` seconds after
    it opened (or after its last response) is closed (uvicorn has no such timeout), an idle one after `KEEP_ALIVE_S`,
    and at most `max_connections` are served at once: a request beyond gets 503 in its API's error shape (the app's
    `state.error_body`; uvicorn's own `limit_concurrency` answers plain text) and its connection is closed."""
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

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        http=_protocol(header_timeout, max_connections, getattr(app.state, "error_body", lambda path, err: err.body())),
    )
    return _Server(config)


def _protocol(timeout: float, max_connections: int, error_body: Callable[[str, ApiError], dict]) -> type:
    """uvicorn's h11 protocol, bounded:

    - a connection that sends no complete request headers within `timeout` seconds of opening or of its last
      response is closed (uvicorn's keep-alive timer stops at the first byte, so a client that sends a request a
      byte at a time would hold its connection forever);
    - a request that arrives while `max_connections` connections are open (its own included) or `max_connections`
      requests are under way gets 503 `too_many_connections` in its API's error shape (`error_body(path, error)`),
      with `Retry-After` and `Connection: close`, as uvicorn's `limit_concurrency` would but in plain text.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    async def refuse(scope, receive, send) -> None:
        error = ApiError(
            503,
            f"The server has {max_connections} connections open, its limit (specdec serve "
            "--max-connections); this one is closed. Retry in a moment, or start the server with a "
            "higher --max-connections.",
            type="server_error",
            code="too_many_connections",
        )
        await JSONResponse(
            error_body(scope.get("path", ""), error),
            status_code=503,
            headers={"Retry-After": "1", "Connection": "close"},
        )(scope, receive, send)

    class _Bounded(H11Protocol):
        _header_timer = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            app = self.app

            async def bounded(scope, receive, send) -> None:
                # as uvicorn counts: every open connection (this one too), the requests under way (this one's task
                # was added before it ran)
                if scope["type"] == "http" and (
                    len(self.connections) >= max_connections or len(self.tasks) > max_connections
                ):
                    await refuse(scope, receive, send)
                else:
                    await app(scope, receive, send)

            self.app = bounded

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting_after = self.cycle  # a request parsed after this replaces it

            def expire() -> None:
                if self.cycle is waiting_after and not self.transport.is_closing():
                    self.transport.close()

            self._header_timer = self.loop.call_later(timeout, expire)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # before a pipelined request is parsed (in super) and replaces the cycle
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    return _Bounded


def base_url(sock: socket.socket) -> str:
    """http://HOST:PORT/v1 of a bound socket."""
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/v1"
