"""`specdec serve` through the official `openai` client, against a server on a free loopback port.

The fake service is the real `GenerationService` and engine over `fakes.FakeBackend`, so the served text is checked
exactly against plain greedy decoding; the real-model test runs `specdec serve` as a subprocess with smollm2-135m.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from fakes import FakeBackend, greedy_reference, hashed_logits  # noqa: E402
from helpers import PROMPT, PROMPT_TOKENS, SlowBackend, chat, serving, start_real_server, text_of  # noqa: E402
from specdec_cli.core.records import Finish, Prefill, Step  # noqa: E402
from specdec_cli.core.stats import summarize  # noqa: E402
from specdec_cli.errors import (  # noqa: E402
    CacheTrimError,
    ContextOverflowError,
    DecodeError,
    ModelError,
    UsageError,
)
from specdec_cli.server import openai_base  # noqa: E402
from specdec_cli.server.app import bind, validation_error  # noqa: E402
from specdec_cli.server.errors import (  # noqa: E402
    ApiError,
    ClientGoneError,
    QueueFullError,
    ShuttingDownError,
    internal,
    to_api_error,
)
from specdec_cli.server.reply import RequestStats  # noqa: E402


# -- the OpenAI API with the fake service -------------------------------------------------------------------------
def test_chat_completion_is_the_greedy_output_with_usage_and_specdec_stats():
    expected = greedy_reference(hashed_logits, PROMPT_TOKENS, 40)
    with serving() as s:
        resp = chat(s.client(), max_tokens=40)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text_of(expected)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(PROMPT_TOKENS)
    assert resp.usage.completion_tokens == 40
    assert resp.usage.total_tokens == len(PROMPT_TOKENS) + 40
    details = resp.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0
    spec = resp.model_extra["specdec"]
    assert spec["method"] == "ngram"
    assert spec["target_passes"] >= 1 and spec["tokens_per_pass"] == pytest.approx(40 / spec["target_passes"], 1e-3)
    assert spec["accepted"] <= spec["drafted"]
    assert sum(v["drafted"] for v in spec["sources"].values()) == spec["drafted"]
    assert len(s.lines) == 1 and "40 tokens" in s.lines[0] and "tok/s" in s.lines[0]


def test_a_seeded_sampled_request_gets_plain_decodings_reply_whatever_is_drafted():
    def markov(prefix):  # one favourite after each token: the reply repeats, so n-gram drafts are accepted
        return hashed_logits(prefix[-1:])

    replies, drafted = [], 0
    for method in ("none", "ngram"):
        with serving(FakeBackend(markov), method=method) as s:
            resp = chat(s.client(), max_tokens=40, temperature=1.0, seed=42, extra_body={"top_k": 2})
        replies.append(resp.choices[0].message.content)
        drafted += resp.model_extra["specdec"]["accepted"]
    assert drafted > 0  # drafts were accepted
    assert replies[0] == replies[1]


def test_stream_chunks_concatenate_to_the_text_and_end_with_usage():
    expected = text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 30))
    with serving() as s:
        chunks = list(chat(s.client(), max_tokens=30, stream=True, stream_options={"include_usage": True}))
        plain = list(chat(s.client(), max_tokens=30, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["specdec"]["method"] == "ngram"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # without include_usage: no usage chunk; the second request reused the whole prompt from the KV cache
    assert all(c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == expected


def test_resent_conversation_reuses_the_kv_cache_prefix():
    with serving() as s:
        client = s.client()
        first = chat(client, max_tokens=12)
        follow = PROMPT + " " + first.choices[0].message.content + " w7 w2"
        second = chat(client, follow, max_tokens=12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # everything the first request evaluated (prompt + reply) was kept: only the new tokens are evaluated
    assert second.usage.prompt_tokens_details.cached_tokens >= len(PROMPT_TOKENS) + 12 - 1
    tokens = FakeBackend().tokenize(follow)
    assert second.choices[0].message.content == text_of(greedy_reference(hashed_logits, tokens, 12))


def test_stop_strings_and_text_completions():
    expected = greedy_reference(hashed_logits, PROMPT_TOKENS, 40)
    stop_word = text_of(expected[5:6]).strip()  # the 6th output word
    with serving() as s:
        client = s.client()
        resp = chat(client, max_tokens=40, stop=[stop_word, "nothing-like-this"])
        comp = client.completions.create(model="fake", prompt=PROMPT, max_tokens=20)
        streamed = list(client.completions.create(model="fake", prompt=PROMPT, max_tokens=20, stream=True))
    first = text_of(expected).index(stop_word)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == text_of(expected)[:first]
    assert comp.object == "text_completion"
    assert comp.choices[0].text == text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 20))
    assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text


def test_prediction_is_accepted_and_reported_in_usage():
    expected = greedy_reference(hashed_logits, PROMPT_TOKENS, 12)
    with serving(method="auto") as s:
        client = s.client()
        resp = chat(client, max_tokens=12, prediction={"type": "content", "content": text_of(expected)})
        parts = chat(client, max_tokens=12, prediction={"type": "content", "content": [{"type": "text", "text": "x"}]})
        plain = chat(client, max_tokens=12)
        with pytest.raises(openai.BadRequestError) as bad:
            chat(client, max_tokens=12, prediction={"type": "image", "content": "x"})
    assert resp.choices[0].message.content == text_of(expected)  # lossless
    d = resp.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= 8 and d.rejected_prediction_tokens == 0  # the prediction was the reply
    assert resp.specdec["sources"]["predict"]["accepted"] == d.accepted_prediction_tokens
    for r in (parts, plain):  # a prediction that never matches, and none: nothing drafted from a prediction
        d = r.usage.completion_tokens_details
        assert d is None or (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (0, 0)
    assert bad.value.body["param"] == "prediction.type"


def test_prediction_usage_counts_steps_drafted_from_the_prediction():
    """usage: accepted/rejected prediction tokens are the drafted tokens of steps whose source is "predict"."""
    records = [
        Prefill(n_prompt=3, n_evaluated=3, ms=1.0),
        Step(0, 4, (1, 2, 3, 4), 3, 9, (1, 2, 3, 9), (), 0.1, 1.0, source="predict"),
        Step(1, 2, (5, 6), 0, 7, (7,), (), 0.1, 1.0, source="store"),
        Step(2, 3, (8, 8, 8), 3, 4, (8, 8, 8, 4), (), 0.1, 1.0, source="predict"),
        Finish("length"),
    ]
    stats = RequestStats(summarize(records))
    details = openai_base.usage_json(stats)["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (6, 1)
    assert stats.specdec("auto")["sources"] == {
        "predict": {"steps": 2, "drafted": 7, "accepted": 6},
        "store": {"steps": 1, "drafted": 2, "accepted": 0},
    }
    assert openai_base.openai_finish(stats) == "length" and stats.run.n_generated == 9


def test_models_health_and_unknown_paths():
    with serving() as s:
        models = s.client().models.list()
        assert [m.id for m in models.data] == ["fake"]
        assert s.client().models.retrieve("fake").id == "fake"
        with pytest.raises(openai.NotFoundError) as missing:
            s.client().models.retrieve("gpt-9")
        status, body = s.raw("GET", "/v1/nothing")
        assert s.health() == {
            "status": "ok",
            "model": "fake",
            "method": "ngram",
            "busy": False,
            "queued": 0,
            "queue": {"waiting": 0, "bound": 16, "lanes": 1, "running": None, "busy": [], "retry_after_s": 1},
        }
    assert missing.value.body["code"] == "model_not_found"
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "/v1/chat/completions" in body["error"]["message"]


def test_bad_requests_get_openai_error_json():
    with serving(FakeBackend(hashed_logits, n_ctx=64), max_body_bytes=4096) as s:
        client = s.client()
        with pytest.raises(openai.BadRequestError) as role:
            client.chat.completions.create(model="fake", messages=[{"role": "robot", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as temp:
            chat(client, temperature=7)
        with pytest.raises(openai.BadRequestError) as negative:
            chat(client, temperature=-1)
        with pytest.raises(openai.BadRequestError) as n:
            chat(client, n=2)
        with pytest.raises(openai.BadRequestError) as long:
            chat(client, " ".join(["w5"] * 100))
        status_json, not_json = s.raw("POST", "/v1/chat/completions", b"{not json")
        status_none, no_messages = s.raw("POST", "/v1/chat/completions", json.dumps({"model": "x"}).encode())
        status_big, big = s.raw(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "x", "messages": [{"role": "user", "content": "w5 " * 5000}]}).encode(),
        )
        after = chat(client, max_tokens=5)  # nothing above broke the server
    assert role.value.status_code == 400 and role.value.body["param"] == "messages.0.role"
    for invalid in (role, temp, negative):  # OpenAI's status and type for an invalid field: never 422
        assert invalid.value.status_code == 400 and invalid.value.body["type"] == "invalid_request_error"
    assert temp.value.body["param"] == "temperature" and negative.value.body["param"] == "temperature"
    assert n.value.body["param"] == "n"
    assert long.value.body["code"] == "context_length_exceeded" and "64 tokens" in long.value.body["message"]
    assert long.value.body["param"] == "messages"
    assert status_json == 400 and not_json["error"]["code"] == "invalid_json"
    assert status_none == 400 and no_messages["error"]["param"] == "messages"
    assert status_big == 413 and "4096 bytes" in big["error"]["message"]
    assert after.usage.completion_tokens == 5


def test_api_key_required_when_set():
    with serving(api_key="sesame") as s:
        with pytest.raises(openai.AuthenticationError) as wrong:
            chat(s.client("wrong"), max_tokens=3)
        status, _ = s.raw("GET", "/v1/models")
        ok = chat(s.client("sesame"), max_tokens=3)
        assert s.health()["status"] == "ok"  # /health needs no key
    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    assert status == 401
    assert ok.usage.completion_tokens == 3


def test_queue_full_gets_429_and_requests_are_served_in_order():
    backend = SlowBackend(hashed_logits)
    backend.gate.clear()  # the first request blocks in its prefill
    results: dict[str, object] = {}
    with serving(backend, queue=1) as s:
        client = s.client()

        def call(name: str, max_tokens: int) -> None:
            results[name] = chat(client, max_tokens=max_tokens)

        a = threading.Thread(target=call, args=("a", 4))
        a.start()
        s.wait(lambda h: h["busy"])
        b = threading.Thread(target=call, args=("b", 6))
        b.start()
        s.wait(lambda h: h["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as full:
            chat(client, max_tokens=2)
        backend.gate.set()
        a.join(10)
        b.join(10)
    assert full.value.body["code"] == "queue_full" and full.value.body["type"] == "rate_limit_error"
    assert results["a"].usage.completion_tokens == 4 and results["b"].usage.completion_tokens == 6
    assert [line.split(":")[0] for line in s.lines] == ["#1 chat", "#2 chat"]


def test_client_disconnect_mid_stream_stops_the_generation_and_frees_the_worker():
    backend = SlowBackend(hashed_logits, delay=0.01)
    with serving(backend, method="none") as s:
        client = s.client()
        stream = chat(client, max_tokens=400, stream=True)
        for _, _chunk in zip(range(4), stream, strict=False):
            pass
        stream.close()
        s.wait(lambda h: not h["busy"] and h["queued"] == 0)
        calls_at_stop = backend.n_decode_calls
        assert calls_at_stop < 100  # far from the 400 steps asked
        assert "cancelled (client gone)" in s.lines[0]
        # the KV cache was left holding committed tokens only: the next request is still exact
        resp = chat(client, max_tokens=20)
        # it stopped, not merely left in the background: every pass since is the next request's own (the prompt's
        # last token read again, then one per token after the first); a generation going on would add its own
        assert backend.n_decode_calls - calls_at_stop == 20
    assert resp.choices[0].message.content == text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 20))


def test_client_gone_before_a_non_streaming_reply_frees_the_worker():
    import http.client
    from urllib.parse import urlparse

    backend = SlowBackend(hashed_logits, delay=0.01)
    with serving(backend, method="none") as s:
        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=0.3)
        body = json.dumps({"model": "x", "max_tokens": 400, "messages": [{"role": "user", "content": PROMPT}]})
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        s.wait(lambda h: h["busy"])
        conn.close()
        s.wait(lambda h: not h["busy"])
        assert "cancelled (client gone)" in s.lines[0]
    assert backend.n_decode_calls < 200


def test_a_failing_backend_is_a_500_and_the_server_goes_on():
    class Flaky(FakeBackend):
        fail = True

        def decode(self, tokens, n_logits=0):
            if self.fail and len(tokens) > 1:
                raise DecodeError(-1, len(tokens))
            return super().decode(tokens, n_logits)

    backend = Flaky(hashed_logits)
    with serving(backend) as s:
        with pytest.raises(openai.InternalServerError) as failed:
            chat(s.client(), max_tokens=5)
        backend.fail = False
        ok = chat(s.client(), max_tokens=5)
    assert failed.value.body["code"] == "backend_error" and "llama_decode" in failed.value.body["message"]
    assert ok.choices[0].message.content == text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 5))


def test_stop_ends_the_running_request_and_fails_the_waiting_ones():
    backend = SlowBackend(hashed_logits, delay=0.01)
    with serving(backend, method="none") as s:
        client = s.client()
        errors: list[BaseException] = []

        def call() -> None:
            try:
                chat(client, max_tokens=400)
            except openai.APIError as e:
                errors.append(e)

        threads = [threading.Thread(target=call) for _ in range(2)]
        threads[0].start()
        s.wait(lambda h: h["busy"])
        threads[1].start()
        s.wait(lambda h: h["queued"] == 1)
        s.worker.stop()
        for t in threads:
            t.join(10)
        s.worker.join(5)
        assert not s.worker.alive
    assert len(errors) == 2 and all(e.status_code == 503 for e in errors)
    assert backend.n_decode_calls < 100


# -- the error table (unit) -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "exc, status, type_, code",
    [
        (QueueFullError(3), 429, "rate_limit_error", "queue_full"),
        (ShuttingDownError(), 503, "server_error", "shutting_down"),
        (ClientGoneError(), 499, "invalid_request_error", "client_gone"),
        (
            ContextOverflowError("The prompt is 900 tokens.", "Use --ctx 1024."),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (UsageError("The prompt is empty.", "Send text."), 400, "invalid_request_error", None),
        (DecodeError(1, 12), 500, "server_error", "backend_error"),
        (CacheTrimError("llama_memory_seq_rm refused"), 500, "server_error", "backend_error"),
        (ModelError("The chat template failed."), 500, "server_error", None),
        (KeyError("boom"), 500, "server_error", "internal_error"),
    ],
)
def test_error_table(exc, status, type_, code):
    err = to_api_error(exc, param="messages")
    assert (err.status, err.type, err.code) == (status, type_, code)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    word = str(exc).split(" ")[0].strip("'")
    if code == "internal_error":  # a bug's own text stays in the server's log, never reaches a client (issue 35)
        assert body["message"] and word not in body["message"] and word in internal(exc)
    else:
        assert body["message"] and word in body["message"]
    assert body["param"] == ("messages" if status == 400 else None)


def test_error_table_keeps_api_errors_and_names_the_limit():
    e = ApiError(404, "no such model", param="model", code="model_not_found")
    assert to_api_error(e) is e
    q = to_api_error(QueueFullError(7))
    assert "--queue 7" in q.message
    bug = to_api_error(ZeroDivisionError("division by zero"))
    assert "bug" in bug.message and "ZeroDivisionError" not in bug.message  # the log has it (issue 35)
    assert "ZeroDivisionError: division by zero" in internal(ZeroDivisionError("division by zero"))


def test_validation_errors_name_the_field():
    e = validation_error(
        [
            {"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'", "type": "x"},
            {"loc": ("body", "n"), "msg": "bad", "type": "y"},
        ]
    )
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", "messages.0.role")
    assert "messages.0.role: Input should be 'user'" in e.message and "1 more" in e.message
    j = validation_error([{"loc": ("body", 1), "msg": "JSON decode error", "type": "json_invalid"}])
    assert (j.status, j.code) == (400, "invalid_json")


# -- the command ----------------------------------------------------------------------------------------------------
def test_serve_help_has_examples():
    from typer.testing import CliRunner

    from specdec_cli.cli.app import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for text in ("--port", "--api-key", "--queue", "--method", "Examples", "base_url"):
        assert text in result.output


def test_serve_refuses_a_port_in_use():
    from specdec_cli.__main__ import main

    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        code = main(["serve", "-t", "/nonexistent.gguf", "--port", str(port)])
    finally:
        sock.close()
    assert code == 2  # a UsageError before any model is loaded


# -- end to end with a real model ------------------------------------------------------------------------------------
@pytest.mark.real
def test_real_server_saves_the_prompt_cache_so_a_restart_serves_the_prompt_from_it(smollm2_path):
    """A ~1,000-token prompt served, the server stopped with SIGTERM and started again: the same prompt comes from
    the prompt cache (usage.prompt_tokens_details.cached_tokens >= 95 % of the prompt). The server drives its
    generations through the driver, which saves a finished prompt; before, only `specdec run` saved one."""
    facts = [
        f"Fact {i}: the {c} box on shelf {i % 7} holds {i * 3} {n}."
        for i, (c, n) in enumerate(
            zip(
                ["red", "green", "blue", "yellow", "white"] * 12,
                ["pens", "cups", "keys", "maps", "nails", "coins"] * 10,
                strict=False,
            )
        )
    ]
    messages = [{"role": "user", "content": "Read these facts.\n" + "\n".join(facts) + "\nWhich box holds 30 keys?"}]
    served = []
    for _ in range(2):
        proc, url = start_real_server(smollm2_path, "--method", "ngram", "--ctx", "2048")
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
            reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
            served.append(reply.usage)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    cold, warm = served
    assert 900 <= cold.prompt_tokens <= 1400 and cold.prompt_tokens == warm.prompt_tokens
    assert cold.prompt_tokens_details.cached_tokens == 0
    assert warm.prompt_tokens_details.cached_tokens >= 0.95 * warm.prompt_tokens


@pytest.mark.real
def test_real_server_end_to_end(smollm2_path, tmp_path):
    """`specdec serve` as a subprocess on smollm2-135m: chat, stream, the repeat learnt by the suffix store and served
    from the KV cache, then SIGTERM: exit 0 and the store saved."""
    proc, url = start_real_server(smollm2_path, "--method", "suffix", "--ctx", "1024")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "List the days of the week, one per line."}]
        first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0)
        text = first.choices[0].message.content
        assert text.strip() and first.usage.completion_tokens > 0
        streamed = list(
            client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=48,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        again = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        usage = streamed[-1].usage
        spec = next(c for c in streamed if c.choices and c.choices[0].finish_reason).model_extra["specdec"]
        assert again == text  # greedy, same prompt: the same reply
        assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1  # the prompt came from the cache
        assert spec["sources"]["store"]["accepted"] > 0  # the suffix store learnt the first reply (past outputs)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "saved" in err
        data = Path(os.environ["SPECDEC_HOME"]) / "data"
        assert (data / "learnt.json").is_file()  # --k auto's controller, saved by session.close()
        assert list((data / "suffix").iterdir())  # the suffix store, saved by drafter.close()
        logged = [ln for ln in err.splitlines() if "tok/s" in ln]  # one line per request
        assert [ln.split(":")[0] for ln in logged] == ["#1 chat", "#2 chat"], err
        assert "(0 cached)" in logged[0] and "(0 cached)" not in logged[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
