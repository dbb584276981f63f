"""`specdec serve`: load the models once, then serve OpenAI's API on a local port until Ctrl-C / SIGTERM."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from typing import Iterator, Optional

from specdec_cli.errors import UsageError
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions


def execute(*, models: ModelOptions, spec: SpecOptions, defaults, host: str, port: int, api_key: Optional[str],
            queue: int) -> int:
    """Serve until a signal; save what was learnt; return 0.

    `defaults`: a `specdec_cli.server.request.Defaults` (sampling and max tokens for requests that leave them out).
    Raises UsageError (missing extra, bad --k, port unavailable), and what `open_session` raises.
    """
    require_extra()
    from specdec_cli.assemble import tuned_k
    from specdec_cli.cli.console import RichReporter, err_console
    from specdec_cli.cli.render import announce_tuned_k
    from specdec_cli.server.app import base_url, create_app, make_server
    from specdec_cli.server.service import GenerationService
    from specdec_cli.server.worker import Worker

    sock = _bind(host, port)  # before loading a model: a port in use fails at once
    err = err_console()
    try:
        session = open_session(models, method=spec.method, reporter=RichReporter(err))
        try:
            session.verify_curve()  # measured before the first request when this machine has none
            saved_k = tuned_k(session, spec)
            announce_tuned_k(err, saved_k)
            service = GenerationService(session, spec, saved_k=saved_k)
        except BaseException:
            session.close()
            raise
    except BaseException:
        sock.close()
        raise

    worker = Worker(service, bound=queue)
    server = make_server(create_app(worker, defaults=defaults, api_key=api_key), on_exit=worker.stop)
    worker.start()
    err.print(f"specdec serve: {service.model_id} (--method {spec.method}) at {base_url(sock)}"
              f"{' (API key required)' if api_key else ''}; one line per request below; Ctrl-C stops.",
              highlight=False, markup=False)
    try:
        with _signals_handled_by_server():
            server.run(sockets=[sock])
    finally:
        worker.stop()  # the running request ends after its current step; waiting ones get 503
        worker.join(timeout=120)
        service.close()  # the suffix store and --k auto's controller are saved here
        sock.close()
    err.print("specdec serve: stopped; what was learnt is saved.", highlight=False, markup=False)
    return 0


def require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"specdec serve needs FastAPI, uvicorn and sse-starlette ({e.name} is missing).",
                         "Install them with: pip install 'specdec[serve]'") from None


def _bind(host: str, port: int) -> socket.socket:
    from specdec_cli.server.app import bind

    try:
        return bind(host, port)
    except socket.gaierror:
        raise UsageError(f"Unknown host {host!r}.", "Use --host 127.0.0.1 (this machine only) or an address of "
                         "this machine.") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"Port {port} on {host} is in use.", "Use another --port, or --port 0 for a free one.") \
                from None
        if e.errno == errno.EACCES:
            raise UsageError(f"Port {port} on {host} needs privileges.", "Use a port above 1023, or --port 0.") \
                from None
        raise UsageError(f"Cannot listen on {host}:{port}: {e.strerror or e}.",
                         "Check --host (an address of this machine) and --port.") from None


@contextlib.contextmanager
def _signals_handled_by_server() -> Iterator[None]:
    """While uvicorn serves, SIGINT/SIGTERM are its (it stops gracefully); after it returns, it re-raises the signal
    it caught under the handlers it found: make those no-ops, so a Ctrl-C or SIGTERM that stopped the server does not
    also kill the process before what was learnt is saved (exit 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: None)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
