"""Tool calls on every template family (`server.tool_formats`): each real chat template is detected, rendered with
tools and with a past call and its result, and its replies constrained and parsed, through the server and the
`openai` client, on the fake backend: a scripted model writes the format's call over the byte-complete `CHARS`
vocabulary, so the served call is known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import CHARS, FakeBackend  # noqa: E402
from helpers import TIME, WEATHER, accepts, scripted, serving  # noqa: E402
from specdec_cli.server.reply import Arguments, CallStart, Content  # noqa: E402
from specdec_cli.server.tool_formats import (  # noqa: E402
    Generic,
    GenericParser,
    JsonCallsParser,
    Llama3,
    MistralV3,
    Phi4,
    detect,
)

V = len(CHARS)
TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
ARGS = {"city": "Paris", "unit": "C"}

# template, format, the generation prompt's end (where the scripted model starts), a call, a text reply
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": (
        "hermes",
        "<|im_start|>assistant\n",
        '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>\n',
        "%s",
    ),
    "meta-llama-Llama-3.2-3B-Instruct": (
        "llama3",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        '{"name": "get_weather", "parameters": %s}',
        "%s",
    ),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        "mistral",
        ("[/INST]", "[/TOOL_RESULTS]"),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}]',
        "%s",
    ),
    "microsoft-Phi-4-mini-instruct": (
        "phi4",
        "<|assistant|>",
        'functools[{"name": "get_weather", "arguments": %s}]',
        "%s",
    ),
    "google-gemma-2-2b-it": (
        "generic",
        "<start_of_turn>model\n",
        '{"tool_calls": [{"name": "get_weather", "arguments": %s}]}',
        '{"response": "%s"}',
    ),
    "HuggingFaceTB-SmolLM2-135M-Instruct": (
        "generic",
        "<|im_start|>assistant\n",
        '{"tool_calls": [{"name": "get_weather", "arguments": %s}]}',
        '{"response": "%s"}',
    ),
}


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def backend(name: str, reply: str) -> FakeBackend:
    markers = FAMILIES[name][1]
    markers = (markers,) if isinstance(markers, str) else markers
    return FakeBackend(
        scripted(reply, *(m.encode() for m in markers)),
        vocab=V,
        pieces=CHARS,
        n_ctx=4096,
        n_batch=512,
        chat_template=template(name),
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_is_detected(name):
    assert detect(template(name)).name == FAMILIES[name][0]
    assert detect(None).name == "generic" and detect("{{ messages }}").name == "generic"
    assert detect(template("google-gemma-2-2b-it")) == Generic(system=False)  # it refuses system turns


@pytest.mark.parametrize("name", FAMILIES)
def test_a_call_in_each_format_is_constrained_parsed_and_streamed(name):
    kind, _, call, _ = FAMILIES[name]
    reply = call % json.dumps(ARGS)
    with serving(backend(name, reply)) as s:
        client = s.client()
        whole = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME], max_tokens=200
        )
        chunks = list(
            client.chat.completions.create(
                model="fake",
                messages=[{"role": "user", "content": "weather?"}],
                tools=[WEATHER, TIME],
                max_tokens=200,
                stream=True,
            )
        )
    [c] = whole.choices[0].message.tool_calls
    assert (c.function.name, json.loads(c.function.arguments)) == ("get_weather", ARGS)
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    # grammar-aware drafting: the grammar forced the call's known parts (the arguments' enum values, brackets)
    assert whole.model_extra["specdec"]["sources"]["grammar"]["accepted"] > 0
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert streamed[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == ARGS


@pytest.mark.parametrize("name", FAMILIES)
def test_a_text_reply_after_a_call_and_its_result_in_each_format(name):
    # the history's call and result rendered as the template can (Mistral: 9-character ids; Llama: one call per
    # turn; Phi-4 and generic: as text); the reply is text (generic: the "response" of its JSON)
    kind, _, _, text = FAMILIES[name]
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    with serving(backend(name, text % "It is 22 C at noon.")) as s:
        resp = s.client().chat.completions.create(model="fake", messages=history, tools=[WEATHER, TIME], max_tokens=200)
    assert resp.choices[0].message.content == "It is 22 C at noon." and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


def test_the_generic_format_describes_the_tools_in_a_system_message_and_renders_the_history_as_json():
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "22", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Warm."},
        {"role": "user", "content": "thanks"},
    ]
    out, tools = Generic().render(messages, [WEATHER])
    assert tools is None and out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'}
    assert json.loads(out[3]["content"]) == {"tool_response": {"tool_call_id": "c1", "content": "22"}}
    assert out[4]["content"] == '{"response": "Warm."}'
    no_system, _ = Generic(system=False).render(messages[:1], [WEATHER])
    assert no_system[0]["role"] == "user" and no_system[0]["content"].endswith("weather?")


def test_the_grammars_per_format_and_tool_choice():
    from specdec_cli.server.openai_chat import check_tools

    auto, required = check_tools([WEATHER, TIME], None, None), check_tools([WEATHER, TIME], "required", None)
    none = check_tools([WEATHER, TIME], "none", None)
    call = json.dumps({"name": "get_weather", "arguments": ARGS})
    cases = {
        Llama3(): ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', "It is warm."),
        MistralV3(): (f"[TOOL_CALLS][{call}]", "It is warm."),
        Phi4(): (f"functools[{call}, {call}]", "It is warm."),
        Generic(): (f'{{"tool_calls": [{call}]}}', '{"response": "It is warm."}'),
    }
    for fmt, (calls, text) in cases.items():
        assert accepts(fmt.grammar(auto, None).lark, calls) and accepts(fmt.grammar(auto, None).lark, text), fmt
        assert accepts(fmt.grammar(required, None).lark, calls) and not accepts(
            fmt.grammar(required, None).lark, text
        ), fmt
        assert not accepts(fmt.grammar(none, None).lark, calls) and accepts(fmt.grammar(none, None).lark, text), fmt
        bad = calls.replace("Paris", "Rome")
        assert not accepts(fmt.grammar(auto, None).lark, bad), fmt


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {"a": "}]"}}, {"name": "g", "arguments": {}}]',
            "",
            [("f", '{"a": "}]"}'), ("g", "{}")],
        ),
        ('[{"name": "f", "arguments": {"a": 1}}]', "", [("f", '{"a": 1}')]),  # the tag is a control token: no text
        ("[TOOL_CALLS is what I would write", "[TOOL_CALLS is what I would write", []),
        ("Plain text [with brackets].", "Plain text [with brackets].", []),
    ],
)
def test_the_mistral_parser_however_the_text_is_split(text, content, calls):
    for step in (1, 3, 7, len(text)):
        p = JsonCallsParser(True, heads=MistralV3().heads())
        events = [e for i in range(0, len(text), step) for e in p.feed(text[i : i + step])] + p.close()
        assert "".join(e.text for e in events if isinstance(e, Content)) == content
        assert [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallStart)] == calls
        assert [e.text for e in events if isinstance(e, Arguments)] == [a for _, a in calls]


def test_the_generic_parser_streams_the_response_text_as_it_is_written():
    text = '{"response": "caf\\u00e9 \\"ok\\"\\n"}'
    p = GenericParser(True)
    pieces = [e.text for i in range(len(text)) for e in p.feed(text[i]) if isinstance(e, Content)] + [
        e.text for e in p.close() if isinstance(e, Content)
    ]
    assert "".join(pieces) == 'café "ok"\n' and len(pieces) > 3  # streamed, not given at the end
    p = GenericParser(True)
    events = p.feed('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "argu') + p.close(cut=True)
    assert [e.call.name for e in events if isinstance(e, CallStart)] == ["f"]


def test_a_marker_that_is_a_special_token_is_written_by_its_id():
    # Mistral's [TOOL_CALLS] is a control token: the grammar names it by id (llguidance's <[id]>), and it renders as
    # no text, so the parser takes the calls without it
    from llguidance import LLMatcher

    from fakes import greedy_tokenize
    from specdec_cli.server.openai_chat import check_tools
    from specdec_cli.server.tool_formats import Tag, find_tag

    assert find_tag("[TOOL_CALLS]", lambda t: [7]) == Tag("[TOOL_CALLS]", 7)
    assert find_tag("[TOOL_CALLS]", lambda t: [7, 8]) == Tag("[TOOL_CALLS]")
    fmt = MistralV3(tag=Tag("[TOOL_CALLS]", 5))
    lark = fmt.grammar(check_tools([WEATHER], "required", None), None).lark
    assert "<[5]>" in lark
    tokens = [5] + greedy_tokenize(
        CHARS, f'[{{"name": "get_weather", "arguments": {json.dumps(ARGS)}}}]'.encode(), set()
    )
    m = LLMatcher(FakeBackend(vocab=V, pieces=CHARS).lltokenizer(), LLMatcher.grammar_from_lark(lark), log_level=0)
    assert m.consume_tokens(tokens) and m.is_accepting()
