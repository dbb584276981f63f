"""The server's one event stream (`server.reply.ReplyStream`): what every API translator renders from."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from specdec_cli.core.records import Finish, Prefill, Step  # noqa: E402
from specdec_cli.core.stats import summarize  # noqa: E402
from specdec_cli.server.guards import CallGuard, answered_calls, call_key  # noqa: E402
from specdec_cli.server.reply import (  # noqa: E402
    Arguments,
    CallEnd,
    CallStart,
    Content,
    End,
    PieceLogprob,
    ReplyStream,
    RequestStats,
)
from specdec_cli.server.request import Message, ToolCall  # noqa: E402
from specdec_cli.server.tools import ReplyParser  # noqa: E402


def stats(finish: str) -> RequestStats:
    return RequestStats(
        summarize(
            [Prefill(n_prompt=2, n_evaluated=2, ms=1.0), Step(0, 0, (), 0, 7, (7,), (), 0.1, 1.0), Finish(finish)]
        )
    )


def test_a_reply_with_text_and_a_call_streams_start_arguments_and_end_then_the_end():
    reply = ReplyStream(ReplyParser(True))
    events = []
    for piece in [
        'Let me look.\n<tool_call>\n{"name": "get',
        '_weather", "arguments": {"city": ',
        '"Paris"}}',
        "\n</tool_call>",
    ]:
        events += reply.delta(piece)
    events += reply.done(stats("eog"))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Content" and kinds[-2:] == ["CallEnd", "End"]
    assert [e.call.name for e in events if isinstance(e, CallStart)] == ["get_weather"]
    assert "".join(e.text for e in events if isinstance(e, Arguments)) == '{"city": "Paris"}'
    [end_call] = [e for e in events if isinstance(e, CallEnd)]
    assert end_call.call == ToolCall(end_call.call.id, "get_weather", '{"city": "Paris"}')
    assert reply.calls == [end_call.call] and reply.content == "Let me look."
    end = events[-1]
    assert isinstance(end, End) and end.tool_calls and end.finish == "eog" and not end.truncated


def test_a_reply_cut_by_the_token_limit_is_not_a_tool_call_reply():
    reply = ReplyStream(ReplyParser(True))
    reply.delta('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    *_, end = reply.done(stats("length"))
    assert end.truncated and not end.tool_calls


def test_a_steps_logprobs_ride_on_its_first_event_even_when_its_text_is_held_back():
    lp = (PieceLogprob(b"<", -0.5),)
    reply = ReplyStream(ReplyParser(True))
    [first] = reply.delta("<tool", lp)  # held back: it may be the start of <tool_call>
    assert first == Content("", lp)
    events = reply.delta("s>", lp)
    assert isinstance(events[0], Content) and events[0].logprobs == lp and events[0].text == "<tools>"
    assert reply.logprobs == [*lp, *lp]


def test_a_call_is_held_back_until_it_is_complete():
    reply = ReplyStream(ReplyParser(True))
    assert reply.delta('<tool_call>\n{"name": "f", "arguments": {"a": ') == []
    events = reply.delta("1}}\n</tool_call>")
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "CallStart" and set(kinds[1:-1]) == {"Arguments"} and kinds[-1] == "CallEnd"


def test_a_repeated_call_stops_the_reply_and_a_cut_one_is_dropped():
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2]}}\n</tool_call>\n'
    reply = ReplyStream(ReplyParser(True), CallGuard())
    reply.delta(call)
    assert reply.delta(call.replace('{"a": 1, "b": [2]}', '{"b": [2], "a": 1}')) == [] and reply.stopped
    assert reply.delta("more text") == []
    *_, end = reply.done(stats("eog"))
    assert len(reply.calls) == 1 and end.tool_calls and end.finish == "stop"
    cut = ReplyStream(ReplyParser(True))
    cut.delta('Hm. <tool_call>\n{"na')
    events = cut.done(stats("length"))
    assert [type(e).__name__ for e in events] == ["End"] and cut.content == "Hm." and not cut.calls


def test_the_guard_compares_arguments_as_json_and_knows_the_last_turns_answered_calls():
    assert call_key("f", '{"a": 1, "b": {"c": 2}}') == call_key("f", '{"b":{"c":2},\n "a":1}')
    assert call_key("f", '{"a": 1}') != call_key("g", '{"a": 1}') != call_key("f", '{"a": 2}')
    c1, c2, c3 = ToolCall("c1", "f", '{"a": 1}'), ToolCall("c2", "g", "{}"), ToolCall("c3", "h", "{}")
    messages = [
        Message("user", "hi"),
        Message("assistant", tool_calls=(c3,)),
        Message("tool", "r", tool_call_id="c3"),
        Message("assistant", tool_calls=(c1, c2)),
        Message("tool", "r1", tool_call_id="c1"),
    ]
    assert answered_calls(messages) == {call_key("f", '{"a":1}')}  # c2 unanswered, c3 an older turn's
    assert answered_calls(messages + [Message("assistant", "done")]) == frozenset()
    guard = CallGuard.of(messages)
    assert not guard.admit(ToolCall("x", "f", '{"a": 1}')) and guard.admit(ToolCall("y", "g", "{}"))
    assert not guard.admit(ToolCall("z", "g", "{ }"))
