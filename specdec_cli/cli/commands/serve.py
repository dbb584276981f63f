"""`specdec serve`: load the models once, then serve OpenAI's API on a local port until Ctrl-C / SIGTERM."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.errors import UsageError
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions

KEY_ENV = "SPECDEC_SERVE_KEY"  # the server's key; no client reads it (SPECDEC_API_KEY is Codex's client key)
CLIENT_KEY_ENV = "SPECDEC_API_KEY"  # the README has Codex users export it (value `unused`): never the server's key
STOP_WAIT_S = 60.0  # a stopping server waits this long for the running request's current chunk or step


@dataclass(frozen=True)
class Access:
    """Who may reach the server and how long a request may take (`specdec serve`'s server options).

    Attributes:
        allowed_hosts: more `Host` names a loopback server answers (`--allowed-host`). cors_origins: the browser
            origins answered (`--cors-origin`). insecure_no_api_key: serve a non-loopback --host without a key.
        timeout: seconds a request may hold the model. max_connections: open connections at once.
        save_interval: seconds between two saves of what was learnt, at most.
    """

    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    insecure_no_api_key: bool = False
    timeout: float = 1800.0
    max_connections: int = 128
    save_interval: float = 300.0


def server_key(api_key: str | None, api_key_file: Path | None) -> tuple[str, ...]:
    """The keys the server accepts: `--api-key`, else each line of `--api-key-file` (one key per client: each key's
    conversations are cached apart), else $SPECDEC_SERVE_KEY; () for none. $SPECDEC_API_KEY is not read: it is the
    key clients send (Codex's `env_key`, often `unused`), and a shell that exported it must not start a server whose
    key everybody knows.

    Raises UsageError: the file cannot be read, or holds no key."""
    if api_key:
        return (api_key,)
    if api_key_file is not None:
        try:
            text = Path(api_key_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"Cannot read the key file {api_key_file} ({getattr(e, 'strerror', None) or e}).",
                "Give a readable file with one key per line.",
            ) from None
        keys = tuple(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))
        if not keys:
            raise UsageError(f"The key file {api_key_file} holds no key.", "Write one key per line.")
        return keys
    key = os.environ.get(KEY_ENV, "").strip()
    return (key,) if key else ()


def check_exposure(host: str, api_key: Sequence[str], insecure_no_api_key: bool) -> None:
    """Refuse to serve a non-loopback `host` without a key unless `insecure_no_api_key` confirms it: anyone who
    reaches the port would use the model. Raises UsageError (one line with both fixes)."""
    from specdec_cli.server.access import is_loopback

    if not api_key and not is_loopback(host) and not insecure_no_api_key:
        raise UsageError(
            f"--host {host} lets other machines reach the server, and it has no API key.",
            f"Give one with --api-key-file FILE (or {KEY_ENV}=...), or serve without one with --insecure-no-api-key.",
        )


def execute(
    *,
    models: ModelOptions,
    spec: SpecOptions,
    defaults,
    host: str,
    port: int,
    api_key: Sequence[str],
    queue: int,
    access: Access = Access(),
    learn: tuple = (),
) -> int:
    """Serve until a signal; save what was learnt; return 0.

    `defaults`: a `specdec_cli.server.request.Defaults` (sampling and max tokens for requests that leave them out).
    Raises UsageError (missing extra, bad --k, port unavailable, a non-loopback --host without a key), and what
    `open_session` raises.
    """
    require_extra()
    check_exposure(host, api_key, access.insecure_no_api_key)
    from specdec_cli.assemble import tuned_k
    from specdec_cli.cli.console import RichReporter, err_console
    from specdec_cli.cli.render import announce_tuned_k
    from specdec_cli.server.app import base_url, create_app, make_server
    from specdec_cli.server.saver import Saver
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
            service.prepare()  # the grammar tokenizer, built before the event loop runs (it holds the GIL)
        except BaseException:
            session.close()
            raise
    except BaseException:
        sock.close()
        raise

    worker = Worker(
        service, bound=queue, timeout=access.timeout, saver=Saver(service.save_learnt, interval=access.save_interval)
    )
    app = create_app(
        worker,
        defaults=defaults,
        api_key=api_key,
        bind_host=host,
        allowed_hosts=access.allowed_hosts,
        cors_origins=access.cors_origins,
    )
    server = make_server(app, on_exit=worker.stop, max_connections=access.max_connections)
    worker.start()
    if learn:
        learn_in_background(learn, session.target_path, session.vocab_fingerprint(), err)
    for line in (
        startup_line(
            service.model_id, spec.method, base_url(sock), defaults, n_ctx=service.n_ctx, api_key=bool(api_key)
        ),
        context_line(service.n_ctx),
        lanes_line(service.kv_memory(), spec.method),
        access_line(host, api_key, access),
        prompt_cache_line(service.session.prompt_cache),
    ):
        err.print(line, highlight=False, markup=False)
    if not api_key and os.environ.get(CLIENT_KEY_ENV):
        err.print(
            f"note: {CLIENT_KEY_ENV} is a client's variable and is not the server's key; give the server one "
            f"with --api-key-file or {KEY_ENV}.",
            highlight=False,
            markup=False,
        )
    try:
        with _signals_handled_by_server():
            server.run(sockets=[sock])
    finally:
        worker.stop()  # the running request ends within one prefill chunk or step; waiting ones get 503
        worker.join(timeout=STOP_WAIT_S)
        if worker.alive:  # llama.cpp is still in a call: freeing the models under it would crash
            err.print(
                f"specdec serve: the running request did not stop within {STOP_WAIT_S:g} s; exiting without "
                "saving (what was learnt is saved every --save-interval).",
                highlight=False,
                markup=False,
            )
            sys.stderr.flush()
            os._exit(1)
        service.close()  # the suffix store and --k auto's controller are saved here
        sock.close()
    err.print("specdec serve: stopped; what was learnt is saved.", highlight=False, markup=False)
    return 0


def access_line(host: str, api_key: Sequence[str], access: Access) -> str:
    """The start-up line that says who may reach the server and how to open it further."""
    from specdec_cli.server.access import is_loopback

    who = (
        "this machine only, for the Host names localhost, 127.0.0.1 and [::1]"
        + (f" and {', '.join(access.allowed_hosts)}" if access.allowed_hosts else " (--allowed-host adds one)")
        if is_loopback(host) and "*" not in access.allowed_hosts
        else f"every machine that reaches {host}"
    )
    key = (
        f"an API key required ({len(api_key)} keys, each one's conversations cached apart)"
        if len(api_key) > 1
        else "an API key required"
        if api_key
        else "no API key"
    )
    origins = ", ".join(access.cors_origins) if access.cors_origins else "none (--cors-origin allows one)"
    return f"access: {who}; {key}; browser origins: {origins}; a request may take {access.timeout:g} s (--timeout)."


def prompt_cache_line(cache) -> str:
    """The start-up line that says where finished prompts persist (a `PromptCache`, or None: not kept)."""
    if cache is None:
        return "prompt cache: off (--no-prompt-cache): nothing of a conversation is written to disk."
    return (
        f"prompt cache: every finished request's prompt and reply (their KV state) is saved to {cache.directory} "
        f"(up to {cache.max_bytes / 2**30:g} GiB) and reused after a restart; --no-prompt-cache turns it off, "
        "`specdec cache clear --only prompts` deletes it."
    )


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
            err.print(
                f"specdec serve: could not learn {', '.join(map(str, paths))}: {reason(e)}",
                highlight=False,
                markup=False,
            )
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
    return (
        f"context window: {n_ctx} tokens: too small for coding agents' prompts (Claude Code's ~20k tokens); "
        "use --ctx 32768."
    )


def lanes_line(kv: dict, method: str) -> str:
    """The start-up line about lanes: how many requests generate at once, and the KV cache they take
    (`GenerationService.kv_memory`)."""
    size = f"{kv['bytes'] / 2**30:.1f} GB" if kv["bytes"] >= 2**30 else f"{kv['bytes'] / 2**20:.0f} MB"
    memory = (
        f"; KV cache {size} ({kv['lanes']} x {kv['ctx']} tokens x {kv['bytes_per_token'] / 1024:.0f} KB)"
        if kv["bytes"]
        else ""
    )
    if kv.get("kind"):  # a recurrent or hybrid target: its state's snapshots, and how it rolls back
        memory += f"; {recurrent_note(kv)}"
    if kv["lanes"] == 1:
        return f"lanes: 1 (one request at a time; --parallel N serves N at once){memory}."
    note = "; a draft model drafts for lane 0 only" if method == "draft" else ""
    return (
        f"lanes: {kv['lanes']} requests at once (--parallel), sharing each forward pass, interactive ones "
        f"first{memory}{note}."
    )


def recurrent_note(kv: dict) -> str:
    """How a recurrent or hybrid target rolls back and what its snapshots take per lane (`GenerationService.kv_memory`
    of such a target)."""
    snap = kv.get("snapshot_bytes", 0)
    if kv["rollback"] == "snapshots":
        size = f"{snap / 2**20:.1f} MB" if snap >= 2**20 else f"{snap / 2**10:.0f} KB"
        return (
            f"a {kv['kind']} model: {kv['n_rs_seq']} recurrent-state snapshots per lane ({size} each lane), "
            f"drafts of at most {kv['n_rs_seq']} tokens"
        )
    if kv["rollback"] == "checkpoints":
        return f"a {kv['kind']} model: rolled back by checkpoint and replay (no snapshots for this architecture)"
    return f"a {kv['kind']} model that cannot roll back: plain decoding"


def startup_line(model_id: str, method: str, url: str, defaults, *, n_ctx: int, api_key: bool) -> str:
    """The one line `specdec serve` prints when it is ready: the model, method and URL, what a request that leaves
    sampling and max_tokens out gets (`defaults`: a `server.request.Defaults`), whether a key is required."""
    own = [
        f"{name} {value:g}"
        for name, value in (
            ("temperature", defaults.temperature),
            ("top_p", defaults.top_p),
            ("top_k", defaults.top_k),
            ("min_p", defaults.min_p),
        )
        if value is not None
    ]
    sampling = (
        ", ".join(own) + " unless a request sets them"
        if own
        else "temperature and top_p as each API documents (OpenAI's: 1 and 1)"
    )
    cap = min(defaults.cap, n_ctx)
    key = " (API key required)" if api_key else ""
    return (
        f"specdec serve: {model_id} (--method {method}) at {url}{key}; {sampling}; at most {cap} tokens per "
        f"reply when a request sets no max_tokens (--max-tokens); one line per request below; Ctrl-C stops."
    )


def require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(
            f"specdec serve needs FastAPI, uvicorn and sse-starlette ({e.name} is missing).",
            "Install them with: pip install 'specdec-cli[serve]'",
        ) from None


def _bind(host: str, port: int) -> socket.socket:
    from specdec_cli.server.app import bind

    try:
        return bind(host, port)
    except socket.gaierror:
        raise UsageError(
            f"Unknown host {host!r}.", "Use --host 127.0.0.1 (this machine only) or an address of this machine."
        ) from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                f"Port {port} on {host} is in use.", "Use another --port, or --port 0 for a free one."
            ) from None
        if e.errno == errno.EACCES:
            raise UsageError(
                f"Port {port} on {host} needs privileges.", "Use a port above 1023, or --port 0."
            ) from None
        raise UsageError(
            f"Cannot listen on {host}:{port}: {e.strerror or e}.",
            "Check --host (an address of this machine) and --port.",
        ) from None


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
