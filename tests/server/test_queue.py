"""Waiting visibly (issue 27 part 5): a streamed request queued behind another gets its 200, headers and SSE keep-alive
comments at once (an agent's read timeout must not fire in the queue), and an error after that travels in the stream;
429 `queue_full` carries `Retry-After`; `/health` shows the queue. On the fake backend."""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import greedy_reference, hashed_logits  # noqa: E402
from helpers import PROMPT, PROMPT_TOKENS, SlowBackend, chat, serving, start_blocking_request, text_of  # noqa: E402


def open_stream(s, body: dict, timeout: float):
    """POST a streamed chat request; (connection, response) once the status line and headers came."""
    u = urlparse(s.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({"model": "fake", "stream": True, **body}),
        headers={"Content-Type": "application/json"},
    )
    return conn, conn.getresponse()


def test_a_queued_stream_gets_headers_and_keepalive_comments_at_once_then_its_reply():
    backend = SlowBackend(hashed_logits)
    with serving(backend) as s:
        first = start_blocking_request(s, backend)
        passes = backend.n_decode_calls
        conn, resp = open_stream(s, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}, timeout=30)
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        # the worker is still blocked (its pass waits for the gate): the headers did not wait for it
        assert first.is_alive() and backend.n_decode_calls == passes
        assert resp.readline().decode().startswith(": queued 1")  # a comment at once, keep-alives after it
        backend.gate.set()
        body = resp.read().decode()
        conn.close()
        first.join(10)
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == text_of(greedy_reference(backend.fn, PROMPT_TOKENS, 6))
    assert body.rstrip().endswith("data: [DONE]")


def test_a_queued_stream_that_fails_gets_the_error_in_the_stream():
    backend = SlowBackend(hashed_logits, n_ctx=64)
    with serving(backend) as s:
        first = start_blocking_request(s, backend)
        conn, resp = open_stream(s, {"messages": [{"role": "user", "content": " ".join(["w5"] * 100)}]}, timeout=5)
        assert resp.status == 200  # committed while queued
        backend.gate.set()
        body = resp.read().decode()
        conn.close()
        first.join(10)
    errors = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert errors and errors[-1]["error"]["code"] == "context_length_exceeded"  # OpenAI's error, in the stream


def test_queue_full_carries_retry_after_and_health_shows_the_queue():
    backend = SlowBackend(hashed_logits)
    with serving(backend, queue=1) as s:
        first = start_blocking_request(s, backend)
        second = threading.Thread(target=chat, args=(s.client(),), kwargs={"max_tokens": 2}, daemon=True)
        second.start()
        health = s.wait(lambda h: h["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as full:
            chat(s.client(), max_tokens=2)
        backend.gate.set()
        first.join(10)
        second.join(10)
        idle = s.health()
    queue = health["queue"]
    assert (queue["waiting"], queue["bound"]) == (1, 1)
    assert queue["running"]["age_s"] >= 0 and queue["running"]["kind"] == "chat"
    assert queue["retry_after_s"] >= 1
    retry = full.value.response.headers.get("retry-after")
    assert retry is not None and int(retry) >= 1
    assert full.value.body["code"] == "queue_full"
    assert idle["queue"]["running"] is None and idle["queue"]["waiting"] == 0


class ThreadNoting(SlowBackend):
    """Notes the threads its chat template and tokenizer run on."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.threads: set[str] = set()

    def format_chat(self, messages, **kw):
        self.threads.add(threading.current_thread().name)
        return super().format_chat(messages, **kw)

    def tokenize(self, text: str, **kw):
        self.threads.add(threading.current_thread().name)
        return super().tokenize(text, **kw)


def test_prompts_are_rendered_and_tokenized_off_the_worker_thread():
    """Issue 44 item 5: the worker thread only decodes; a request's chat template and tokenizing run on the HTTP side
    (before it is queued), so a long conversation's rendering never holds up the generations of others."""
    backend = ThreadNoting(hashed_logits)
    with serving(backend) as s:
        backend.threads.clear()  # what the service read at construction
        first = start_blocking_request(s, backend)
        second = threading.Thread(
            target=chat,
            args=(s.client(),),
            daemon=True,
            kwargs={"max_tokens": 2, "prediction": {"type": "content", "content": "w3 w17 w4"}},
        )  # tokenized too
        second.start()
        s.wait(lambda h: h["queued"] == 1)
        backend.gate.set()
        first.join(10)
        second.join(10)
    assert backend.threads and not any(name.startswith("specdec-serve-worker") for name in backend.threads)


def test_a_template_that_refuses_the_conversation_is_a_400_before_the_queue():
    """A prompt the template refuses is answered at once (400 naming messages), even while another request runs."""
    backend = SlowBackend(hashed_logits, chat_template="{{ raise_exception('roles must alternate') }}")
    with serving(backend) as s:
        first = threading.Thread(
            target=s.raw,
            args=("POST", "/v1/completions", json.dumps({"model": "f", "prompt": PROMPT, "max_tokens": 3}).encode()),
            daemon=True,
        )
        backend.gate.clear()
        first.start()
        s.wait(lambda h: h["busy"])
        status, body = s.raw(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "f", "stream": True, "messages": [{"role": "user", "content": PROMPT}]}).encode(),
        )
        held = not backend.gate.is_set()
        backend.gate.set()
        first.join(10)
    assert held
    assert status == 400 and "roles must alternate" in body["error"]["message"]
    assert body["error"]["param"] == "messages"
