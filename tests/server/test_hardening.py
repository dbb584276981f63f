"""A server you can leave running (issue 35): who may reach it, what one request may take, slow clients, learning
saved as it goes, caches kept apart per key, and no internal message to a client. All on the fake backend."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import FakeBackend, hashed_logits  # noqa: E402
from helpers import PROMPT, PROMPT_TOKENS, SlowBackend, chat, serving  # noqa: E402
from specdec_cli.core.engine import GenerationConfig  # noqa: E402
from specdec_cli.errors import UsageError  # noqa: E402
from specdec_cli.server.access import HostCheck, OriginCheck, is_loopback  # noqa: E402
from specdec_cli.server.errors import ClientGoneError, DeadlineError, ShuttingDownError, internal, to_api_error  # noqa: E402,E501
from specdec_cli.server.jobs import Done, Failed, Started  # noqa: E402
from specdec_cli.server.request import Defaults, Request  # noqa: E402
from specdec_cli.server.saver import Saver  # noqa: E402
from specdec_cli.server.service import GenerationService  # noqa: E402
from specdec_cli.server.worker import Worker  # noqa: E402
from specdec_cli.session import Session  # noqa: E402
from specdec_cli.spec import SpecOptions  # noqa: E402

MESSAGES = {"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": PROMPT}]}


def raw(s, method, path, body=None, headers=None):
    """(status, headers, parsed JSON) of one plain request (the openai client sets Host and no Origin)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(s.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request(
            method,
            path,
            body=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        data = resp.read()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:  # a preflight's "OK"
            parsed = data.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
    finally:
        conn.close()


# -- 1. Host and Origin -----------------------------------------------------------------------------------------------
def test_a_forged_host_is_refused_with_403_in_each_apis_shape():
    with serving() as s:
        port = s.url.split(":")[2].split("/")[0]
        chat_status, _, chat_body = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Host": "evil.example"})
        msg_status, _, msg_body = raw(s, "POST", "/v1/messages", MESSAGES, {"Host": f"evil.example:{port}"})
        health, _, _ = raw(s, "GET", "/health", headers={"Host": "evil.example"})
        local = [
            raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Host": h})[0]
            for h in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "app.localhost")
        ]
    assert chat_status == 403 and chat_body["error"]["code"] == "host_not_allowed"
    assert "--allowed-host" in chat_body["error"]["message"]
    assert msg_status == 403 and msg_body["type"] == "error" and msg_body["error"]["type"] == "permission_error"
    assert health == 403
    assert local == [200] * 4


def test_allowed_host_and_a_non_loopback_bind_answer_other_names():
    with serving(app_kw={"allowed_hosts": ["box.lan"]}) as s:
        ok, _, _ = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Host": "box.lan:8000"})
        other, _, _ = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Host": "evil.example"})
    assert (ok, other) == (200, 403)
    assert HostCheck("0.0.0.0")("evil.example") and HostCheck("127.0.0.1", ["*"])("evil.example")
    assert not HostCheck("127.0.0.1")("localhost.evil.example")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


def test_browser_origins_only_as_cors_origin_allows_with_preflights():
    preflight = {
        "Origin": "http://localhost:5173",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with serving() as s:
        refused, _, refused_body = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Origin": "http://evil.example"})
        refused_pre, _, _ = raw(s, "OPTIONS", "/v1/chat/completions", None, preflight)
    with serving(app_kw={"cors_origins": ["http://localhost:*"]}) as s:
        pre, pre_headers, _ = raw(s, "OPTIONS", "/v1/chat/completions", None, preflight)
        ok, ok_headers, _ = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Origin": "http://localhost:5173"})
        other, _, _ = raw(s, "POST", "/v1/chat/completions", MESSAGES, {"Origin": "http://localhost.evil.example"})
    assert refused == 403 and refused_body["error"]["code"] == "origin_not_allowed"
    assert "--cors-origin" in refused_body["error"]["message"]
    assert refused_pre == 403
    assert pre == 200 and pre_headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in pre_headers["access-control-allow-methods"]
    assert "authorization" in pre_headers["access-control-allow-headers"].lower()
    assert ok == 200 and ok_headers["access-control-allow-origin"] == "http://localhost:5173"
    assert other == 403
    assert OriginCheck(["*"])("https://anything.example") and not OriginCheck([])("null")


# -- 2. a key for a server others can reach ----------------------------------------------------------------------------
def test_a_non_loopback_bind_without_a_key_is_refused_unless_confirmed(monkeypatch):
    from specdec_cli.cli.commands.serve import check_exposure

    with pytest.raises(UsageError) as refused:
        check_exposure("0.0.0.0", (), False)
    assert "--api-key-file" in str(refused.value) + refused.value.fix and "--insecure-no-api-key" in refused.value.fix
    check_exposure("0.0.0.0", ("k",), False)
    check_exposure("0.0.0.0", (), True)
    check_exposure("127.0.0.1", (), False)


def test_the_cli_refuses_before_loading_a_model(monkeypatch, capsys):
    from specdec_cli.cli import main

    monkeypatch.setenv("SPECDEC_API_KEY", "unused")  # a client's key (Codex): not the server's
    monkeypatch.delenv("SPECDEC_SERVE_KEY", raising=False)
    code = main(["serve", "--host", "0.0.0.0", "-t", "/nonexistent.gguf"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--insecure-no-api-key" in err and "--api-key-file" in err and "nonexistent" not in err


def test_the_server_key_never_comes_from_the_clients_variable(monkeypatch, tmp_path):
    from specdec_cli.cli.commands.serve import server_key

    monkeypatch.setenv("SPECDEC_API_KEY", "unused")
    monkeypatch.delenv("SPECDEC_SERVE_KEY", raising=False)
    assert server_key(None, None) == ()
    monkeypatch.setenv("SPECDEC_SERVE_KEY", "s3cret")
    assert server_key(None, None) == ("s3cret",)
    keys = tmp_path / "keys"
    keys.write_text("alice-key\n\nbob-key\n")
    assert server_key(None, keys) == ("alice-key", "bob-key")
    assert server_key("given", keys) == ("given",)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError):
        server_key(None, tmp_path / "empty")
    with pytest.raises(UsageError):
        server_key(None, tmp_path / "missing")


# -- 3. every request bounded ---------------------------------------------------------------------------------------
def test_every_api_caps_max_tokens_at_the_context_and_at_max_tokens():
    assert Defaults().limit(10**15, 512) == 512
    assert Defaults(max_tokens=100).limit(10**15, 512) == 100
    assert Defaults(max_tokens=100).limit(7, 512) == 7
    assert Defaults().limit(None, 512) == 512 and Defaults(max_tokens=100).limit(None, 512) == 100
    with serving() as s:
        resp = chat(s.client(), max_tokens=10**15)
        status, _, msg = raw(s, "POST", "/v1/messages", {**MESSAGES, "max_tokens": 10**15})
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.completion_tokens <= 512
    assert status == 200 and msg["usage"]["output_tokens"] <= 512


class GatedBackend(FakeBackend):
    """FakeBackend whose first decode call signals `first` and then waits for `go`: a long prefill, caught between
    its chunks."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.first, self.go = threading.Event(), threading.Event()
        self.calls: list[int] = []

    def decode(self, tokens, n_logits: int = 0):
        out = super().decode(tokens, n_logits)
        self.calls.append(len(tokens))
        if len(self.calls) == 1:
            self.first.set()
            self.go.wait(10)
        return out


def _worker(backend, **kw):
    service = GenerationService(
        Session(target=backend, target_path=Path("fake.gguf")), SpecOptions(method="none", k="4")
    )
    lines: list[str] = []
    return Worker(service, log=lines.append, **kw), lines


LONG = tuple(int(t) for t in np.arange(300) % 50 + 5)  # 300 prompt tokens: five chunks of n_batch 64


@pytest.mark.parametrize("how", ["cancel", "stop", "deadline"])
def test_a_long_prefill_stops_within_one_chunk(how):
    backend = GatedBackend(hashed_logits, n_batch=64)
    now = [0.0]  # the worker's clock, seconds: moved past the deadline by the test, not slept through
    worker, lines = _worker(backend, timeout=5.0 if how == "deadline" else None, clock=lambda: now[0])
    events: list = []
    got = threading.Event()
    worker.start()
    try:
        job = worker.submit(
            Request(config=GenerationConfig(max_tokens=5), prompt=LONG, label="completion"),
            lambda e: (events.append(e), got.set()),
        )
        assert backend.first.wait(10)
        if how == "cancel":
            worker.cancel(job)
        elif how == "stop":
            worker.stop()
        else:
            now[0] += 6.0  # past the deadline
        backend.go.set()
        worker.join(5) if how == "stop" else got.wait(10)
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        backend.go.set()
        worker.stop()
        worker.join(5)
    assert backend.calls == [64]  # the first chunk only: the rest of the 299 tokens were never evaluated
    assert isinstance(events[-1], Failed)
    expected = {"cancel": ClientGoneError, "stop": ShuttingDownError, "deadline": DeadlineError}[how]
    assert isinstance(events[-1].error, expected)
    assert not any(isinstance(e, Started) for e in events)
    assert len(backend.tokens) == 64  # the evaluated chunk stays in the cache for a retry
    if how == "cancel":  # the log says how long the worker went on, against what a chunk took (load_faults reads it)
        m = re.search(
            r"stopped ([\d.]+) s after the client left; its prefill's chunks took ([\d.]+) s at most", lines[0]
        )
        assert m and float(m.group(1)) <= float(m.group(2)), lines


def test_a_request_past_its_deadline_gets_408_in_each_apis_shape():
    backend = SlowBackend(hashed_logits, delay=0.02)
    with serving(backend, method="none", worker_kw={"timeout": 0.3}) as s:
        with pytest.raises(openai.APIStatusError) as late:
            chat(s.client(), max_tokens=400)
        status, _, msg = raw(s, "POST", "/v1/messages", {**MESSAGES, "max_tokens": 400})
        ok = chat(s.client(), max_tokens=2)  # the server goes on
    assert late.value.status_code == 408 and late.value.body["code"] == "request_timeout"
    assert "--timeout" in late.value.body["message"]
    assert status == 408 and msg["error"]["type"] == "timeout_error"
    assert ok.usage.completion_tokens == 2
    assert any("deadline" in line for line in s.lines)


# -- 4. slow clients --------------------------------------------------------------------------------------------------
def _port(s) -> int:
    return int(s.url.split(":")[2].split("/")[0])


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_connection_that_never_finishes_its_headers_is_closed():
    with serving(server_kw={"header_timeout": 0.5}) as s:
        slow = socket.create_connection(("127.0.0.1", _port(s)))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
        try:
            assert _closed_by_server(slow, within=10)
        finally:
            slow.close()
        assert s.health()["status"] == "ok"


def test_connections_beyond_the_limit_get_503():
    with serving(server_kw={"max_connections": 3}) as s:
        idle = [socket.create_connection(("127.0.0.1", _port(s))) for _ in range(2)]  # open, sending nothing
        try:
            s.until(lambda: s.connections() == 2, "the server's loop to accept the idle connections")
            status, _, _ = raw(s, "GET", "/health")
        finally:
            for c in idle:
                c.close()
        s.until(lambda: s.connections() == 0, "the server to drop the closed connections")
        after, _, _ = raw(s, "GET", "/health")
    assert (status, after) == (503, 200)


def test_connections_beyond_the_limit_get_503_in_each_apis_shape():
    with serving(server_kw={"max_connections": 3}) as s:
        idle = [socket.create_connection(("127.0.0.1", _port(s))) for _ in range(2)]  # open, sending nothing
        try:
            s.until(lambda: s.connections() == 2, "the server's loop to accept the idle connections")
            chat_status, chat_headers, chat_body = raw(s, "POST", "/v1/chat/completions", MESSAGES)
            msg_status, _, msg_body = raw(s, "POST", "/v1/messages", MESSAGES)
        finally:
            for c in idle:
                c.close()
    assert chat_status == 503 and chat_body["error"]["code"] == "too_many_connections"
    assert "--max-connections" in chat_body["error"]["message"]
    assert chat_headers["content-type"] == "application/json" and chat_headers["retry-after"] == "1"
    assert chat_headers["connection"] == "close"  # its place goes to the next connection
    assert msg_status == 503 and msg_body["type"] == "error" and msg_body["error"]["type"] == "overloaded_error"


def test_a_body_that_stalls_gets_408():
    with serving(app_kw={"body_timeout": 0.5}) as s:
        conn = socket.create_connection(("127.0.0.1", _port(s)))
        try:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"model":'
            )
            conn.settimeout(10)
            head = conn.recv(4096)
        finally:
            conn.close()
    assert head.startswith(b"HTTP/1.1 408")


def test_grammar_compilation_runs_off_the_event_loop(monkeypatch):
    from specdec_cli.server import reading, tools

    threads: dict[str, str] = {}
    real_check, real_params = GenerationService.check, tools.check_parameters

    def check(self, request):
        threads["check"] = threading.current_thread().name
        return real_check(self, request)

    def check_parameters(*a, **kw):
        threads["tools"] = threading.current_thread().name
        return real_params(*a, **kw)

    monkeypatch.setattr(GenerationService, "check", check)
    monkeypatch.setattr(reading, "check_parameters", check_parameters)
    monkeypatch.setattr(tools, "check_parameters", check_parameters)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with serving() as s:
        chat(s.client(), max_tokens=2, tools=[tool])
    # uvicorn's event loop runs in the server's thread; these ran in the loop's executor (threads "asyncio_N")
    assert threads["check"].startswith("asyncio") and threads["tools"].startswith("asyncio"), threads


def test_serve_builds_the_grammar_tokenizer_before_it_answers(monkeypatch):
    # llguidance builds its tokenizer in Rust holding the GIL (long for a large vocabulary): on the worker thread at
    # the first request with tools, the event loop (/health, every stream) would stand still meanwhile
    from specdec_cli.cli.commands import serve as serve_cmd
    from specdec_cli.spec import ModelOptions

    class Backend(FakeBackend):
        built_on: list[str] = []

        def lltokenizer(self):
            if self._lltok is None:
                self.built_on.append(threading.current_thread().name)
            return super().lltokenizer()

    backend = Backend(hashed_logits)
    seen: dict = {}

    class Server:
        def run(self, sockets):
            seen["built before serving"] = list(backend.built_on)

    monkeypatch.setattr(
        serve_cmd, "open_session", lambda *a, **kw: Session(target=backend, target_path=Path("fake.gguf"))
    )
    monkeypatch.setattr("specdec_cli.server.app.make_server", lambda app, **kw: Server())
    assert (
        serve_cmd.execute(
            models=ModelOptions(),
            spec=SpecOptions(method="none", k="4"),
            defaults=Defaults(),
            host="127.0.0.1",
            port=0,
            api_key=(),
            queue=4,
        )
        == 0
    )
    assert seen["built before serving"] == ["MainThread"]


# -- 5. learning saved as the server goes ---------------------------------------------------------------------------
def test_saver_saves_every_n_requests_or_m_seconds():
    now = [0.0]
    saved: list[float] = []
    saver = Saver(lambda: saved.append(now[0]), every=3, interval=10.0, clock=lambda: now[0])
    for _ in range(2):
        saver()
    assert saved == []
    saver()
    assert saved == [0.0]  # the third request
    now[0] = 11.0
    saver()
    assert saved == [0.0, 11.0]  # the interval passed


def test_the_server_saves_the_suffix_store_while_it_serves():
    from specdec_cli.config import data_dir

    def stores() -> list[Path]:
        return list((data_dir() / "suffix").glob("*")) if (data_dir() / "suffix").exists() else []

    with serving(method="suffix") as s:
        s.worker.saver = Saver(s.worker.service.save_learnt, every=2)
        chat(s.client(), max_tokens=5)
        s.wait(lambda h: not h["busy"])
        assert stores() == []
        chat(s.client(), max_tokens=5)
        deadline = time.monotonic() + 5
        while not stores() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stores()  # saved while the server still runs


def _requests_served(worker, n: int) -> list:
    """Submit `n` short requests at once (the queue is never empty until the last starts); their last events."""
    done = [threading.Event() for _ in range(n)]
    last: list = [None] * n

    def deliver(i, event):
        if isinstance(event, (Done, Failed)):
            last[i] = event
            done[i].set()

    for i in range(n):
        worker.submit(
            Request(config=GenerationConfig(max_tokens=4), prompt=PROMPT_TOKENS, label="completion"),
            partial(deliver, i),
        )
    for d in done:
        assert d.wait(20)
    return last


def test_saves_land_while_requests_keep_coming():
    saves: list[tuple[int, str]] = []  # (requests waiting at the save, the saving thread)
    worker, _ = _worker(SlowBackend(hashed_logits, delay=0.01), bound=64)
    worker.saver = Saver(
        lambda: saves.append((worker.status()["waiting"], threading.current_thread().name)), every=10**6, interval=0.05
    )
    worker.start()
    try:
        last = _requests_served(worker, 30)
    finally:
        worker.stop()
        worker.join(5)
    assert all(isinstance(e, Done) for e in last)
    assert any(waiting > 0 for waiting, _ in saves), saves  # not only once the queue ran dry
    assert {name for _, name in saves} == {"specdec-serve-worker"}  # between two requests: none mutates the stores


def test_the_last_requests_learning_is_saved_while_the_server_is_idle():
    saved = threading.Event()
    saves: list[str] = []
    worker, lines = _worker(FakeBackend(hashed_logits))
    worker.saver = Saver(
        lambda: (saves.append(threading.current_thread().name), saved.set()), every=10**6, interval=0.2
    )
    worker.start()
    try:
        assert isinstance(_requests_served(worker, 1)[0], Done)
        assert saved.wait(10)  # no other request came: the save fell due while the worker waited for one
        assert worker.saver.due_in() is None  # nothing served since: the idle worker waits with nothing to write
        assert saves == ["specdec-serve-worker"]
        assert isinstance(_requests_served(worker, 1)[0], Done)  # the worker serves on after its idle save
    finally:
        worker.stop()
        worker.join(5)
    assert not any("saving" in line for line in lines)


def test_a_corrupt_learnt_json_is_set_aside_and_temporaries_removed():
    from specdec_cli.core.controller import AdaptiveK
    from specdec_cli.stores import learnt

    path = learnt.learnt_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    tmp = path.with_name(f".{path.name}.tmp-123-deadbeef")
    tmp.write_text("half")
    ctrl = AdaptiveK(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learnt.save({"k": ctrl})
    asides = list(path.parent.glob("learnt.json.corrupt-*"))
    assert len(asides) == 1 and asides[0].read_text() == "{not json"
    assert any("Set aside" in str(w.message) for w in caught)
    assert not tmp.exists()
    assert "k" in json.loads(path.read_text())["entries"]


def test_a_corrupt_tuned_json_is_set_aside(tmp_path):
    from specdec_cli.stores import tuned

    model = tmp_path / "a.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    path = tuned.tuned_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[]")
    tmp = path.with_name(f".{path.name}.tmp-123-deadbeef")
    tmp.write_text("half")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        tuned.save(model, None, "ngram", {"key": "m", "cpu": "c", "threads": 2, "system_info_sha256": "x"}, 4)
    assert [p.read_text() for p in path.parent.glob("tuned.json.corrupt-*")] == ["[]"]
    assert not tmp.exists()


# -- 6. the caches kept apart per key --------------------------------------------------------------------------------
def test_one_keys_prompt_never_serves_another_key():
    with serving(api_key=["alice", "bob"]) as s:
        first = chat(s.client("alice"), max_tokens=3)
        again = chat(s.client("alice"), max_tokens=3)
        other = chat(s.client("bob"), max_tokens=3)
    cached = lambda r: r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0  # noqa
    assert cached(first) == 0 and cached(again) > 0
    assert cached(other) == 0  # bob's identical prompt found none of alice's in any cache
    assert first.choices[0].message.content == other.choices[0].message.content


def test_prompt_cache_entries_are_keyed_by_scope():
    from specdec_cli.stores.prompt_cache import PromptCache

    cache = PromptCache()

    class B:
        path = __file__

        def state_key(self):
            return {"n_ctx": 1}

    unscoped = cache.key(B())
    cache.scope = "abc"
    assert cache.key(B()) == {**unscoped, "scope": "abc"}


# -- 7. malformed nested content ------------------------------------------------------------------------------------
DEEP = "[" * 50_000 + "]" * 50_000


def test_arguments_nested_too_deeply_are_a_400_naming_the_field():
    chat_body = {
        "model": "x",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    responses_body = {
        "model": "x",
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    }
    with serving() as s:
        chat_status, _, chat_err = raw(s, "POST", "/v1/chat/completions", chat_body)
        resp_status, _, resp_err = raw(s, "POST", "/v1/responses", responses_body)
    assert chat_status == 400 and chat_err["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
    assert resp_status == 400 and resp_err["error"]["param"].endswith(".arguments")
    for err in (chat_err, resp_err):
        assert "Recursion" not in err["error"]["message"]


def test_a_bug_tells_the_client_nothing_internal():
    err = to_api_error(RuntimeError("cannot open /home/alice/secret.txt"))
    assert err.status == 500 and err.code == "internal_error"
    assert "secret" not in err.message and "RuntimeError" not in err.message
    assert "RuntimeError: cannot open /home/alice/secret.txt" in internal(
        RuntimeError("cannot open /home/alice/secret.txt")
    )


def test_a_bug_during_generation_is_logged_not_sent():
    class Buggy(FakeBackend):
        def decode(self, tokens, n_logits=0):
            raise RuntimeError("cannot open /home/alice/secret.txt")

    with serving(Buggy(hashed_logits), method="none") as s:
        with pytest.raises(openai.InternalServerError) as bug:
            chat(s.client(), max_tokens=3)
    assert "secret" not in json.dumps(bug.value.body)
    assert any("secret.txt" in line for line in s.lines)
