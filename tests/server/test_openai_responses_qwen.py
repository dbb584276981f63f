"""`specdec serve`'s Responses API with Qwen2.5-Coder-1.5B through the official `openai` client (a function tool round
trip, streamed and not; a custom tool held to Codex's apply_patch grammar) and through openai-agents with its default
(Responses) model. Greedy, so each reply is the model's own. Slow: run one file at a time, `-m qwen`.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from helpers import CODEX_GRAMMAR  # noqa: E402
from specdec_cli.core.lark_regex import input_pattern  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.qwen]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}
INSTRUCTIONS = (
    "You are a helpful assistant. Call a tool when you need data; once a tool's result is in the "
    "conversation, answer the user's question with it in one sentence."
)
QUESTION = "What is the weather like in Paris right now?"
BUG = "def add(a, b):\n    return a - b\n"


def _turn(client, input, stream: bool, **kw):  # noqa: F811  (the fixture imported above)
    """One Responses turn, the whole response (a stream accumulated by the openai client's helper)."""
    args = dict(model="qwen", instructions=INSTRUCTIONS, input=input, tools=[WEATHER], temperature=0, **kw)
    if not stream:
        return client.responses.create(**args)
    with client.responses.stream(**args) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_function_tool_round_trip(qwen_client, stream):
    first = _turn(qwen_client, QUESTION, stream, max_output_tokens=80)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert "Paris" in json.loads(call.arguments)["city"]
    history = [
        {"role": "user", "content": QUESTION},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 degrees Celsius."},
    ]
    final = _turn(qwen_client, history, stream, max_output_tokens=60)
    assert final.status == "completed" and [item.type for item in final.output] == ["message"]
    assert "22" in final.output_text, final.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the KV cache
    assert final.model_extra["specdec"]["method"] == "auto"


def test_a_custom_tool_input_is_held_to_codex_apply_patch_grammar(qwen_client):
    tool = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit a file with a patch in the apply_patch format: '*** Begin Patch', then "
        "'*** Update File: PATH', '@@', the changed lines ('-' removed, '+' added, ' ' kept), "
        "then '*** End Patch'.",
        "format": {"type": "grammar", "syntax": "lark", "definition": CODEX_GRAMMAR},
    }
    events = list(
        qwen_client.responses.create(
            model="qwen",
            temperature=0,
            max_output_tokens=200,
            stream=True,
            tools=[tool],
            tool_choice={"type": "custom", "name": "apply_patch"},
            input=f"bug.py holds:\n```python\n{BUG}```\nadd() subtracts. Fix the bug in bug.py with apply_patch.",
        )
    )
    response = events[-1].response
    assert events[-1].type == "response.completed", response
    [call] = response.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch"
    assert re.fullmatch(input_pattern("lark", CODEX_GRAMMAR), call.input), call.input  # raw patch text, in grammar
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == call.input
    assert "bug.py" in call.input and "+" in call.input


def test_openai_agents_default_model_completes_a_tool_round_trip(qwen_client):
    import agents  # (the test extra: a missing or broken install fails here, never skips)

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"Sunny, 22 degrees Celsius in {city}."

    async def run() -> str:
        agents.set_tracing_disabled(True)
        model = agents.OpenAIResponsesModel(
            model="qwen",
            openai_client=openai.AsyncOpenAI(
                base_url=str(qwen_client.base_url), api_key="unused", max_retries=0, timeout=600
            ),
        )
        agent = agents.Agent(
            name="Assistant",
            instructions=INSTRUCTIONS,
            model=model,
            tools=[get_weather],
            model_settings=agents.ModelSettings(temperature=0),
        )
        result = await agents.Runner.run(agent, QUESTION, max_turns=4)
        return result.final_output

    answer = asyncio.run(run())
    assert seen and "Paris" in seen[0]
    assert "22" in answer, answer
