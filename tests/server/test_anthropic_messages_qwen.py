"""`specdec serve`'s Messages API with Qwen2.5-Coder-1.5B through the official `anthropic` client: a tool round trip
streamed and not, and stop sequences, on a loopback server in this process. Greedy: each request sends temperature 0
(in `extra_body`: this anthropic release's `messages.create` takes no `temperature`; left out, the server samples at
Anthropic's documented 1.0), so each reply is the model's own. Slow (seconds per generation on a CPU): `-m qwen`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")


pytestmark = [pytest.mark.real, pytest.mark.qwen]

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}
SYSTEM = (
    "You are a helpful assistant. Call a tool when you need data; once a tool's result is in the conversation, "
    "answer the user's question with it in one sentence."
)
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(qwen_client):
    """The anthropic client on conftest's Qwen loopback server (its base URL without /v1: the client adds it)."""
    return anthropic.Anthropic(
        base_url=str(qwen_client.base_url).removesuffix("/").removesuffix("/v1"),
        api_key="unused",
        max_retries=0,
        timeout=600,
    )


def _turn(client, messages, stream: bool, **kw):
    """One turn, the whole message (the stream accumulated by the anthropic client's helper)."""
    if not stream:
        return client.messages.create(
            model="claude-any", system=SYSTEM, messages=messages, tools=[WEATHER], extra_body={"temperature": 0}, **kw
        )
    with client.messages.stream(
        model="claude-any", system=SYSTEM, messages=messages, tools=[WEATHER], extra_body={"temperature": 0}, **kw
    ) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_round_trip(client, stream):
    first = _turn(client, QUESTION, stream, max_tokens=80)
    assert first.stop_reason == "tool_use", first
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_") and "Paris" in call.input["city"]
    messages = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 22 degrees Celsius."}],
        },
    ]
    final = _turn(client, messages, stream, max_tokens=60)
    assert final.stop_reason == "end_turn", final
    [text] = final.content
    assert text.type == "text" and "22" in text.text
    assert final.usage.cache_read_input_tokens > 0  # the conversation so far came from the KV cache


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    resp = client.messages.create(
        model="claude-any",
        max_tokens=60,
        stop_sequences=["3"],
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count from 1 to 5, digits separated by ', '."}],
    )
    assert resp.stop_reason == "stop_sequence" and resp.stop_sequence == "3"
    assert "1" in resp.content[0].text and "3" not in resp.content[0].text
