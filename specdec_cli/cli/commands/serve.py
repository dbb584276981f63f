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
            queue: int, learn: tuple = ()) -> int:
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
    if learn:
        learn_in_background(learn, session.target_path, session.vocab_fingerprint(), err)
    err.print(startup_line(service.model_id, spec.method, base_url(sock), defaults, n_ctx=service.n_ctx,
                           api_key=bool(api_key)), highlight=False, markup=False)
    err.print(context_line(service.n_ctx), highlight=False, markup=False)
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


def learn_in_background(paths, model_path, fingerprint: str, err) -> threading.Thread:
    """`specdec serve --learn PATH`: `specdec learn PATH` in a daemon thread (its own vocab-only tokenizer, not the
    serving model), one line when it is done (or failed); each generation that starts after it drafts from it
    (`CorpusSet.refresh`)."""
    from specdec_cli.cli.commands.learn import LazyTokenizer, summary
    from specdec_cli.config import data_dir
    from specdec_cli.errors import reason
    from specdec_cli.learn import learn

    def run() -> None:
        tok = LazyTokenizer(model_path, data_dir())
        try:
            report = learn(list(paths), tokenize=tok, fingerprint=fingerprint, data_dir=data_dir())
            err.print(f"specdec serve: {summary(report)}", highlight=False, markup=False)
        except Exception as e:  # a bad path, an unwritable data directory: serving goes on without it
            err.print(f"specdec serve: could not learn {', '.join(map(str, paths))}: {reason(e)}", highlight=False,
                      markup=False)
        finally:
            tok.close()

    thread = threading.Thread(target=run, name="specdec-learn", daemon=True)
    thread.start()
    return thread


AGENT_PROMPT_TOKENS = 25_000  # the longest coding-agent prompt seen (Claude Code 2.1's first request: ~20k tokens)


def context_line(n_ctx: int) -> str:
    """The start-up line about the context window: whether it holds a coding agent's prompt, else the --ctx that
    would."""
    if n_ctx >= AGENT_PROMPT_TOKENS:
        return f"context window: {n_ctx} tokens (holds coding agents' prompts: Claude Code's, Codex's)."
    return (f"context window: {n_ctx} tokens: too small for coding agents' prompts (Claude Code's ~20k tokens); "
            "use --ctx 32768.")


def startup_line(model_id: str, method: str, url: str, defaults, *, n_ctx: int, api_key: bool) -> str:
    """The one line `specdec serve` prints when it is ready: the model, method and URL, what a request that leaves
    sampling and max_tokens out gets (`defaults`: a `server.request.Defaults`), whether a key is required."""
    own = [f"{name} {value:g}" for name, value in (("temperature", defaults.temperature), ("top_p", defaults.top_p),
                                                   ("top_k", defaults.top_k), ("min_p", defaults.min_p))
           if value is not None]
    sampling = ", ".join(own) + " unless a request sets them" if own else \
        "temperature and top_p as each API documents (OpenAI's: 1 and 1)"
    cap = min(defaults.cap, n_ctx)
    key = " (API key required)" if api_key else ""
    return (f"specdec serve: {model_id} (--method {method}) at {url}{key}; {sampling}; at most {cap} tokens per "
            f"reply when a request sets no max_tokens (--max-tokens); one line per request below; Ctrl-C stops.")


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
