"""Fields that only inform are accepted and used where the model has room; fields that change what must come back
are implemented or refused with a 400 naming them (`server/fields.py`, STYLE habit 12). On the fake backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import CHARS, RecordingBackend, hashed_logits  # noqa: E402
from helpers import PROMPT, serving  # noqa: E402
from specdec_cli.server import fields  # noqa: E402

USER = [{"role": "user", "content": PROMPT}]


def post(s, body: dict, path: str = "/v1/chat/completions"):
    return s.raw("POST", path, json.dumps({"model": "fake", "max_tokens": 3, **body}).encode())


def test_a_messages_name_goes_to_the_template():
    backend = RecordingBackend()
    with serving(backend) as s:
        status, reply = post(
            s,
            {
                "messages": [
                    {"role": "user", "content": PROMPT, "name": "ann"},
                    {"role": "assistant", "content": "w5", "name": "bot"},
                    {"role": "user", "content": PROMPT},
                ]
            },
        )
    assert status == 200, reply
    messages, _, _ = backend.renders[-1]
    assert [m.get("name") for m in messages] == ["ann", "bot", None]


def test_a_schemas_description_is_shown_to_the_model_and_strict_is_accepted():
    backend = RecordingBackend(
        lambda p: hashed_logits(p, len(CHARS), peak=2.0), vocab=len(CHARS), pieces=CHARS, n_ctx=1024
    )  # grammars need a byte-complete vocabulary
    fmt = {
        "type": "json_schema",
        "json_schema": {
            "name": "Person",
            "description": "A person named in the text.",
            "strict": True,
            "schema": {"type": "object"},
        },
    }
    with serving(backend) as s:
        status, reply = post(s, {"messages": USER, "response_format": fmt, "max_tokens": 1})
        assert status == 200, reply
        status, reply = post(
            s,
            {"messages": [{"role": "system", "content": "Be brief."}, *USER], "response_format": fmt, "max_tokens": 1},
        )
        assert status == 200, reply
    alone, merged = (m for m, _, _ in backend.renders)
    assert alone[0]["role"] == "system" and "A person named in the text." in alone[0]["content"]
    assert "Person" in alone[0]["content"] and alone[1:] == [{"role": "user", "content": PROMPT}]
    assert merged[0]["role"] == "system" and merged[0]["content"].startswith("Be brief.")
    assert "A person named in the text." in merged[0]["content"] and len(merged) == 2


def test_template_kwargs_reasoning_effort_and_reasoning_content_go_to_the_template():
    backend = RecordingBackend()
    with serving(backend) as s:
        status, reply = post(
            s,
            {
                "messages": [*USER, {"role": "assistant", "content": "w5", "reasoning_content": "hm"}, *USER],
                "chat_template_kwargs": {"enable_thinking": False},
                "reasoning_effort": "low",
            },
        )
        assert status == 200, reply
        status, bad = post(s, {"messages": USER, "chat_template_kwargs": {"messages": []}})
    messages, _, kwargs = backend.renders[-1]
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert messages[1]["reasoning_content"] == "hm"
    assert status == 400 and bad["error"]["param"] == "chat_template_kwargs.messages"  # the template's own variable


INFORMING = {
    "metadata": {"run": "1"},
    "store": True,
    "service_tier": "flex",
    "user": "ann",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "verbosity": "low",
    "reasoning": {"effort": "high"},
    "some_vendor_field": {"x": 1},
}


def test_fields_that_only_inform_are_accepted_and_change_nothing():
    with serving() as s:
        plain = post(s, {"messages": USER})
        for name, value in INFORMING.items():
            status, reply = post(s, {"messages": USER, name: value})
            assert status == 200, (name, reply)
            assert reply["choices"] == plain[1]["choices"], name
        cached = [
            {
                "role": "user",
                "content": [{"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}}],
                "cache_control": {"type": "ephemeral"},
            }
        ]
        status, reply = post(s, {"messages": cached})
        assert status == 200 and reply["choices"] == plain[1]["choices"], reply
        status, _ = post(s, {"prompt": PROMPT, "some_vendor_field": 2, "user": "ann"}, "/v1/completions")
        assert status == 200
    ignored = [ln for ln in s.lines if "some_vendor_field" in ln]
    assert len(ignored) == 1 and "ignored" in ignored[0]  # logged once per name


def test_the_server_page_table_is_the_field_table():
    page = (Path(__file__).parents[2] / "docs" / "server.md").read_text(encoding="utf-8")  # moved from the README
    assert fields.markdown_table() in page
    for f in fields.FIELDS:  # every field informs or changes, and a refused one says why
        assert f.kind in (fields.INFORMS, fields.CHANGES)
        assert f.refused is None or f.kind == fields.CHANGES
