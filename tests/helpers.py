"""The server harness shared by the serve tests: the fake-backend server (`serving`), its request helpers and a
backend that waits on a gate, a real server as a subprocess, the Qwen loopback server, and tool and grammar helpers.
Imports the server (FastAPI): a test module checks its optional dependencies (`pytest.importorskip`) first.

Test modules import from here and from `fakes`, never from one another.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from fakes import CHARS, EOS, FakeBackend, greedy_tokenize, hashed_logits, word
from specdec_cli.server.app import base_url, bind, create_app, make_server
from specdec_cli.server.request import Defaults
from specdec_cli.server.service import GenerationService
from specdec_cli.server.worker import Worker
from specdec_cli.session import Session, open_session
from specdec_cli.spec import ModelOptions, SpecOptions

DATA = Path(__file__).parent / "data"
CAPTURES = DATA / "captures"  # agents' requests in clients/agent_capture.py's format (README.md there)


# -- the fake-backend server -----------------------------------------------------------------------------------------
PROMPT = "w5 w9 w3 w17 w4 w22 w8"  # FakeBackend: chat template = the contents, "wN" = token N
PROMPT_TOKENS = [5, 9, 3, 17, 4, 22, 8]


def text_of(tokens) -> str:
    return b"".join(word(t) for t in tokens).decode("utf-8", "replace")


class SlowBackend(FakeBackend):
    """FakeBackend whose decode waits for `gate` and then sleeps `delay` s: requests that take a while."""

    def __init__(self, *args, delay: float = 0.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def decode(self, tokens, n_logits: int = 0):
        self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        return super().decode(tokens, n_logits)


class Served:
    def __init__(self, url: str, worker: Worker, backend: FakeBackend, lines: list[str], server=None) -> None:
        self.url, self.worker, self.backend, self.lines, self.server = url, worker, backend, lines, server

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=20, **kw)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON) of a plain HTTP request, for what the openai client will not send."""
        import http.client
        from urllib.parse import urlparse

        u = urlparse(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    def health(self) -> dict:
        return self.raw("GET", "/health")[1]

    def connections(self) -> int:
        """How many connections the server holds open (uvicorn's own count, as `--max-connections` reads it)."""
        return len(self.server.server_state.connections)

    def until(self, predicate, what: str, timeout: float = 10.0) -> None:
        """Wait until `predicate()` holds (`timeout`: only against a hang)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def wait(self, predicate, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if predicate(h):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting; /health = {h}")
            time.sleep(0.02)


@contextlib.contextmanager
def serving(
    backend: FakeBackend | None = None,
    *,
    method: str = "ngram",
    k: str = "4",
    queue: int = 16,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    session: Session | None = None,
    app_kw: dict | None = None,
    worker_kw: dict | None = None,
    server_kw: dict | None = None,
):
    """A server on a free loopback port, uvicorn in a background thread, over the real service on a fake backend.
    `app_kw`, `worker_kw`, `server_kw`: more arguments of `create_app`, `Worker` and `make_server`."""
    backend = backend if backend is not None else FakeBackend(hashed_logits)
    session = session if session is not None else Session(target=backend, target_path=Path("fake.gguf"))
    service = GenerationService(session, SpecOptions(method=method, k=k))
    lines: list[str] = []
    worker = Worker(service, bound=queue, log=lines.append, **(worker_kw or {}))
    sock = bind("127.0.0.1", 0)
    # greedy unless a request asks otherwise (`specdec serve --temperature 0`), so replies are known exactly
    server = make_server(
        create_app(
            worker, defaults=Defaults(temperature=0.0), api_key=api_key, max_body_bytes=max_body_bytes, **(app_kw or {})
        ),
        **(server_kw or {}),
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    worker.start()
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Served(base_url(sock), worker, backend, lines, server)
    finally:
        backend_gate = getattr(backend, "gate", None)
        if backend_gate is not None:
            backend_gate.set()
        worker.stop()
        server.should_exit = True
        thread.join(10)
        worker.join(10)
        service.close()
        sock.close()


def chat(client, content: str = PROMPT, **kw):
    return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": content}], **kw)


def start_blocking_request(s, backend: SlowBackend) -> threading.Thread:
    """A first request that holds the worker until `backend.gate` is set."""
    backend.gate.clear()
    t = threading.Thread(target=chat, args=(s.client(),), kwargs={"max_tokens": 3}, daemon=True)
    t.start()
    s.wait(lambda h: h["busy"])
    return t


# -- a real server as a subprocess -----------------------------------------------------------------------------------
def start_real_server(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`specdec serve -t MODEL ARGS` as a subprocess on a free loopback port: (the process, its base URL)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "SPECDEC_DEBUG": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec_cli", "serve", "-t", str(model), "--port", "0", "--threads", "2", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    url = None
    deadline = time.monotonic() + 120
    lines = []
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        proc.wait()
        raise AssertionError("".join(lines))
    return proc, url


# -- the Qwen loopback server, in this process ----------------------------------------------------------------------
@contextlib.contextmanager
def loopback(session, method: str):
    """The real service over `session` on a free loopback port, in this process: yields (service, openai client,
    base URL); stopped, and the session closed, after."""
    service = GenerationService(session, SpecOptions(method=method))
    worker = Worker(service, log=lambda line: None)
    sock = bind("127.0.0.1", 0)
    server = make_server(create_app(worker))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    worker.start()
    thread.start()
    while not server.started:
        time.sleep(0.05)
    import openai

    try:
        yield (
            service,
            openai.OpenAI(base_url=base_url(sock), api_key="unused", max_retries=0, timeout=600),
            base_url(sock),
        )
    finally:
        worker.stop()
        server.should_exit = True
        thread.join(30)
        worker.join(30)
        service.close()
        sock.close()


@contextlib.contextmanager
def qwen_server(target, *, ctx: int = 2048):
    """`target` (Qwen2.5-Coder) served on a loopback port in this process, method auto: yields (base URL, the
    service); stopped and closed after."""
    session = open_session(ModelOptions(target=str(target), ctx=ctx, threads=2, prompt_cache=False), method="auto")
    with loopback(session, "auto") as (service, _, url):
        yield url, service


# -- tools and grammars over the CHARS vocabulary -------------------------------------------------------------------
V = len(CHARS)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}, "unit": {"enum": ["C"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def tools_backend(**kw) -> FakeBackend:
    return FakeBackend(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=1024, **kw)


def scripted(reply: str, *markers: bytes):
    """Logits that write `reply` after the prompt's last marker (default "~"; the longest token that continues it:
    a grammar may force merges), then the end token."""
    markers = markers or (b"~",)

    def fn(prefix):
        text = b"".join(CHARS[int(t)] for t in prefix)
        start = max(text.rfind(m) + len(m) for m in markers if m in text)
        rest = reply.encode()[len(text) - start :]
        logits = np.full(V, -10.0, np.float32)
        for t, piece in enumerate(CHARS):
            if piece and rest.startswith(piece):
                logits[t] = len(piece)
        if not rest:
            logits[EOS] = 5.0
        return logits

    return fn


def matcher_accepts(lark: str, text: str) -> tuple[int, int, bool]:
    """(tokens of `text`, how many the grammar allows in a row, whether it is then complete)."""
    from llguidance import LLMatcher

    backend = tools_backend()
    tokens = greedy_tokenize(CHARS, text.encode(), set())
    m = LLMatcher(backend.lltokenizer(), LLMatcher.grammar_from_lark(lark), log_level=0)
    n = m.validate_tokens(tokens)
    m.consume_tokens(tokens[:n])
    return len(tokens), n, m.is_accepting()


def accepts(lark: str, text: str) -> bool:
    n, ok, complete = matcher_accepts(lark, text)
    return ok == n and complete


CODEX_GRAMMAR = (DATA / "codex-apply_patch.lark").read_text()  # Codex CLI 0.169's apply_patch grammar
