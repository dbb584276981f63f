"""Fuzzing each endpoint's body (hypothesis, bounded for CI) against a server on the fake backend (issue 35).

Properties: no body, however malformed (wrong types, unknown fields, nested content of any shape, numbers of any
size, bytes that are not JSON), gets a 5xx; every 4xx is in the error shape of the API it was sent to: OpenAI's
{"error": {"message", "type", "param", "code"}}, Anthropic's {"type": "error", "error": {"type", "message"}},
llama-server's {"error": {"code", "message", "type"}}.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from helpers import serving  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# every endpoint with a valid body and the fields its API knows (mutated below)
ENDPOINTS = {
    "/v1/chat/completions": (
        {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "w5 w9"}]},
        [
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "tools",
            "tool_choice",
            "response_format",
            "temperature",
            "top_p",
            "n",
            "stop",
            "logprobs",
            "top_logprobs",
            "prediction",
            "seed",
            "stream_options",
            "parallel_tool_calls",
            "chat_template_kwargs",
            "reasoning_effort",
            "user",
        ],
    ),
    "/v1/completions": (
        {"model": "x", "max_tokens": 4, "prompt": "w5 w9"},
        ["prompt", "max_tokens", "stream", "temperature", "stop", "logprobs", "echo", "suffix", "seed", "n", "best_of"],
    ),
    "/v1/responses": (
        {"model": "x", "max_output_tokens": 4, "input": "w5 w9"},
        [
            "input",
            "instructions",
            "max_output_tokens",
            "stream",
            "tools",
            "tool_choice",
            "text",
            "previous_response_id",
            "temperature",
            "top_p",
            "reasoning",
            "store",
            "include",
        ],
    ),
    "/v1/messages": (
        {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "w5 w9"}]},
        [
            "messages",
            "system",
            "max_tokens",
            "stream",
            "tools",
            "tool_choice",
            "stop_sequences",
            "temperature",
            "top_k",
            "top_p",
            "output_config",
            "output_format",
            "thinking",
            "metadata",
            "mcp_servers",
        ],
    ),
    "/v1/messages/count_tokens": (
        {"model": "x", "messages": [{"role": "user", "content": "w5 w9"}]},
        ["messages", "system", "tools", "tool_choice"],
    ),
    "/infill": (
        {"input_prefix": "w5", "input_suffix": "w9", "n_predict": 4},
        [
            "input_prefix",
            "input_suffix",
            "input_extra",
            "prompt",
            "n_predict",
            "max_tokens",
            "stream",
            "temperature",
            "stop",
            "seed",
            "response_fields",
        ],
    ),
}

ROLES = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "", "x"])
BLOCK_TYPES = st.sampled_from(
    [
        "text",
        "image",
        "image_url",
        "tool_use",
        "tool_result",
        "input_text",
        "output_text",
        "function_call",
        "function_call_output",
        "document",
        "thinking",
        "x",
    ]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)
blocks = st.fixed_dictionaries(
    {"type": BLOCK_TYPES},
    optional={
        "text": json_values,
        "content": json_values,
        "input": json_values,
        "id": json_values,
        "name": json_values,
        "tool_use_id": json_values,
        "arguments": json_values | st.just("[" * 3000 + "]" * 3000),
        "call_id": json_values,
        "source": json_values,
        "image_url": json_values,
        "output": json_values,
    },
)
# mostly well-formed, so that the fuzz reaches past the first check: valid roles and call shapes first
ARGUMENTS = st.just("[" * 3000 + "]" * 3000) | st.just('{"a": 1}') | st.text(max_size=12) | json_values
calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.just("c1") | json_values,
            "type": st.just("function") | json_values,
            "function": st.fixed_dictionaries({"name": st.just("f") | json_values}, optional={"arguments": ARGUMENTS}),
        }
    ),
    min_size=1,
    max_size=2,
)
history = st.tuples(  # a well-formed tool round trip whose parts are fuzzed
    st.just({"role": "user", "content": "w5"}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none() | st.text(max_size=5),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.just("c1"),
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries({"name": st.just("f"), "arguments": ARGUMENTS}),
                    }
                ),
                min_size=1,
                max_size=1,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": st.just("c1"),
            "content": st.text(max_size=12) | st.lists(blocks, max_size=2),
        }
    ),
).map(list)
messages = history | st.lists(
    st.just({"role": "user", "content": "w5"})
    | st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(), "tool_calls": calls})
    | st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "tool_call_id": st.just("c1"),
            "content": st.text(max_size=12) | st.lists(blocks, max_size=2),
        }
    )
    | st.fixed_dictionaries(
        {"role": ROLES},
        optional={
            "content": st.text(max_size=12) | st.lists(blocks, max_size=3) | json_values,
            "tool_calls": calls | json_values,
            "tool_call_id": json_values,
            "name": json_values,
        },
    ),
    min_size=1,
    max_size=4,
)

items = st.tuples(
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.just("c1"),  # a round trip
            "name": st.just("f"),
            "arguments": ARGUMENTS,
        }
    ),
    st.just({"type": "function_call_output", "call_id": "c1", "output": "ok"}),
).map(list) | st.lists(
    st.just({"role": "user", "content": "w5"})  # the Responses API's input items
    | st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.just("c1"),
            "name": st.just("f") | json_values,
            "arguments": ARGUMENTS,
        }
    )
    | st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.just("c1")}, optional={"output": json_values}
    )
    | blocks,
    min_size=1,
    max_size=4,
)


@st.composite
def bodies(draw, path: str):
    base, fields = ENDPOINTS[path]
    body = dict(base)
    for name in ("messages", "input"):  # a conversation of any shape, half the time
        if name in fields and draw(st.booleans()):
            body[name] = draw(messages if name == "messages" else items)
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        body[name] = draw(json_values)
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return body


@pytest.fixture(scope="module")
def server():
    with serving() as s:
        yield s


def post(s, path: str, data: bytes) -> tuple[int, bytes]:
    u = urlparse(s.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_answered(path: str, status: int, data: bytes) -> None:
    assert status < 500, (path, status, data[:500])
    if status < 400:
        return
    body = json.loads(data)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["type"].endswith("_error"), body
    elif path == "/infill":
        assert set(body["error"]) == {"code", "message", "type"} and body["error"]["code"] == status, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_a_fuzzed_body_is_answered_or_refused_in_its_apis_shape(server, path):
    @FUZZ
    @given(body=bodies(path))
    def check(body):
        status, data = post(server, path, json.dumps(body).encode())
        assert_answered(path, status, data)

    check()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_bytes_that_are_not_a_body_are_refused_in_its_apis_shape(server, path):
    @settings(max_examples=20, deadline=None)
    @given(data=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
    def check(data):
        status, answer = post(server, path, data)
        assert_answered(path, status, answer)

    check()
