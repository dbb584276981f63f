"""Tools on a template without tool support: SmolLM2-135M-Instruct's chat template never reads `tools`, so
`specdec serve` uses the generic format (`server.tool_formats.Generic`: the tools described in a system message,
the whole reply JSON held to a schema), through the official `openai` client on a loopback server in this process.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from helpers import loopback  # noqa: E402
from specdec_cli.session import open_session  # noqa: E402
from specdec_cli.spec import ModelOptions  # noqa: E402

pytestmark = pytest.mark.real

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def served(smollm2_path):
    session = open_session(
        ModelOptions(target=str(smollm2_path), ctx=2048, threads=2, prompt_cache=False), method="ngram"
    )
    with loopback(session, "ngram") as served:
        yield served


def test_a_template_without_tools_gets_the_generic_format_and_a_round_trip(served):
    service, client, _ = served
    assert service.tool_format.name == "generic"
    first = client.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees Celsius."},
    ]
    with client.chat.completions.stream(
        model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    answer = final.choices[0]
    # a text answer (the JSON's "response"), or a call other than the one already answered, never the same again
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    for c in answer.message.tool_calls or ():
        assert (c.function.name, json.loads(c.function.arguments)) != (
            call.function.name,
            json.loads(call.function.arguments),
        )
    if answer.finish_reason == "stop":
        assert answer.message.content and not answer.message.content.lstrip().startswith('{"response"')
