"""`specdec serve --parallel`: requests generate at once on the lanes of one model, on the fake backend."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fakes import FakeBackend, greedy_reference, hashed_logits  # noqa: E402
from helpers import PROMPT_TOKENS, SlowBackend, chat, serving, text_of  # noqa: E402

CHATS = ["w5 w6 w7 w5 w6 w7", "w9 w10 w9 w10 w9", "w3 w4 w3 w4", "w12 w13 w14 w12"]


def _laned(backend: FakeBackend, n: int) -> FakeBackend:
    backend.n_lanes = n  # what `LlamaBackend(n_lanes=n)` reports: the service then serves n lanes
    return backend


def _prompt_tokens(s, content: str) -> list[int]:
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.server.request import Message, Request

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
        reply = chat(s.client(), max_tokens=6).choices[0].message.content
    assert reply == text_of(greedy_reference(backend.fn, PROMPT_TOKENS, 6))
    assert not backend.__dict__.get("passes")  # no shared passes: the backend is called directly


@pytest.mark.real
def test_real_server_answers_the_openai_and_anthropic_sdks_at_once(smollm2_path):
    """Two official SDKs' requests sent together to `specdec serve --parallel 2` on a real model: both answered, on
    lanes of their own, each the reply it gets alone (greedy; up to near-ties, which a 16-token reply rarely meets)."""
    import anthropic

    from helpers import start_real_server

    proc, url = start_real_server(
        smollm2_path, "--parallel", "2", "--ctx", "1024", "--no-prompt-cache", "--temperature", "0"
    )  # greedy where a request sets no temperature
    try:
        oa = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        an = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "Name three colours."}]

        def via_openai():
            return (
                oa.chat.completions.create(model="m", messages=ask, max_tokens=16, temperature=0)
                .choices[0]
                .message.content
            )

        def via_anthropic():
            return an.messages.create(model="m", messages=ask, max_tokens=16).content[0].text

        alone = (via_openai(), via_anthropic())
        got: dict[str, str] = {}
        threads = [
            threading.Thread(target=lambda: got.__setitem__("openai", via_openai())),
            threading.Thread(target=lambda: got.__setitem__("anthropic", via_anthropic())),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        proc.send_signal(__import__("signal").SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got == {"openai": alone[0], "anthropic": alone[1]}
    assert alone[0] and alone[1]
    lanes = {line.rsplit("lane ", 1)[1] for line in err.splitlines() if line.startswith("#") and "lane " in line}
    assert len(lanes) == 2, err


def test_a_completion_waits_for_the_finishing_lane_that_holds_its_prefix():
    """An editor's next FIM arrives as its previous one's lane is finishing: it is placed on that lane (which holds
    its prefix), not on an idle lane where its whole prompt would be evaluated again."""
    from types import SimpleNamespace

    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.server.jobs import Job
    from specdec_cli.server.request import Fim, Request
    from specdec_cli.server.worker import Worker

    held = {0: [], 1: list(range(100, 600))}  # lane 1 served the previous completion
    service = SimpleNamespace(
        lanes=2, scheduler=None, lane_tokens=lambda i: [np.asarray(held[i], np.int32)], reply=lambda r: None
    )
    worker = Worker(service)
    fim = Request(config=GenerationConfig(max_tokens=32), fim=Fim(prefix="a", suffix="b"), label="infill")
    worker._running[1] = Job(1, fim, lambda e: None)  # still finishing its previous completion
    job = Job(2, fim, lambda e: None)
    job.prompt = list(range(100, 590)) + [7, 8]
    assert worker._place(0, job) == 1
    worker._running[1] = Job(3, Request(config=GenerationConfig(max_tokens=4096)), lambda e: None)  # a long request
    assert worker._place(0, job) == 0  # not worth waiting for


def test_a_new_request_goes_to_the_least_recently_used_lane_not_the_one_that_took_it():
    """An agent's request taken by the thread of the lane that just served an editor's completion goes to the
    least recently used idle lane: the editor's lane keeps its cached prefix for the next completion (which would
    otherwise queue for the agent's whole turn); a request that shares that lane's prefix stays on it."""
    from types import SimpleNamespace

    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.server.jobs import Job
    from specdec_cli.server.request import Request
    from specdec_cli.server.worker import Worker

    held = {0: [], 1: list(range(100, 600)), 2: []}  # lane 1 served the editor's last completion
    service = SimpleNamespace(
        lanes=3, scheduler=None, lane_tokens=lambda i: [np.asarray(held[i], np.int32)], reply=lambda r: None
    )
    worker = Worker(service)
    worker._used = [5.0, 9.0, 3.0]
    agent = Job(1, Request(config=GenerationConfig(max_tokens=4096)), lambda e: None)
    agent.prompt = list(range(1000, 1600))
    assert worker._place(1, agent) == 2
    again = Job(2, Request(config=GenerationConfig(max_tokens=32)), lambda e: None)
    again.prompt = list(range(100, 590))
    assert worker._place(0, again) == 1


def test_the_save_after_requests_runs_on_the_loop_between_steps_only_when_due():
    """After each request the loop counts it for the save of what was learnt and saves, on its own thread between two
    steps (no pass under way, nothing mutating the stores), only when that made a save due."""
    from specdec_cli.server.saver import Saver

    backend = _laned(SlowBackend(hashed_logits, n_ctx=1024, delay=0.01), 2)
    in_pass = threading.Event()
    decode_many = backend.decode_many

    def marked(parts, calls=None):
        in_pass.set()
        try:
            return decode_many(parts, calls)
        finally:
            in_pass.clear()

    backend.decode_many = marked
    with serving(backend) as s:
        saves: list[tuple[str, bool]] = []
        s.worker.saver = Saver(
            lambda: saves.append((threading.current_thread().name, in_pass.is_set())), every=3, interval=1e6
        )
        for i in range(4):
            chat(s.client(), CHATS[i], max_tokens=4)
        s.wait(lambda h: not h["busy"])
    assert saves == [("specdec-serve-worker", False)]  # the third request made a save due: saved between steps
