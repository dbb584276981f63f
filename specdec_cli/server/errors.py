"""Errors as OpenAI's API sends them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

`ERROR_TABLE` is the one place that maps exceptions (specdec's domain errors from `specdec_cli.errors`, and the
server's own) to a status, an error type and a code; `to_api_error` applies it. Anything not in the table is a bug:
500, and the server goes on serving. The openai client turns the status into its exception class (400
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 413 APIStatusError, 429
RateLimitError, 5xx InternalServerError) and `error.message` into its message.
"""

from __future__ import annotations

import json
from typing import Any

from specdec_cli.errors import BackendError, ContextOverflowError, SpecdecError, UsageError

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    """An error to send as it is: HTTP `status` and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # sent with the status (429's Retry-After)

    def body(self) -> dict:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def openai_error_body(path: str, error: ApiError) -> dict:
    """`error`'s JSON in OpenAI's shape whatever the `path`: the middlewares' default `error_body`."""
    return error.body()


class QueueFullError(Exception):
    """The request queue is at its bound (`specdec serve --queue`).

    Attributes:
        retry_after: whole seconds until a place is likely free (`Worker.retry_after`), at least 1: sent as the
            429's `Retry-After` header, which the openai client and others honour.
    """

    def __init__(self, bound: int, retry_after: int = 1) -> None:
        self.retry_after = max(1, int(retry_after))
        super().__init__(
            f"The server is busy: {bound} requests are already waiting (specdec serve --queue {bound}). "
            f"Retry in {self.retry_after} s."
        )


class ShuttingDownError(Exception):
    """The server is stopping (Ctrl-C / SIGTERM); the request was not served, or was cut short."""

    def __init__(self) -> None:
        super().__init__("The server is shutting down.")


class DeadlineError(Exception):
    """The request held the worker longer than `specdec serve --timeout` allows; it was stopped (in its prefill,
    between two chunks, or between two steps of its reply)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"The request took longer than this server's limit of {timeout:g} s (specdec serve "
            "--timeout) and was stopped. Ask for fewer tokens (max_tokens) or a shorter prompt; a retry "
            "finds the prompt evaluated so far in the cache."
        )


class ClientGoneError(Exception):
    """The client disconnected; its request was dropped or stopped (the status is only logged: nobody reads it)."""

    def __init__(self) -> None:
        super().__init__("The client disconnected.")


# (exception class, HTTP status, OpenAI error type, code); the first row whose class matches wins (subclasses first).
ERROR_TABLE: tuple[tuple[type[BaseException], int, str, str | None], ...] = (
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (ShuttingDownError, 503, SERVER, "shutting_down"),
    (ClientGoneError, 499, INVALID, "client_gone"),  # nginx's "client closed request"
    (DeadlineError, 408, INVALID, "request_timeout"),
    (ContextOverflowError, 400, INVALID, "context_length_exceeded"),
    (UsageError, 400, INVALID, None),
    (BackendError, 500, SERVER, "backend_error"),
    (SpecdecError, 500, SERVER, None),
)


def to_api_error(exc: BaseException, *, param: str | None = None) -> ApiError:
    """The `ApiError` for `exc` (an `ApiError` is returned as is).

    Args:
        param: the request field the error is about, for errors about the prompt ("messages" or "prompt").
    """
    if isinstance(exc, ApiError):
        return exc
    for cls, status, type_, code in ERROR_TABLE:
        if isinstance(exc, cls):
            retry = getattr(exc, "retry_after", None)
            return ApiError(
                status,
                str(exc),
                type=type_,
                code=code,
                param=param if cls in (ContextOverflowError, UsageError) else None,
                headers={"Retry-After": str(retry)} if retry is not None else None,
            )
    # the exception's own text stays in the server's log (`internal`): it may name files, limits or code
    return ApiError(
        500,
        "Internal error: a bug in specdec, logged by the server (SPECDEC_DEBUG=1 logs the "
        "traceback); the server goes on.",
        type=SERVER,
        code="internal_error",
    )


def internal(exc: BaseException) -> str:
    """What the server's log says of `exc` when its client got `to_api_error`'s message: for a bug (500), the
    exception's class and text, which the client is not sent."""
    api = to_api_error(exc)
    return f"{api.message} ({type(exc).__name__}: {exc})" if api.code == "internal_error" else api.message


def loads(text: str, param: str) -> Any:
    """`json.loads(text)` for a client's JSON inside a field (a past call's arguments). Raises json.JSONDecodeError
    as json.loads does, and ApiError (400 naming `param`) for JSON nested deeper than Python parses (json.loads's
    RecursionError, which would otherwise be a 500)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ApiError(400, f"{param} is JSON nested too deeply to read.", param=param) from None
