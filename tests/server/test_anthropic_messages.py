"""`specdec serve`'s Anthropic Messages API through the official `anthropic` client, on the fake backend (exact), and
the translation of Claude Code's request shapes in unit tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")

from fakes import CHARS, FakeBackend, RecordingBackend, greedy_reference, hashed_logits  # noqa: E402
from helpers import (  # noqa: E402
    CAPTURES,
    PROMPT,
    PROMPT_TOKENS,
    SlowBackend,
    serving,
    start_blocking_request,
    text_of,
)
from specdec_cli.server.anthropic_messages import MessagesRequest, error_body, to_request, tools_of  # noqa: E402
from specdec_cli.server.errors import ApiError  # noqa: E402
from specdec_cli.server.request import Message, ToolCall  # noqa: E402

V = len(CHARS)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris"]}, "unit": {"enum": ["C"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
USER = [{"role": "user", "content": PROMPT}]


def client_of(s, **kw):
    """The anthropic client on a served fake (its base URL has no /v1: the client adds it)."""
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=s.url.removesuffix("/v1"), max_retries=0, timeout=20, **kw)


def chars_backend(cls=FakeBackend, **kw) -> FakeBackend:
    return cls(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=1024, **kw)


# -- through the anthropic client ------------------------------------------------------------------------------------
def test_create_is_the_greedy_output_with_anthropic_usage():
    expected = text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 30))
    with serving() as s:
        client = client_of(s)
        first = client.messages.create(model="claude-any", max_tokens=30, messages=USER)
        again = client.messages.create(model="any-name", max_tokens=30, messages=USER)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.model == "claude-any"  # any name is served by the one model, and echoed
    [block] = first.content
    assert block.type == "text" and block.text == expected
    assert first.stop_reason == "max_tokens" and first.stop_sequence is None
    assert first.usage.output_tokens == 30
    # input = evaluated + read from the cache: the second request finds the prompt in the KV cache
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens) == (len(PROMPT_TOKENS), 0)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(PROMPT_TOKENS)
    assert again.usage.cache_read_input_tokens == len(PROMPT_TOKENS) - 1
    assert first.model_extra["specdec"]["finish_reason"] == "length"


def test_a_stream_has_anthropic_s_events_and_the_same_message():
    with serving() as s:
        client = client_of(s)
        whole = client.messages.create(model="m", max_tokens=25, messages=USER)
        events = list(client.messages.create(model="m", max_tokens=25, messages=USER, stream=True))
        with client.messages.stream(model="m", max_tokens=25, messages=USER) as stream:
            final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens == 7
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 25
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"


def test_stop_sequences_end_the_reply_and_the_one_that_matched_is_named():
    text = text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 40))
    words = text.split(" ")
    fresh = [w for i, w in enumerate(words) if i >= 3 and w and w not in words[:i]]  # first occurrences
    stop, later = f" {fresh[0]} ", f" {fresh[2]} "
    cut = text.find(stop)
    assert 0 < cut < text.find(later)  # the later one also occurs, after it
    with serving() as s:
        client = client_of(s)
        resp = client.messages.create(
            model="m", max_tokens=40, messages=USER, stop_sequences=["never there", later, stop]
        )
        events = list(
            client.messages.create(
                model="m", max_tokens=40, messages=USER, stream=True, stop_sequences=["never there", later, stop]
            )
        )
    assert resp.stop_reason == "stop_sequence" and resp.stop_sequence == stop
    assert resp.content[0].text == text[:cut]
    delta = [e for e in events if e.type == "message_delta"][0].delta
    assert (delta.stop_reason, delta.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_round_trip_streamed_and_not():
    forced = {"type": "tool", "name": "get_weather"}
    with serving(chars_backend(RecordingBackend)) as s:
        client = client_of(s)
        resp = client.messages.create(
            model="m",
            max_tokens=200,
            tools=[WEATHER],
            tool_choice=forced,
            messages=[{"role": "user", "content": "weather in Paris?"}],
        )
        with client.messages.stream(
            model="m",
            max_tokens=200,
            tools=[WEATHER],
            tool_choice=forced,
            messages=[{"role": "user", "content": "weather in Paris?"}],
        ) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
        [call] = resp.content
        history = [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "22 C"}]}
                ],
            },
        ]
        answer = client.messages.create(
            model="m", max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"}, messages=history
        )
        rendered, tools = s.backend.rendered
    assert resp.stop_reason == "tool_use"
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris", "unit": "C"}
    [block] = streamed.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris", "unit": "C"})
    assert streamed.stop_reason == "tool_use"
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Paris", "unit": "C"}
    # the result went back to the template as the call's tool message; the call as Hugging Face's tool_calls
    assert rendered[1]["tool_calls"] == [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
        }
    ]
    assert rendered[2] == {"role": "tool", "content": "22 C", "tool_call_id": call.id}
    assert tools[0]["function"]["name"] == "get_weather"
    assert answer.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in answer.content)


def test_count_tokens_is_the_prompt_a_request_would_evaluate():
    system = "You are terse."
    with serving(RecordingBackend(hashed_logits)) as s:
        client = client_of(s)
        counted = client.messages.count_tokens(model="m", system=system, messages=USER)
        resp = client.messages.create(model="m", system=system, max_tokens=3, messages=USER)
        line = s.lines[0]
    assert counted.input_tokens == resp.usage.input_tokens + resp.usage.cache_read_input_tokens
    assert counted.input_tokens == len(s.backend.tokenize(f"{system} {PROMPT}"))
    assert line == f"count_tokens: {counted.input_tokens} prompt tokens"


def test_count_tokens_answers_while_a_generation_holds_the_worker():
    """Issue 44 item 5: Claude Code calls count_tokens between turns; it must not wait for the running generation (an
    agent's cold 8k-token request can hold it for minutes): the prompt is rendered and tokenized apart from the
    worker."""
    backend = SlowBackend(hashed_logits)
    with serving(backend) as s:
        first = start_blocking_request(s, backend)  # the worker is inside its prefill until the gate opens
        counted = (
            client_of(s)
            .with_options(timeout=3)
            .messages.count_tokens(model="m", system="You are terse.", messages=USER)
        )
        held = not backend.gate.is_set() and s.health()["busy"]  # answered while the generation still held it
        backend.gate.set()
        first.join(10)
    assert held
    assert counted.input_tokens == len(backend.tokenize(f"You are terse. {PROMPT}"))


class CountingTokenizer(FakeBackend):
    """Counts the tokenizations of rendered chat prompts (special tokens parsed)."""

    chat_tokenized = 0

    def tokenize(self, text, add_special=True, parse_special=False):
        if parse_special and not add_special:
            self.chat_tokenized += 1
        return super().tokenize(text, add_special=add_special, parse_special=parse_special)


def test_count_tokens_of_a_conversation_just_tokenized_reuses_its_tokens():
    """Issue 44 item 5: Claude Code counts a conversation the server has just tokenized to answer it; the count takes
    the ids kept from that request (`GenerationService.prompt_tokens`), not another tokenization of thousands of
    tokens on cores a generation keeps busy. Seen failing with nothing kept."""
    backend = CountingTokenizer(hashed_logits)
    with serving(backend) as s:
        client = client_of(s)
        resp = client.messages.create(model="m", system="You are terse.", max_tokens=3, messages=USER)
        before = backend.chat_tokenized
        counted = client.messages.count_tokens(model="m", system="You are terse.", messages=USER)
        other = client.messages.count_tokens(model="m", system="You are brief.", messages=USER)
    assert before >= 1 and backend.chat_tokenized == before + 1  # the second count only
    assert counted.input_tokens == resp.usage.input_tokens + resp.usage.cache_read_input_tokens
    assert other.input_tokens == len(backend.tokenize(f"You are brief. {PROMPT}"))


def test_the_kept_prompts_are_the_newest_and_never_shared():
    from specdec_cli.server.service import KEPT_PROMPTS, GenerationService
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions

    backend = CountingTokenizer(hashed_logits)
    service = GenerationService(Session(target=backend, target_path=Path("fake.gguf")), SpecOptions(method="none"))
    requests = [
        service.check(
            to_request(
                MessagesRequest(model="m", max_tokens=1, messages=[{"role": "user", "content": f"w{i} w{i}"}]), Ctx()
            )
        )
        for i in range(KEPT_PROMPTS + 1)
    ]
    base = backend.chat_tokenized  # (the tool format's detection tokenizes too)
    first = service.prompt_tokens(requests[0])
    first.append(-1)  # a caller's list is its own: the kept ids are unchanged
    assert service.prompt_tokens(requests[0]) == first[:-1] and backend.chat_tokenized == base + 1
    for r in requests[1:]:  # KEPT_PROMPTS more: the first, least recently used, is dropped
        service.prompt_tokens(r)
    assert backend.chat_tokenized == base + KEPT_PROMPTS + 1
    service.prompt_tokens(requests[-1])
    assert backend.chat_tokenized == base + KEPT_PROMPTS + 1
    service.prompt_tokens(requests[0])
    assert backend.chat_tokenized == base + KEPT_PROMPTS + 2
    with_tools = service.check(
        to_request(
            MessagesRequest(model="m", max_tokens=1, messages=[{"role": "user", "content": "w0 w0"}], tools=[WEATHER]),
            Ctx(),
        )
    )
    service.prompt_tokens(with_tools)  # the same messages with tools: another prompt
    assert backend.chat_tokenized == base + KEPT_PROMPTS + 3
    calls = [
        service.check(
            to_request(
                MessagesRequest(
                    model="m",
                    max_tokens=1,
                    messages=[
                        {"role": "user", "content": "w0"},
                        {
                            "role": "assistant",
                            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}],
                        },
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "w1"}],
                        },
                    ],
                    tools=[WEATHER],
                ),
                Ctx(),
            )
        )
        for args in ({"city": "Paris", "unit": "C"}, {"unit": "C", "city": "Paris"})
    ]
    for r in calls:  # the same arguments in another order: a template's tojson writes another prompt
        service.prompt_tokens(r)
    assert backend.chat_tokenized == base + KEPT_PROMPTS + 5


def test_errors_are_anthropic_s_json_and_the_client_s_exception_classes():
    with serving(api_key="secret", max_body_bytes=4096) as s:
        client = client_of(s, api_key="secret")
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(
                model="m",
                max_tokens=5,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ],
            )
        with pytest.raises(anthropic.BadRequestError) as invalid:  # a validation error: 400, not 422
            client.messages.create(model="m", max_tokens=5, messages=USER, extra_body={"temperature": 1.5})
        with pytest.raises(anthropic.AuthenticationError) as denied:
            client_of(s, api_key="wrong").messages.create(model="m", max_tokens=5, messages=USER)
        with pytest.raises(anthropic.NotFoundError) as missing:
            client.messages.batches.list()
        with pytest.raises(anthropic.RequestTooLargeError) as large:
            client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "w1 " * 2000}])
        status, not_allowed = s.raw("GET", "/v1/messages", headers={"x-api-key": "secret"})
        with pytest.raises(anthropic.BadRequestError) as tool_choice:
            client.messages.create(
                model="m", max_tokens=5, messages=USER, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}
            )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages.0.content.0 is a image block: this model reads text only. Send text blocks.",
        },
    }
    assert invalid.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in invalid.value.body["error"]["message"]
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    assert large.value.body["error"]["type"] == "request_too_large"
    assert status == 405 and not_allowed["type"] == "error"
    assert "nope" in tool_choice.value.body["error"]["message"]


def test_x_api_key_and_bearer_both_authenticate_and_head_is_answered():
    with serving(api_key="secret") as s:
        by_header = client_of(s, api_key="secret").messages.create(model="m", max_tokens=2, messages=USER)
        by_token = anthropic.Anthropic(
            base_url=s.url.removesuffix("/v1"), auth_token="secret", max_retries=0, timeout=20
        ).messages.create(model="m", max_tokens=2, messages=USER)
        import http.client
        from urllib.parse import urlparse

        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("HEAD", "/")
        head = conn.getresponse().status
        conn.close()
        status, _ = s.raw(
            "POST",
            "/v1/messages?beta=true",
            json.dumps({"model": "m", "max_tokens": 2, "messages": USER}).encode(),
            headers={"x-api-key": "secret"},
        )
    assert by_header.usage.output_tokens == by_token.usage.output_tokens == 2
    assert head == 200 and status == 200


# -- the translation (no server) --------------------------------------------------------------------------------------
class Ctx:
    """What `to_request` reads from a `http.Context`."""

    def __init__(self) -> None:
        from specdec_cli.server.request import Defaults

        self.defaults = Defaults()
        self.n_ctx = 32768  # max_tokens is capped at the context window (issue 35)
        self.lines: list[str] = []

        class W:
            log = self.lines.append

        self.worker = W()


def test_claude_code_s_request_shape_becomes_one_system_prompt_and_plain_turns():
    body = MessagesRequest.model_validate(
        {
            "model": "specdec",
            "max_tokens": 32000,
            "stream": True,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.5b8;"},
                {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be careful."},
            ],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                        {"type": "text", "text": "fix bug.py", "cache_control": {"type": "ephemeral"}},
                    ],
                },
                {"role": "system", "content": "Available agent types: ..."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Read it first.", "signature": ""},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "bug.py"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": "no such file"},
                        {"type": "text", "text": "try again"},
                    ],
                },
            ],
            "tools": [
                {
                    "name": "Read",
                    "description": "Read a file",
                    "input_schema": {
                        "$schema": "https://json-schema.org/draft/2020-12/schema",
                        "type": "object",
                        "properties": {
                            "file_path": {"type": "string"},
                            "meta": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
                        },
                        "required": ["file_path"],
                        "additionalProperties": False,
                    },
                },
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
            ],
            "metadata": {"user_id": '{"device_id": "x"}'},
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "some_future_field": 1,
        }
    )
    ctx = Ctx()
    request = to_request(body, ctx)
    assert request.messages == (
        Message("system", "You are a Claude agent.\nBe careful.\n\nAvailable agent types: ..."),
        Message("user", "<system-reminder>x</system-reminder>\nfix bug.py"),
        Message(
            "assistant",
            "",
            tool_calls=(ToolCall("toolu_1", "Read", '{"file_path": "bug.py"}'),),
            reasoning="Read it first.",
        ),
        Message("tool", "Error: no such file", tool_call_id="toolu_1"),
        Message("user", "try again"),
    )
    assert [t.name for t in request.tools.specs] == ["Read"] and request.tools.mode == "auto"
    assert ctx.lines == [
        "messages: server tools left out of the prompt (a local server cannot run them): "
        "web_search (web_search_20250305)"
    ]
    assert request.config.max_tokens == 32000
    assert request.config.sampling.temperature == 1.0  # Anthropic's documented default (the server was given none)
    assert request.output is None


def test_tool_choice_maps_to_the_internal_modes():
    tools = [WEATHER, {**WEATHER, "name": "other"}]
    assert tools_of(tools, None).mode == "auto"
    any_ = tools_of(tools, {"type": "any", "disable_parallel_tool_use": True})
    assert (any_.mode, any_.allowed, any_.parallel) == ("required", ("get_weather", "other"), False)
    one = tools_of(tools, {"type": "tool", "name": "other"})
    assert (one.mode, one.allowed, one.parallel) == ("required", ("other",), False)
    assert tools_of(tools, {"type": "none"}).mode == "none"
    with pytest.raises(ApiError) as bad:
        tools_of(tools, {"type": "sometimes"})
    assert bad.value.param == "tool_choice.type"


def test_refused_fields_and_output_config_format():
    base = {"model": "m", "max_tokens": 5, "messages": USER}
    with pytest.raises(ApiError) as mcp:
        to_request(MessagesRequest.model_validate({**base, "mcp_servers": [{"type": "url", "url": "http://x"}]}), Ctx())
    assert mcp.value.param == "mcp_servers"
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
        "additionalProperties": False,
    }
    request = to_request(
        MessagesRequest.model_validate(
            {**base, "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}}}
        ),
        Ctx(),
    )
    assert request.output.schema == schema
    with pytest.raises(ApiError) as bad:
        to_request(MessagesRequest.model_validate({**base, "output_config": {"format": {"type": "text"}}}), Ctx())
    assert bad.value.param == "output_config.format"


def test_error_types_follow_the_status():
    assert error_body(ApiError(429, "busy"))["error"]["type"] == "rate_limit_error"
    assert error_body(ApiError(503, "stopping"))["error"]["type"] == "overloaded_error"
    assert error_body(ApiError(500, "bug")) == {"type": "error", "error": {"type": "api_error", "message": "bug"}}


def test_serve_s_default_context_holds_an_agent_s_prompt_and_says_so():
    from specdec_cli.cli.commands.serve import AGENT_PROMPT_TOKENS, context_line
    from specdec_cli.cli.options import SERVE_CTX

    assert SERVE_CTX >= AGENT_PROMPT_TOKENS
    assert "holds coding agents' prompts" in context_line(SERVE_CTX)
    assert context_line(4096).endswith("use --ctx 32768.")


def test_a_stream_whose_prompt_takes_long_is_answered_before_its_prefill_ends(monkeypatch):
    """Claude Code's HTTP client gives up on headers that take 300 s; a 20k-token prefill takes longer on a CPU. The
    backend's passes wait for the test: the headers must come while the prefill's first pass is still held."""
    import threading

    from specdec_cli.errors import DecodeError
    from specdec_cli.server import http

    class Failing(FakeBackend):
        """Its pass fails once `go` is set."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.go = threading.Event()

        def decode(self, tokens, n_logits=0):
            self.go.wait(10)
            raise DecodeError(-1, len(tokens))

    import http.client as hc
    from urllib.parse import urlparse

    def post_stream(s):
        """(connection, response) of a streamed Messages request, once its status line and headers came."""
        u = urlparse(s.url)
        conn = hc.HTTPConnection(u.hostname, u.port, timeout=20)
        conn.request(
            "POST",
            "/v1/messages",
            json.dumps({"model": "m", "max_tokens": 2, "messages": USER, "stream": True}),
            {"Content-Type": "application/json"},
        )
        return conn, conn.getresponse()

    monkeypatch.setattr(http, "STREAM_COMMIT_S", 0.05)
    backend = SlowBackend(hashed_logits)
    backend.gate.clear()  # the prefill's pass waits until the headers came
    with serving(backend) as s:
        conn, raw = post_stream(s)
        passes_before_headers = backend.n_decode_calls
        backend.gate.set()
        body = raw.read().decode()
        conn.close()
        client = client_of(s)
        events = list(client.messages.create(model="m", max_tokens=3, messages=USER, stream=True))
        whole = client.messages.create(model="m", max_tokens=3, messages=USER)
    assert raw.status == 200 and passes_before_headers == 0  # the headers did not wait for the prefill
    assert "event: message_start" in body and "event: message_stop" in body
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens == 7
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    failing = Failing(hashed_logits)
    with serving(failing) as s:
        conn, raw = post_stream(s)  # the 200 first, while the pass is held ...
        failing.go.set()  # ... then the pass fails: an error event in the stream
        body = raw.read().decode()
        conn.close()
    errors = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and '"error"' in line]
    assert raw.status == 200 and "event: error" in body
    [error] = errors
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "llama_decode" in error["error"]["message"]
    with serving(failing) as s:
        with pytest.raises(anthropic.APIStatusError) as failed:  # the SDK reads the same error
            list(client_of(s).messages.create(model="m", max_tokens=3, messages=USER, stream=True))
    assert failed.value.body["error"]["type"] == "api_error" and "llama_decode" in failed.value.body["error"]["message"]


@pytest.mark.real
def test_a_prompt_whose_client_gave_up_is_saved_at_shutdown_for_the_restart(smollm2_path):
    """An agent's client that gives up during a long reply leaves its prompt in the KV cache, not in the prompt cache
    (only finished requests are saved as they end); stopping the server saves it, so after a restart the retried
    request finds it. (The client hangs up at the reply's first text: earlier, during the prefill, how much of the
    prompt is evaluated before the server notices depends on the machine's speed.)"""
    import http.client
    from urllib.parse import urlparse

    from helpers import start_real_server

    facts = "\n".join(f"Fact {i}: the box on shelf {i % 7} holds {i * 3} keys." for i in range(80))
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": facts + "\nRepeat every fact."}]}
    usages = []
    for attempt in range(2):
        proc, url = start_real_server(smollm2_path, "--method", "ngram", "--ctx", "4096")
        base = url.removesuffix("/v1")
        try:
            if attempt == 0:  # stream, then hang up at the reply's first text: the request is cancelled mid-reply
                u = urlparse(base)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
                conn.request(
                    "POST",
                    "/v1/messages",
                    json.dumps({**body, "stream": True, "max_tokens": 2000}),
                    {"Content-Type": "application/json"},
                )
                raw = conn.getresponse()
                while (line := raw.readline()) and not line.startswith(b"event: content_block_delta"):
                    pass  # at the first text the whole prompt is evaluated, whatever the machine's speed
                conn.close()
            else:
                reply = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=300).messages.create(
                    **body
                )
                usages.append(reply.usage)
            proc.send_signal(__import__("signal").SIGTERM)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert attempt == 1 or "cancelled (client gone)" in err or "cut short (shutting down)" in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    [usage] = usages
    assert usage.cache_read_input_tokens >= 0.95 * (usage.input_tokens + usage.cache_read_input_tokens)


def test_a_captured_claude_code_session_is_served_each_turn_from_the_last_ones_cache():
    """The three turns of a Claude Code 2.1 session (`clients/agent_capture.py claude`: its ~80 kB bodies with 24
    tools, the billing header, a mid-conversation system message, the stub's Read and Edit calls and their results)
    as `bench_serve.py --workload replay` sends them: each is answered, and each finds the previous turn's prompt in
    the KV cache."""
    turns = sorted((CAPTURES / "claude-code").glob("*-POST-v1_messages.json"))
    assert len(turns) == 3, turns

    def ascii_only(d: dict) -> dict:  # the toy vocabulary is ASCII: other characters become "?"
        return {k: v.encode("ascii", "replace").decode() if isinstance(v, str) else v for k, v in d.items()}

    backend = FakeBackend(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=65536, n_batch=512)
    usage = []
    with serving(backend) as s:
        for f in turns[:3]:
            body = json.loads(f.read_text(), object_hook=ascii_only)["body_json"]
            body.update(stream=False, temperature=0, max_tokens=8)
            status, answer = s.raw("POST", "/v1/messages?beta=true", json.dumps(body).encode())
            assert status == 200 and answer["type"] == "message", answer
            usage.append(answer["usage"])
    prompts = [u["input_tokens"] + u["cache_read_input_tokens"] for u in usage]
    assert prompts[0] > 5000 and prompts[0] < prompts[1] < prompts[2], usage
    for before, u in zip(prompts, usage[1:], strict=False):
        assert u["cache_read_input_tokens"] >= before - 1, usage  # all of the previous prompt (its last token aside)
