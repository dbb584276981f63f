"""`specdec serve --parallel`: requests generate at once on the lanes of one model, on the fake backend."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import FakeBackend, greedy_reference, hashed_logits  # noqa: E402
from test_serve import PROMPT_TOKENS, SlowBackend, chat, serving, text_of  # noqa: E402

CHATS = ["w5 w6 w7 w5 w6 w7", "w9 w10 w9 w10 w9", "w3 w4 w3 w4", "w12 w13 w14 w12"]


def _laned(backend: FakeBackend, n: int) -> FakeBackend:
    backend.n_lanes = n  # what `LlamaBackend(n_lanes=n)` reports: the service then serves n lanes
    return backend


def _prompt_tokens(s, content: str) -> list[int]:
    from specdec_cli.server.request import Message, Request
    from specdec_cli.core.engine import GenerationConfig

    return s.worker.service.prompt_tokens(Request(config=GenerationConfig(), messages=(Message("user", content),)))


def test_four_chats_at_once_share_passes_and_each_gets_its_own_greedy_reply():
    backend = _laned(SlowBackend(hashed_logits, n_ctx=1024, delay=0.01), 4)
    replies: dict[int, str] = {}
    with serving(backend) as s:
        assert s.health()["queue"]["lanes"] == 4

        def go(i):
            replies[i] = chat(s.client(), CHATS[i], max_tokens=40).choices[0].message.content

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        expected = {i: text_of(greedy_reference(backend.fn, _prompt_tokens(s, CHATS[i]), 40)) for i in range(4)}
        lines = list(s.lines)
    assert replies == expected
    assert max(len(p) for p in backend.passes) >= 3  # three or four requests in one forward pass
    assert len({line.rsplit("lane ", 1)[1] for line in lines if "lane " in line}) >= 3  # on lanes of their own


def test_a_short_request_is_answered_while_a_long_one_generates():
    """An editor's short request does not wait for an agent's long reply: it runs beside it, first in each pass."""
    backend = _laned(SlowBackend(hashed_logits, n_ctx=1024, delay=0.02), 2)
    done: dict[str, float] = {}
    with serving(backend) as s:
        t0 = time.monotonic()

        def long():
            chat(s.client(), CHATS[0], max_tokens=300)
            done["long"] = time.monotonic() - t0

        t = threading.Thread(target=long)
        t.start()
        s.wait(lambda h: h["busy"])
        short = chat(s.client(), CHATS[1], max_tokens=8).choices[0].message.content
        done["short"] = time.monotonic() - t0
        t.join(60)
        expected = text_of(greedy_reference(backend.fn, _prompt_tokens(s, CHATS[1]), 8))
    assert short == expected
    assert done["short"] < done["long"] / 3  # it did not wait for the long reply


def test_one_lane_serves_one_at_a_time_as_before():
    backend = SlowBackend(hashed_logits, n_ctx=1024)
    with serving(backend) as s:
        assert s.health()["queue"]["lanes"] == 1
        assert s.worker.scheduler is None
        reply = chat(s.client(), max_tokens=6).choices[0].message.content
    assert reply == text_of(greedy_reference(backend.fn, PROMPT_TOKENS, 6))
    assert not backend.__dict__.get("passes")  # no shared passes: the backend is called directly
