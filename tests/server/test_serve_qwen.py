"""`specdec serve` with Qwen2.5-Coder-1.5B through the official `openai` client: structured outputs, a tool round trip
(streamed and not) and logprobs, on a loopback server in this process. Greedy, so each reply is the model's own.
Slow (each generation takes seconds on a CPU): run one file at a time, `-m qwen`.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from pydantic import BaseModel  # noqa: E402

from specdec_cli.session import open_session  # noqa: E402
from specdec_cli.spec import ModelOptions  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.qwen]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
SYSTEM = (
    "You are a helpful assistant. Call a tool when you need data; once a tool's result is in the conversation, "
    "answer the user's question with it in one sentence."
)
QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the weather like in Paris right now?"},
]


class Person(BaseModel):
    name: str
    age: int


def test_parse_returns_the_pydantic_object(qwen_client):
    resp = qwen_client.chat.completions.parse(
        model="qwen",
        messages=[{"role": "user", "content": "Extract the person: Jason is 25 years old."}],
        response_format=Person,
        max_tokens=40,
        temperature=0,
    )
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 25 and "Jason" in person.name


def test_an_invalid_schema_is_a_bad_request(qwen_client):
    with pytest.raises(openai.BadRequestError) as bad:
        qwen_client.chat.completions.create(
            model="qwen",
            messages=QUESTION,
            max_tokens=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            },
        )
    assert bad.value.body["param"] == "response_format" and "strin" in bad.value.body["message"]


def _turn(client, messages, stream: bool, **kw):
    """One chat turn, the whole completion (the stream accumulated by the openai client's helper)."""
    if not stream:
        return client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0, **kw)
    with client.chat.completions.stream(model="qwen", messages=messages, tools=[WEATHER], temperature=0, **kw) as s:
        return s.get_final_completion()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_round_trip_with_logprobs(qwen_client, stream):
    first = _turn(qwen_client, QUESTION, stream, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert "Paris" in json.loads(call.function.arguments)["city"]
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees Celsius."},
    ]
    final = _turn(qwen_client, messages, stream, max_tokens=60, logprobs=True, top_logprobs=2)
    answer = final.choices[0].message
    assert not answer.tool_calls and "22" in answer.content, answer
    assert final.choices[0].finish_reason == "stop"
    entries = final.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == answer.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in entries)  # greedy: the likeliest token


FINAL = {
    "type": "function",
    "function": {
        "name": "final_result",
        "description": "The final response which ends this conversation",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
    },
}


def test_the_template_is_hermes_and_a_required_call_ends_after_it(qwen_client):
    # issue 27 (A): pydantic-ai's default tool output; Qwen2.5-Coder ends its call with "\n" and its end token, which
    # the grammar used to turn into a second call, and a third, to the token limit
    resp = qwen_client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "The capital of France, please."}],
        tools=[FINAL],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and resp.usage.completion_tokens < 100, resp
    assert [c.function.name for c in choice.message.tool_calls] == ["final_result"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"


def test_the_http_side_s_tokenizer_gives_the_target_s_tokens(qwen_pair):
    """`session.PromptText` (a vocabulary-only load, for count_tokens and requests tokenized off the worker thread)
    renders and tokenizes exactly as the loaded target: a conversation with tools, raw text, and a repo-level FIM
    prompt."""
    from specdec_cli.server.fim import fim_prompt
    from specdec_cli.server.request import Fim

    session = open_session(
        ModelOptions(target=str(qwen_pair[0]), ctx=512, threads=2, prompt_cache=False), method="none"
    )
    with session:
        text = session.prompt_text()
        rendered = text.chat_prompt(QUESTION, tools=[WEATHER])
        assert rendered == session.target.format_chat(QUESTION, add_generation_prompt=True, tools=[WEATHER])
        assert text.tokenize_chat(rendered) == session.tokenize_chat(rendered)
        raw = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # <|fim_prefix|> é"
        assert text.tokenize(raw, add_special=True, parse_special=True) == session.target.tokenize(
            raw, add_special=True, parse_special=True
        )
        fim = Fim(
            prefix="def area(w, h):\n",
            suffix="\n\nprint(area(2, 3))\n",
            extra=(("shapes.py", "def perimeter(w, h):\n    return 2 * (w + h)\n"),),
            repo=True,
        )
        assert fim_prompt(text, fim, n_ctx=512, n_predict=16) == fim_prompt(
            session.target, fim, n_ctx=512, n_predict=16
        )
        assert text.vocab.fingerprint == session.target.vocab_info().fingerprint
