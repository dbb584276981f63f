"""`specdec serve`'s Responses API (`POST /v1/responses`) through the official `openai` client, on the fake backend:
the translation both ways (the body into the conversation the chat template gets, the reply into Responses items and
events), tools (function, custom with a grammar, namespaced, hosted), previous_response_id, and the field policy.

The tool tests run llguidance over `fakes.CHARS`: with every value of a schema an enum, or a grammar that leaves few
choices, the grammar decides the reply, so the served call is known (or checked against its grammar).
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import CHARS, FakeBackend, RecordingBackend, greedy_reference, hashed_logits  # noqa: E402
from helpers import CAPTURES, CODEX_GRAMMAR, PROMPT, PROMPT_TOKENS, serving, text_of  # noqa: E402
from specdec_cli.core.lark_regex import Unsupported, input_pattern  # noqa: E402
from specdec_cli.server.custom_tools import CustomInputs, InputDecoder  # noqa: E402
from specdec_cli.server.reply import Arguments, CallEnd, CallStart  # noqa: E402
from specdec_cli.server.tools import ReplyParser  # noqa: E402

V = len(CHARS)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris"]}, "unit": {"enum": ["C"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
CLOSE = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "parameters": {
        "type": "object",
        "properties": {"target": {"enum": ["a1"]}},
        "required": ["target"],
        "additionalProperties": False,
    },
}
# a custom tool whose grammar leaves the fake model a few choices, with newlines (escaped in the call's JSON)
SUM_GRAMMAR = 'start: "add " NUM " " NUM "\\n" ("ok" | "no") LF\nNUM: /[0-9]{1,2}/\n%import common.LF\n'
SUM = {
    "type": "custom",
    "name": "sum",
    "description": "Adds two numbers.",
    "format": {"type": "grammar", "syntax": "lark", "definition": SUM_GRAMMAR},
}
SUM_INPUT = re.compile(r"add [0-9]{1,2} [0-9]{1,2}\n(ok|no)\n")
PATCH = (
    "*** Begin Patch\n*** Update File: bug.py\n@@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
    "*** End Patch\n"
)


def chars_backend(cls=FakeBackend, **kw) -> FakeBackend:
    return cls(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=2048, **kw)


def events_of(stream) -> list:
    return list(stream)


# -- text, both ways ------------------------------------------------------------------------------------------------
def test_create_is_the_greedy_output_with_usage_status_and_specdec_stats():
    expected = text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 30))
    with serving() as s:
        resp = s.client().responses.create(model="fake", input=PROMPT, max_output_tokens=30)
    assert resp.object == "response" and resp.id.startswith("resp_")
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert resp.output_text == expected
    # cut by max_output_tokens: incomplete, and says why
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert item.status == "incomplete"
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (len(PROMPT_TOKENS), 30, len(PROMPT_TOKENS) + 30)
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    spec = resp.model_extra["specdec"]
    assert spec["method"] == "ngram" and spec["accepted"] <= spec["drafted"]
    assert len(s.lines) == 1 and "responses:" in s.lines[0]


def test_the_stream_is_the_documented_event_sequence_and_ends_as_the_json_does():
    expected = text_of(greedy_reference(hashed_logits, PROMPT_TOKENS, 20))
    with serving() as s:
        client = s.client()
        events = events_of(client.responses.create(model="fake", input=PROMPT, max_output_tokens=20, stream=True))
        again = client.responses.create(model="fake", input=PROMPT, max_output_tokens=20)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, last = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == last.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == expected == last.output_text
    item_id = events[2].item.id
    assert all((d.item_id, d.output_index, d.content_index) == (item_id, 0, 0) for d in deltas)
    assert events[-2].item.content[0].text == expected and last.output[0].id == item_id
    assert last.usage.output_tokens == 20 and last.model_extra["specdec"]["method"] == "ngram"
    # the same conversation again: its prompt is found in the KV cache
    assert again.usage.input_tokens_details.cached_tokens > 0 and again.output_text == expected


def test_the_stream_helper_and_a_json_schema_format():
    from typing import Literal

    from pydantic import BaseModel

    class Colour(BaseModel):
        name: Literal["red"]
        hex: Literal["#f00"]

    with serving(chars_backend()) as s:
        client = s.client()
        with client.responses.stream(model="fake", input="red?", text_format=Colour, max_output_tokens=100) as st:
            kinds = [e.type for e in st]
            final = st.get_final_response()
        parsed = client.responses.parse(model="fake", input="red?", text_format=Colour, max_output_tokens=100)
    assert final.status == "completed" and kinds[-1] == "response.completed"
    assert final.output_parsed == Colour(name="red", hex="#f00") == parsed.output_parsed
    assert json.loads(final.output_text) == {"name": "red", "hex": "#f00"}


def test_input_items_and_instructions_become_the_conversation_the_template_gets():
    backend = chars_backend(RecordingBackend)
    items = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Rule one."}, {"type": "input_text", "text": "Rule two."}],
        },
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "C"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
    ]
    with serving(backend) as s:
        resp = s.client().responses.create(
            model="fake",
            instructions="Be brief.",
            input=items,
            tools=[WEATHER],
            tool_choice="none",
            max_output_tokens=5,
            store=False,
            reasoning={"effort": "low"},
            include=["reasoning.encrypted_content"],
            prompt_cache_key="k",
            metadata={"a": "b"},
            truncation="disabled",
            extra_body={"client_metadata": {"session_id": "s"}},
        )
    messages, tools = backend.rendered
    assert messages == [
        {"role": "system", "content": "Be brief.\n\nRule one.\n\nRule two."},  # instructions + developer: one turn
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
                }
            ],
        },
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    ]
    assert [t["function"]["name"] for t in tools] == ["get_weather"]
    assert resp.output[0].type == "message"  # tool_choice none: text


# -- function tools -------------------------------------------------------------------------------------------------
def test_a_function_call_round_trip_streamed_and_not():
    backend = chars_backend(RecordingBackend)
    with serving(backend) as s:
        client = s.client()
        first = client.responses.create(
            model="fake",
            input="weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
        )
        events = events_of(
            client.responses.create(
                model="fake",
                input="weather in Paris?",
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                max_output_tokens=200,
                stream=True,
            )
        )
        [call] = first.output
        second = client.responses.create(
            model="fake",
            tools=[WEATHER],
            tool_choice="none",
            max_output_tokens=5,
            input=[
                {"role": "user", "content": "weather in Paris?"},
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"},
            ],
        )
    assert first.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.arguments == '{"city": "Paris", "unit": "C"}'
    # streamed: the call's item, its argument deltas, done events, and the same call in response.completed
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(d.delta for d in deltas) == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.name == "get_weather"
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    final = events[-1].response.output[0]
    assert final.arguments == call.arguments and final.call_id == events[2].item.call_id
    assert "message" not in kinds  # no text item: the reply is the call
    # the call and its output went back to the template as the assistant's call and a tool turn
    messages, _ = backend.rendered
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "content": "22 C", "tool_call_id": call.call_id}
    assert second.output[0].type == "message"


# -- custom tools ---------------------------------------------------------------------------------------------------
def test_a_custom_grammar_tools_input_is_held_to_its_grammar_streamed_and_not():
    with serving(chars_backend()) as s:
        client = s.client()
        resp = client.responses.create(
            model="fake",
            input="add two numbers",
            tools=[SUM],
            tool_choice={"type": "custom", "name": "sum"},
            max_output_tokens=200,
        )
        events = events_of(
            client.responses.create(
                model="fake",
                input="add two numbers",
                tools=[SUM],
                tool_choice={"type": "custom", "name": "sum"},
                max_output_tokens=200,
                stream=True,
            )
        )
    [call] = resp.output
    assert call.type == "custom_tool_call" and call.name == "sum" and call.id.startswith("ctc_")
    assert SUM_INPUT.fullmatch(call.input), call.input  # raw text, not JSON: its newlines are newlines
    deltas = [e for e in events if e.type == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert "".join(d.delta for d in deltas) == done.input == call.input  # the same greedy call
    assert events[-1].type == "response.completed" and events[-1].response.output[0].input == call.input


def test_a_regex_custom_tool_and_a_text_custom_tool():
    shout = {
        "type": "custom",
        "name": "shout",
        "format": {"type": "grammar", "syntax": "regex", "definition": r"(HEY|HO)!{1,3}"},
    }
    note = {"type": "custom", "name": "note", "description": "Free text."}
    with serving(chars_backend()) as s:
        client = s.client()
        loud = client.responses.create(
            model="fake",
            input="x",
            tools=[shout, note],
            tool_choice={"type": "custom", "name": "shout"},
            max_output_tokens=120,
        )
        free = client.responses.create(
            model="fake",
            input="x",
            tools=[shout, note],
            tool_choice={"type": "custom", "name": "note"},
            max_output_tokens=80,
        )
        cut = client.responses.create(
            model="fake",
            input="x",
            tools=[shout, note],
            tool_choice={"type": "custom", "name": "note"},
            max_output_tokens=30,
        )
    assert re.fullmatch(r"(HEY|HO)!{1,3}", loud.output[0].input)
    assert free.output[0].type == "custom_tool_call" and free.output[0].name == "note"
    # a call the token limit cut is never returned (issue 27): the reply is incomplete, with no call in it
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in cut.output] == ["message"]


def test_a_past_custom_call_goes_back_to_the_template_as_its_input():
    backend = chars_backend(RecordingBackend)
    history = [
        {"role": "user", "content": "fix it"},
        {
            "type": "custom_tool_call",
            "id": "ctc_1",
            "call_id": "call_9",
            "name": "apply_patch",
            "input": PATCH,
            "status": "completed",
        },
        {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Success."},
    ]
    patch_tool = {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": CODEX_GRAMMAR},
    }
    with serving(backend) as s:
        s.client().responses.create(
            model="fake", input=history, tools=[patch_tool], tool_choice="none", max_output_tokens=3
        )
    messages, tools = backend.rendered
    assert messages[1]["tool_calls"] == [
        {"id": "call_9", "type": "function", "function": {"name": "apply_patch", "arguments": {"input": PATCH}}}
    ]
    assert messages[2] == {"role": "tool", "content": "Success.", "tool_call_id": "call_9"}
    shown = tools[0]["function"]["parameters"]["properties"]["input"]
    assert shown["type"] == "string" and "begin_patch" in shown["description"]  # the grammar, not the regex


def test_codex_apply_patch_grammar_becomes_one_regex_of_the_same_language():
    pattern = re.compile(input_pattern("lark", CODEX_GRAMMAR))
    assert pattern.fullmatch(PATCH)
    assert pattern.fullmatch("*** Begin Patch\n*** Add File: a.py\n+print(1)\n*** End Patch")  # LF? at the end
    assert pattern.fullmatch("*** Begin Patch\n*** Delete File: a.py\n*** End Patch\n")
    for bad in (
        "*** Begin Patch\n*** End Patch\n",  # hunk+
        "*** Begin Patch\n*** Update File: a.py\nno prefix\n*** End Patch\n",
        PATCH.replace("*** Begin", "** Begin"),
    ):
        assert not pattern.fullmatch(bad)


def test_recursion_is_unrolled_and_what_a_regex_cannot_say_is_refused():
    parens = re.compile(input_pattern("lark", 'start: expr\nexpr: "(" expr ")" | "x"\n', depth=3))
    assert parens.fullmatch("((x))") and not parens.fullmatch("(((x)))")  # three levels deep, no more
    assert not parens.fullmatch("((x)")
    ignored = re.compile(input_pattern("lark", 'start: "a" "b"\n%ignore " "\n'))
    assert ignored.fullmatch(" a  b ") and not ignored.fullmatch("a-b")
    assert re.compile(input_pattern("lark", 'start: "ab"i ("c".."e")+ ~ 2\n')).fullmatch("aBcd")
    for grammar, says in [
        ('start: %json {"type": "object"}\n', "%json"),
        ("start: <|eot|>\n", "special token"),
        ("start: A\nA: /a+/ & /aa/\n", "'&'"),
        ("start: b\n", "'b' is used but not defined"),
        ('a: "x"\n', "no start rule"),
    ]:
        with pytest.raises(Unsupported, match=re.escape(says)):
            input_pattern("lark", grammar)


def test_the_input_decoder_streams_the_decoded_string_however_the_json_is_cut():
    text = 'line "one"\n\ttwo \\ é 😀 end'
    args = json.dumps({"input": text}, ensure_ascii=True)
    for cut in range(1, len(args)):
        dec = InputDecoder()
        got = dec.feed(args[:cut]) + dec.feed(args[cut:])
        assert got == text, cut
        assert dec.finish(args) == (text, "")
    # through the parser: a custom call's events carry the input, its end the raw text
    parser = CustomInputs(ReplyParser(True), frozenset({"sum"}))
    call = '<tool_call>\n{"name": "sum", "arguments": ' + json.dumps({"input": "add 1 2\nok\n"}) + "}\n</tool_call>"
    events = [e for piece in (call[:30], call[30:45], call[45:]) for e in parser.feed(piece)] + parser.close()
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(c.call.name, c.call.kind) for c in starts] == [("sum", "custom")]
    assert "".join(e.text for e in events if isinstance(e, Arguments)) == "add 1 2\nok\n"
    [end] = [e for e in events if isinstance(e, CallEnd)]
    assert (end.call.arguments, end.call.kind) == ("add 1 2\nok\n", "custom")


# -- namespaces and hosted tools ------------------------------------------------------------------------------------
def test_namespace_tools_are_flattened_for_the_model_and_calls_name_their_namespace_again():
    backend = chars_backend(RecordingBackend)
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [CLOSE]}
    with serving(backend) as s:
        client = s.client()
        resp = client.responses.create(
            model="fake",
            input="close a1",
            tools=[namespace],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=100,
        )
        _, shown = backend.rendered
        [call] = resp.output
        client.responses.create(
            model="fake",
            tools=[namespace],
            tool_choice="none",
            max_output_tokens=3,
            input=[
                {"role": "user", "content": "close a1"},
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
            ],
        )
        messages, _ = backend.rendered
        # the same bare name in two places: the namespaced one is namespace__name
        clash = client.responses.create(
            model="fake",
            input="x",
            tools=[namespace, {**CLOSE, "description": "b"}],
            tool_choice="none",
            max_output_tokens=3,
        )
        _, clashing = backend.rendered
    assert [t["function"]["name"] for t in shown] == ["close_agent"]
    assert call.type == "function_call" and call.name == "close_agent"
    assert call.model_extra.get("namespace") == "multi_agent_v1" or getattr(call, "namespace", None) == "multi_agent_v1"
    assert messages[1]["tool_calls"][0]["function"]["name"] == "close_agent"
    assert sorted(t["function"]["name"] for t in clashing) == ["close_agent", "multi_agent_v1__close_agent"]
    assert clash.status in ("completed", "incomplete")


def test_hosted_tools_are_left_out_and_logged_once_never_a_400():
    backend = chars_backend(RecordingBackend)
    tools = [
        {"type": "web_search", "external_web_access": False},
        WEATHER,
        {"type": "tool_search", "execution": "client", "description": "x", "parameters": {}},
    ]
    with serving(backend) as s:
        client = s.client()
        for _ in range(2):
            resp = client.responses.create(model="fake", input="hi", tools=tools, max_output_tokens=3)
        _, shown = backend.rendered
        only_hosted = client.responses.create(model="fake", input="hi", tools=tools[:1], max_output_tokens=3)
        with pytest.raises(openai.BadRequestError) as forced:
            client.responses.create(
                model="fake", input="hi", tools=tools, tool_choice={"type": "web_search_preview"}, max_output_tokens=3
            )
    assert [t["function"]["name"] for t in shown] == ["get_weather"]
    notes = [line for line in s.lines if "left out" in line]
    assert notes == [
        "responses: left out of the prompt, as a local server cannot run them: web_search, tool_search",
        "responses: left out of the prompt, as a local server cannot run them: web_search",
    ]
    assert resp.status in ("completed", "incomplete") and only_hosted.output[0].type == "message"
    assert forced.value.body["param"] == "tool_choice"


# -- previous_response_id and the field policy ----------------------------------------------------------------------
def test_previous_response_id_continues_a_held_response_and_an_unknown_one_is_a_400():
    backend = chars_backend(RecordingBackend)
    with serving(backend) as s:
        client = s.client()
        first = client.responses.create(model="fake", input="hello", max_output_tokens=5)
        second = client.responses.create(
            model="fake", input="and then?", previous_response_id=first.id, max_output_tokens=5
        )
        messages, _ = backend.rendered
        held = client.responses.retrieve(second.id)
        unstored = client.responses.create(model="fake", input="x", store=False, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as missing:
            client.responses.create(model="fake", input="x", previous_response_id=unstored.id)
        with pytest.raises(openai.BadRequestError) as unknown:
            client.responses.create(model="fake", input="x", previous_response_id="resp_nope")
    assert messages == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
    ]
    assert second.previous_response_id == first.id and held.id == second.id
    for err in (missing, unknown):
        assert err.value.body["param"] == "previous_response_id"
        assert err.value.body["code"] == "previous_response_not_found"
    assert "holds the last 64 responses" in unknown.value.body["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "nonsense"}]}, "input.0.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format.schema"),
        (
            {
                "tools": [
                    {
                        "type": "custom",
                        "name": "t",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: <|x|>\n"},
                    }
                ]
            },
            "tools.0.format.definition",
        ),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "any"}, "tools": [WEATHER]}, "tool_choice.mode"),
    ],
)
def test_fields_that_change_the_reply_are_refused_with_a_400_naming_them(extra, param):
    body = {"model": "fake", "input": "hi", "max_output_tokens": 3, **extra}
    with serving(chars_backend()) as s:
        status, answer = s.raw("POST", "/v1/responses", json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def test_a_captured_codex_request_is_served_as_codex_needs_it():
    """The third request of a Codex CLI 0.169 session (catalog metadata: apply_patch as a custom Lark tool,
    tool_search and web_search hosted, a function_call and a custom_tool_call with their outputs in the input), as
    tests/data/captures/codex holds it."""
    capture = CAPTURES / "codex" / "003-POST-v1_responses.json"
    # the toy vocabulary is ASCII: other characters become "?"
    body = json.loads(
        capture.read_text().encode("ascii", "replace").decode(),
        object_hook=lambda d: {
            k: v.encode("ascii", "replace").decode() if isinstance(v, str) else v for k, v in d.items()
        },
    )["body_json"]
    body["max_output_tokens"] = 40
    backend = FakeBackend(lambda p: hashed_logits(p, V, peak=2.0), vocab=V, pieces=CHARS, n_ctx=65536, n_batch=512)
    with serving(backend) as s:
        import http.client
        from urllib.parse import urlparse

        u = urlparse(s.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request(
            "POST",
            "/v1/responses",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        resp = conn.getresponse()
        raw = resp.read().decode()
        conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream"), raw[:500]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names == [e["type"] for e in events]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["id"] and events[-1]["response"]["usage"]["input_tokens"] > 5000
    assert any("web_search" in line and "tool_search" in line for line in s.lines)


def test_include_logprobs_gives_the_texts_log_probabilities_streamed_and_not():
    with serving() as s:
        client = s.client()
        resp = client.responses.create(
            model="fake", input=PROMPT, max_output_tokens=8, top_logprobs=2, include=["message.output_text.logprobs"]
        )
        events = events_of(
            client.responses.create(
                model="fake",
                input=PROMPT,
                max_output_tokens=8,
                top_logprobs=2,
                include=["message.output_text.logprobs"],
                stream=True,
            )
        )
        plain = client.responses.create(model="fake", input=PROMPT, max_output_tokens=8)
    part = resp.output[0].content[0]
    assert len(part.logprobs) == 8 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in part.logprobs)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert events[-1].response.output[0].content[0].logprobs[0].token == part.logprobs[0].token
    assert plain.output[0].content[0].logprobs == []
