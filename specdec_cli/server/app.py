"""The ASGI app: each API's routes over the worker, with FastAPI, server-sent events (sse-starlette) and uvicorn.

Routes: GET /health, GET /v1/models (and /v1/models/{id}), and each translator's: POST /v1/chat/completions
(`openai_chat`), POST /v1/completions (`openai_completions`). A translator turns its API's body into the one internal
`request.Request` and the reply's events into its wire format; `http.Context.respond` does the rest, the same for
every API. Errors leave in the shape of the API they were sent to (`http.Context.error_body`): an invalid field or
what the engine cannot honour is a 400 naming it, never 422.

Shaped after llama-cpp-python's server (`llama_cpp/server/app.py`: FastAPI + `EventSourceResponse`, Bearer key,
OpenAI error JSON) and vLLM's OpenAI server (validation errors answered in OpenAI's error shape).
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from specdec_cli import __version__
from specdec_cli.server import openai_chat, openai_completions
from specdec_cli.server.errors import ApiError, to_api_error
from specdec_cli.server.http import Context, json_error
from specdec_cli.server.request import Defaults
from specdec_cli.server.worker import Worker
from starlette.exceptions import HTTPException as StarletteHTTPException

TRANSLATORS = (openai_chat, openai_completions)  # each mounts its routes: `routes(app, ctx)`


def create_app(worker: Worker, *, defaults: Defaults = Defaults(), api_key: Optional[str] = None,
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

    # -- authentication ----------------------------------------------------------------------------------------------
    async def authenticate(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(credentials.strip().encode(), api_key.encode()):
            raise ApiError(401, "Invalid or missing API key: send the header `Authorization: Bearer KEY` with the "
                           "key given to specdec serve --api-key.", code="invalid_api_key")

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
            paths = ", ".join(sorted({f"{m} {r.path}" for r in app.routes for m in getattr(r, "methods", ())
                                      if m in ("GET", "POST") and r.path != "/v1/models/{name}"}))
            message = f"Unknown path {request.url.path}. specdec serve offers {paths}."
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        err = ApiError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(ctx.error_body(request.url.path, err), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return json_error(ctx, request.url.path, to_api_error(exc))

    # -- routes ----------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_id, "method": method, "busy": worker.busy, "queued": worker.queued}

    @app.get("/v1/models", dependencies=ctx.auth)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(model_id, created)]}

    @app.get("/v1/models/{name}", dependencies=ctx.auth)
    async def model(name: str) -> dict:
        if name != model_id:
            raise ApiError(404, f"The model {name!r} does not exist: this server serves {model_id!r}.",
                           param="model", code="model_not_found")
        return _model_card(model_id, created)

    for translator in TRANSLATORS:
        translator.routes(app, ctx)
    return app


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specdec"}


def validation_error(errors: list[dict]) -> ApiError:
    """The error for pydantic's validation errors: 400 `invalid_request_error`, for a body that is not JSON (code
    invalid_json) or naming the invalid field (`param`, e.g. "messages.0.role") and what is wrong with it, as OpenAI
    answers (its client raises BadRequestError); never 422."""
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

