"""Who may reach the server: the `Host` it is asked by, the browser `Origin` it answers, and CORS.

A server on 127.0.0.1 is reachable from every web page the machine's browser opens: a page on a name that resolves
to 127.0.0.1 (DNS rebinding) sends `Host: evil.example`, and a page anywhere can send requests that need no
preflight. So, as Ollama's `allowedHostsMiddleware` and `OLLAMA_ORIGINS` do:

- On a loopback bind only local host names are answered: `localhost` (and `*.localhost`, which always resolves to
  loopback), `127.0.0.1`, `[::1]`, the name the server was bound to, and those of `--allowed-host` (`*`: any). A
  server bound to another address (`--host 0.0.0.0`, behind its API key) answers any `Host`.
- A request that carries an `Origin` (a browser's) is answered only when `--cors-origin` allows that origin (exact,
  `*` for any, or `http://localhost:*` for any port); its CORS preflight (`OPTIONS` with
  `Access-Control-Request-Method`) is answered by Starlette's `CORSMiddleware`, which also adds the CORS headers to
  the answers. Clients that are not browsers (the openai and anthropic SDKs, curl, Codex, Claude Code) send no
  `Origin`.

A refused request gets 403 in the error shape of the API it was sent to (`error_body`), before its body is read.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.responses import JSONResponse

from specdec_cli.server.errors import ApiError, openai_error_body

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """True for a bind address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a `Host` header, without its port: "127.0.0.1:8000" → "127.0.0.1", "[::1]:8000" → "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """Which `Host` names a server bound to `bind_host` answers.

    Args:
        bind_host: the address the server listens on (`--host`). Not loopback: every name is answered.
        allowed: more names (`--allowed-host`); "*" answers every name.
    """

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()) -> None:
        allowed = [host_name(a) for a in allowed]
        self.any = "*" in allowed or not is_loopback(bind_host)
        self.names = frozenset((*LOCAL_HOSTS, host_name(bind_host), *allowed))

    def __call__(self, header: str | None) -> bool:
        if self.any or header is None:  # no Host (HTTP/1.0): no browser sent it
            return True
        name = host_name(header)
        return name in self.names or name.endswith(".localhost")


class OriginCheck:
    """Which browser origins are answered (`--cors-origin`): exact origins ("https://app.example"), "*" (any), or a
    scheme and host with any port ("http://localhost:*")."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        self.patterns = [a.strip().rstrip("/").lower() for a in allowed if a.strip()]
        self.any = "*" in self.patterns
        self.exact = frozenset(p for p in self.patterns if not p.endswith(":*"))
        self.any_port = [re.escape(p[:-2]) + r"(:\d{1,5})?" for p in self.patterns if p.endswith(":*")]

    def __call__(self, origin: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any or origin in self.exact:
            return True
        return any(re.fullmatch(p, origin) for p in self.any_port)


@dataclass
class AccessGuard:
    """ASGI middleware: 403 for a `Host` that `hosts` refuses or an `Origin` that `origins` refuses, in the API's
    error shape (`error_body(path, error)`); everything else goes to `app` (CORS headers: a `CORSMiddleware` inside)."""

    app: Callable
    hosts: HostCheck
    origins: OriginCheck
    error_body: Callable[[str, ApiError], dict] = openai_error_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        host = headers.get(b"host")
        origin = headers.get(b"origin")
        error = None
        host_name = host.decode("latin-1") if host is not None else None
        if not self.hosts(host_name):
            error = ApiError(
                403,
                f"Host {host_name!r} is not one this server answers: it listens on "
                "this machine only, for local names (localhost, 127.0.0.1, [::1]). Start specdec serve "
                "with --allowed-host NAME to answer another.",
                code="host_not_allowed",
            )
        elif origin is not None and not self.origins(origin.decode("latin-1")):
            error = ApiError(
                403,
                f"Origin {origin.decode('latin-1')!r} is not allowed: browser pages reach this "
                "server only from the origins of specdec serve --cors-origin.",
                code="origin_not_allowed",
            )
        if error is not None:
            body = self.error_body(scope.get("path", ""), error)
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def cors_options(origins: OriginCheck) -> dict:
    """Starlette `CORSMiddleware`'s options for `origins` (what `AccessGuard` lets through): every method and request
    header the APIs use, the Retry-After header readable, preflights cached 10 minutes."""
    regex = "|".join(origins.any_port) or None
    return dict(
        allow_origins=["*"] if origins.any else sorted(origins.exact),
        allow_origin_regex=regex,
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
        max_age=600,
    )
