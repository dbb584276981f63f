"""`specdec serve`'s structured outputs, tool calls and logprobs, on the fake backend (exact) and in unit tests.

The grammar tests run llguidance over `fakes.CHARS` (a byte-complete toy vocabulary): with every value of a schema an
enum, a grammar forces every token of the reply, so the served tool call and JSON are known in advance.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Literal

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import CHARS, FakeBackend, RecordingBackend, greedy_tokenize, hashed_logits  # noqa: E402
from helpers import (  # noqa: E402
    PROMPT,
    PROMPT_TOKENS,
    TIME,
    WEATHER,
    accepts,
    chat,
    scripted,
    serving,
    text_of,
    tools_backend,
)
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from specdec_cli.core.records import Finish, Step  # noqa: E402
from specdec_cli.errors import ToolsUnsupportedError  # noqa: E402
from specdec_cli.models.llama import render_chat_template  # noqa: E402
from specdec_cli.server.openai_chat import check_tools  # noqa: E402
from specdec_cli.server.tools import (  # noqa: E402
    Arguments,
    CallStart,
    Content,
    ReplyParser,
    Tags,
    grammar,
)

V = len(CHARS)
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def ask(client, content: str = "weather in Paris?", **kw):
    return client.chat.completions.create(model="fake", messages=[{"role": "user", "content": content}], **kw)


# -- tool calls through the server ------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_call_followed_by_a_newline_and_the_end_token_ends_the_reply(choice):
    # Qwen2.5-Coder ends its calls with "</tool_call>\n" and then its end token (both at p ~ 1); a grammar that let
    # "\n" only start another call forced a second call, then a third...: pydantic-ai's reply to a full context
    reply = FORCED_CALL + "\n"
    b = FakeBackend(scripted(reply), vocab=V, pieces=CHARS, n_ctx=512)
    prompt = b.tokenize("Q:~")
    tools = check_tools([WEATHER], choice, None)
    records = list(
        SpeculativeEngine(b).generate(prompt, GenerationConfig(grammar=grammar(tools, Tags()), max_tokens=300))
    )
    out = b"".join(CHARS[t] for r in records if isinstance(r, Step) for t in r.emitted).decode()
    assert out == reply
    assert records[-1] == Finish("eog")


def test_a_forced_tool_call_is_served_as_tool_calls_streamed_and_not():
    with serving(tools_backend()) as s:
        client = s.client()
        resp = ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200)
        chunks = list(
            ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200, stream=True)
        )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "unit": "C"}'  # as written: one line, ", " and ": "
    # the call, then the newline the grammar allows after the calls (issue 27: the model's own ending before its end
    # token; this fake model, at random, takes "\n" over its end token, which the grammar then forces)
    assert resp.usage.completion_tokens == len(greedy_tokenize(CHARS, FORCED_CALL.encode() + b"\n", set()))
    # the stream: the role, the call's header (index, id, type, name, empty arguments), then argument pieces
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(not d.content for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    head = calls[0]
    assert (head.index, head.type, head.function.name, head.function.arguments) == (0, "function", "get_weather", "")
    assert head.id.startswith("call_")
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert "".join(tc.function.arguments for tc in calls[1:]) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def heads(chunks) -> list:
    """The streamed calls' first deltas (index, id, name)."""
    return [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or () if tc.id is not None]


def test_a_reply_ends_before_it_repeats_a_call_and_nothing_of_the_repeat_streams():
    # a greedy model copies its call (prompt lookup drafts each copy): the reply ends before the first repeat
    script = FORCED_CALL + "\n" + TIME_CALL + "\n" + FORCED_CALL + "\n" + TIME_CALL + "\n"
    backend = FakeBackend(scripted(script), vocab=V, pieces=CHARS, n_ctx=1024)
    with serving(backend) as s:
        whole = ask(s.client(), "weather?~", tools=[WEATHER, TIME], tool_choice="required", max_tokens=400)
        chunks = list(
            ask(s.client(), "weather?~", tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, stream=True)
        )
        lines = list(s.lines)
    calls = whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "C"}'),
        ("get_time", '{"zone": "UTC"}'),
    ]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [(h.index, h.function.name) for h in heads(chunks)] == [(0, "get_weather"), (1, "get_time")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "ended before a repeated tool call" in lines[0] and "finish stop" in lines[0]


def test_a_call_cut_by_the_token_limit_is_never_returned_nor_streamed():
    script = FORCED_CALL + "\n" + TIME_CALL + "\n"
    budget = len(greedy_tokenize(CHARS, (FORCED_CALL + "\n" + TIME_CALL[:30]).encode(), set()))
    backend = FakeBackend(scripted(script), vocab=V, pieces=CHARS, n_ctx=1024)
    with serving(backend) as s:
        whole = ask(s.client(), "weather?~", tools=[WEATHER, TIME], max_tokens=budget)
        chunks = list(ask(s.client(), "weather?~", tools=[WEATHER, TIME], max_tokens=budget, stream=True))
        head = len(greedy_tokenize(CHARS, b'<tool_call>\n{"na', set()))
        cut_early = ask(s.client(), "weather?~", tools=[WEATHER, TIME], max_tokens=head)  # inside the call's head
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "length"
    assert not whole.choices[0].message.content  # the cut call's text is not content either
    assert [h.function.name for h in heads(chunks)] == ["get_weather"]
    args = "".join(tc.function.arguments for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ())
    assert args == '{"city": "Paris", "unit": "C"}'
    assert cut_early.choices[0].message.tool_calls is None and not cut_early.choices[0].message.content
    assert cut_early.choices[0].finish_reason == "length"


def test_a_call_the_last_turn_made_and_got_a_result_for_is_not_made_again():
    # openai-agents' MaxTurnsExceeded: the same call again after the tool's result. The repeat is dropped and, the
    # reply being empty then, generated again without tool calls; a call the last turn did not make is fine
    def conversation(name, arguments):
        return [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C~"},
        ]

    backend = FakeBackend(scripted(FORCED_CALL + "\n"), vocab=V, pieces=CHARS, n_ctx=1024)
    with serving(backend) as s:
        client = s.client()
        again = client.chat.completions.create(  # the same call, its arguments in another key order and layout
            model="fake",
            messages=conversation("get_weather", '{"unit":"C",  "city":"Paris"}'),
            tools=[WEATHER, TIME],
            max_tokens=120,
        )
        chunks = list(
            client.chat.completions.create(
                model="fake",
                messages=conversation("get_weather", '{"unit":"C",  "city":"Paris"}'),
                tools=[WEATHER, TIME],
                max_tokens=120,
                stream=True,
            )
        )
        other = client.chat.completions.create(
            model="fake", messages=conversation("get_time", '{"zone": "UTC"}'), tools=[WEATHER, TIME], max_tokens=120
        )
        lines = list(s.lines)
    assert again.choices[0].message.tool_calls is None
    assert "<tool_call>" not in again.choices[0].message.content and again.choices[0].message.content
    assert again.choices[0].finish_reason in ("stop", "length")
    assert heads(chunks) == []
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == again.choices[0].message.content
    assert "generated again without tools" in lines[0]
    [call] = other.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and other.choices[0].finish_reason == "tool_calls"


def test_the_openai_stream_helper_accumulates_a_named_call():
    with serving(tools_backend()) as s:
        with s.client().chat.completions.stream(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            max_tokens=200,
        ) as stream:
            final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_time"  # the named function only
    assert json.loads(call.function.arguments) == {"zone": "UTC"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_parallel_calls_stream_with_their_own_index_and_id():
    script = FORCED_CALL + "\n" + TIME_CALL + "\n"
    backend = FakeBackend(scripted(script), vocab=V, pieces=CHARS, n_ctx=1024)
    with serving(backend) as s:
        chunks = list(
            ask(s.client(), "weather?~", tools=[WEATHER, TIME], tool_choice="required", stream=True, max_tokens=200)
        )
        whole = ask(s.client(), "weather?~", tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [h.index for h in heads(chunks)] == [0, 1] and len({h.id for h in heads(chunks)}) == 2
    args = ["".join(tc.function.arguments for tc in calls if tc.index == i) for i in range(2)]
    assert args == ['{"city": "Paris", "unit": "C"}', '{"zone": "UTC"}']
    assert [c.function.arguments for c in whole.choices[0].message.tool_calls] == args
    assert whole.choices[0].finish_reason == "tool_calls"


def test_tool_turns_are_accepted_and_none_keeps_tool_calls_out():
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    backend = RecordingBackend(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=1024)
    with serving(backend) as s:
        resp = s.client().chat.completions.create(
            model="fake", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30
        )
    template_messages, template_tools = backend.rendered
    assert resp.choices[0].message.tool_calls is None
    assert "<tool_call>" not in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason in ("stop", "length")
    # the template gets Hugging Face's shape: the arguments as an object, the tool result with its call's id
    assert template_messages[1]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
        }
    ]
    assert template_messages[2] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}
    assert template_tools == [WEATHER]


def test_response_format_json_schema_and_parse_with_a_pydantic_model():
    from pydantic import BaseModel

    class Colour(BaseModel):
        name: Literal["red"]
        hex: Literal["#f00"]

    with serving(tools_backend()) as s:
        client = s.client()
        parsed = client.chat.completions.parse(
            model="fake", messages=[{"role": "user", "content": "red?"}], response_format=Colour, max_tokens=100
        )
        obj = ask(client, response_format={"type": "json_object"}, max_tokens=60)
        short = ask(
            client,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "colour", "schema": Colour.model_json_schema()},
            },
            max_tokens=4,
        )
    assert parsed.choices[0].message.parsed == Colour(name="red", hex="#f00")
    # a schema that cannot be finished within max_tokens ends with "length", the object's beginning written
    assert short.choices[0].finish_reason == "length" and '{"name": "red", "hex": "#f00"}'.startswith(
        short.choices[0].message.content
    )
    assert parsed.choices[0].finish_reason == "stop"
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the budget ran out inside the object: what there is is an object's beginning
        assert content.startswith("{")


# -- logprobs -------------------------------------------------------------------------------------------------------
def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - (np.log(np.exp(x - x.max()).sum()) + x.max())


def test_chat_logprobs_are_the_targets_streamed_and_not():
    with serving() as s:
        client = s.client()
        resp = chat(client, max_tokens=12, logprobs=True, top_logprobs=3)
        chunks = list(chat(client, max_tokens=12, logprobs=True, top_logprobs=3, stream=True))
        plain = chat(client, max_tokens=12)
    entries = resp.choices[0].logprobs.content
    assert plain.choices[0].logprobs is None
    assert len(entries) == resp.usage.completion_tokens == 12
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    first = _log_softmax(hashed_logits(PROMPT_TOKENS))
    token = int(np.argmax(first))
    assert entries[0].token == text_of([token]) and entries[0].bytes == list(text_of([token]).encode())
    assert entries[0].logprob == pytest.approx(first[token], abs=1e-4)
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the most likely one
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob <= 0
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs_in_the_legacy_shape():
    with serving() as s:
        client = s.client()
        resp = client.completions.create(model="fake", prompt=PROMPT, max_tokens=8, logprobs=2)
        chunks = list(client.completions.create(model="fake", prompt=PROMPT, max_tokens=8, logprobs=2, stream=True))
    lp = resp.choices[0].logprobs
    assert "".join(lp.tokens) == resp.choices[0].text
    assert len(lp.token_logprobs) == 8 and all(v <= 0 for v in lp.token_logprobs)
    assert all(
        len(top) == 2 and max(top, key=top.get) == tok for top, tok in zip(lp.top_logprobs, lp.tokens, strict=False)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


# -- refused: 400 naming the field ----------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"5": 3}}, "logit_bias"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": BAD_SCHEMA}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "none"}}},
            "tool_choice.allowed_tools.mode",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": USER + [{"role": "tool", "content": "22 C"}]}, "messages.1.tool_call_id"),
        (
            {
                "messages": USER
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    }
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_unsupported_or_invalid_fields_get_400_naming_them(body, param):
    """Fields that change what must come back, or are malformed. (`store`, `reasoning_effort`, `service_tier`, an
    unknown field, a schema's `description` and a message's `name` only inform: accepted,
    tests/server/test_fields.py.)"""
    with serving() as s:
        status, reply = s.raw(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "fake", "messages": USER, "max_tokens": 2, **body}).encode(),
        )
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"tools": []}, "tools"),
    ],
)
def test_unsupported_completion_fields_get_400(body, param):
    with serving() as s:
        status, reply = s.raw(
            "POST", "/v1/completions", json.dumps({"model": "fake", "prompt": PROMPT, "max_tokens": 2, **body}).encode()
        )
    assert status == 400 and reply["error"]["param"] == param, reply


def test_neutral_values_of_refused_fields_and_labels_are_accepted():
    with serving() as s:
        resp = chat(
            s.client(),
            max_tokens=3,
            frequency_penalty=0,
            presence_penalty=0.0,
            logit_bias={},
            store=False,
            modalities=["text"],
            service_tier="auto",
            user="ann",
            safety_identifier="x",
            response_format={"type": "text"},
            parallel_tool_calls=True,
        )
        with pytest.raises(openai.BadRequestError) as bad:
            chat(s.client(), max_tokens=3, response_format=BAD_SCHEMA)
    assert resp.usage.completion_tokens == 3
    assert bad.value.body["param"] == "response_format" and "objekt" in bad.value.body["message"]


def test_a_template_that_refuses_tools_gets_400():
    # a template without tool support gets the generic format (test_serve_tool_formats); one detected as taking
    # tools that then refuses them is a 400 naming tools, never a silent drop
    class NoTools(FakeBackend):
        def format_chat(self, messages, *, add_generation_prompt=True, tools=None):
            if tools:
                raise ToolsUnsupportedError("The chat template of fake.gguf cannot express tools.", "Leave them out.")
            return super().format_chat(messages)

    with serving(NoTools()) as s:
        with pytest.raises(openai.BadRequestError) as bad:
            ask(s.client(), tools=[WEATHER], max_tokens=3)
    assert bad.value.body["param"] == "tools" and "cannot express tools" in bad.value.body["message"]


def test_render_refuses_tools_for_a_template_that_never_reads_them():
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with_tools = "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}" + plain
    tool_turn = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "22", "tool_call_id": "c"}]
    with pytest.raises(ToolsUnsupportedError, match="cannot express tools"):
        render_chat_template(plain, [{"role": "user", "content": "hi"}], bos_token="", eos_token="", tools=[WEATHER])
    with pytest.raises(ToolsUnsupportedError, match="tool calls and tool results"):
        render_chat_template(plain, tool_turn, bos_token="", eos_token="")
    out = render_chat_template(
        with_tools, [{"role": "user", "content": "hi"}], bos_token="", eos_token="", tools=[WEATHER]
    )
    assert out.startswith('TOOLS [{"type": "function"') and "user: hi" in out


# -- the grammar (llguidance over the CHARS vocabulary) ---------------------------------------------------------------
def test_the_tool_grammar_per_tool_choice():
    tools = check_tools([WEATHER, TIME], None, None)
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    auto = grammar(tools, Tags()).lark
    assert accepts(auto, "Just text, <b>bold</b>.") and accepts(auto, FORCED_CALL)
    assert accepts(auto, FORCED_CALL + "\n" + time_call)  # parallel calls
    assert accepts(auto, "Let me look.\n" + FORCED_CALL)
    assert not accepts(auto, FORCED_CALL.replace("Paris", "Rome"))  # arguments follow the schema
    assert not accepts(auto, FORCED_CALL.replace("get_weather", "get_wetter"))
    assert not accepts(auto, FORCED_CALL + " and more text")
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "unit": "C"}\n}\n```'
    assert accepts(auto, fenced)  # Qwen2.5-Coder's habit, whitespace free
    assert not accepts(auto, fenced.replace("get_weather", "get_wetter"))
    assert accepts(auto, "```json\n[1, 2]\n```")  # a JSON block that holds no object is text
    bare = '{"name": "get_weather",\n "arguments": {"city": "Paris", "unit": "C"}}'
    assert accepts(auto, bare) and not accepts(auto, '{"a": 1}')  # a reply that opens with { is a call
    required = grammar(replace(tools, mode="required"), Tags()).lark
    assert accepts(required, FORCED_CALL) and not accepts(required, "text")
    single = grammar(replace(tools, mode="required", parallel=False), Tags()).lark
    assert accepts(single, FORCED_CALL) and not accepts(single, FORCED_CALL + "\n" + time_call)
    named = grammar(
        check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None), Tags()
    ).lark
    assert accepts(named, time_call) and not accepts(named, FORCED_CALL)
    assert not accepts(named, time_call + "\n" + time_call)  # a named function is called once
    none = grammar(replace(tools, mode="none"), Tags()).lark
    assert accepts(none, "text") and not accepts(none, FORCED_CALL) and not accepts(none, "a " + FORCED_CALL)
    with_format = grammar(
        tools,
        Tags(),
        reply={"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"], "additionalProperties": False},
    ).lark
    assert accepts(with_format, '{"a": 1}') and accepts(with_format, FORCED_CALL)
    assert not accepts(with_format, "text")


def test_special_tags_are_written_as_llguidance_special_tokens():
    tools = check_tools([WEATHER], "required", None)
    lark = grammar(tools, Tags(special=True)).lark
    assert "call: <tool_call> call_body" in lark and "</tool_call>" in lark and '"<tool_call>"' not in lark
    from specdec_cli.server.tools import detect_tags

    assert detect_tags(tools_backend().tokenize, tools_backend().piece) == Tags(special=False)
    vocab = {"<tool_call>": [7], "</tool_call>": [8]}
    assert detect_tags(lambda t: vocab[t], lambda i: {7: b"<tool_call>", 8: b"</tool_call>"}[i]) == Tags(True)


# -- the reply parser -----------------------------------------------------------------------------------------------
def _parse(chunks, loose=True):
    p = ReplyParser(True, loose=loose)
    events = [e for c in chunks for e in p.feed(c)] + p.close()
    content = "".join(e.text for e in events if isinstance(e, Content))
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, Arguments):
            args[e.index] = args.get(e.index, "") + e.text
    starts = [e.call.name for e in events if isinstance(e, CallStart)]
    return content, starts, [args.get(i, "") for i in range(len(starts))], p


@pytest.mark.parametrize(
    "text, content, names, args",
    [
        (
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": {"a": 1}}}\n'
            "</tool_call>\n"
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
            "Sure.",
            ["get_weather", "get_time"],
            ['{"city": "Pa}ris", "n": {"a": 1}}', "{}"],
        ),
        (
            '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
            "",
            ["get_weather"],
            ['{\n    "city": "Paris"\n  }'],
        ),
        ("```json\n[1]\n```", "```json\n[1]\n```", [], []),
        ('{"name": "f", "arguments": {"a": {"b": 1}}}\n', "", ["f"], ['{"a": {"b": 1}}']),
        ('{"a": 1}', '{"a": 1}', [], []),
        ("Plain text with <b>tags</b> and a < sign.\n", "Plain text with <b>tags</b> and a < sign.\n", [], []),
        ("<tool_call>\nnot a call\n</tool_call> after", "<tool_call>\nnot a call\n</tool_call> after", [], []),
        ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "", ["f"], ['{"a": 1}']),
        ('<tool_call>\n{"name": "f", "arguments": {"a": "cut sh', "", ["f"], ['{"a": "cut sh']),
    ],
)
def test_the_parser_gives_the_same_reply_however_the_text_is_split(text, content, names, args):
    for seed in range(200):
        r = random.Random(seed)
        cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(0, 30))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        got = _parse(chunks)
        assert got[:3] == (content, names, args), chunks
        assert [c.arguments for c in got[3].calls] == args


def test_bare_and_fenced_calls_only_when_loose():
    bare = '{"name": "f", "arguments": {"a": 1}}'
    assert _parse([bare], loose=True)[1] == ["f"]
    assert _parse([bare], loose=False)[:2] == (bare, [])  # e.g. a response_format reply next to tools
    fenced = "```json\n" + bare + "\n```"
    assert _parse([fenced], loose=False)[:2] == (fenced, [])


def test_the_parser_passes_text_through_without_tools():
    p = ReplyParser(False)
    assert p.feed("<tool_call>\n{") == [Content("<tool_call>\n{")] and p.close() == []
