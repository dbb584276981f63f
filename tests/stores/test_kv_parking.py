"""Parked KV states (`stores.kv_parking`): a conversation's KV cache survives a side request, in unit tests on the fake
backend and through the server (a coding agent's turn after its title request evaluates only its new tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeBackend, hashed_logits
from specdec_cli.errors import StateError
from specdec_cli.models.backend import sync
from specdec_cli.stores.kv_parking import KvParking

MAIN = [2 + i % 28 for i in range(300)]  # a long conversation's tokens
SIDE = [5, 6, 7, 8]


def test_a_cut_that_loses_enough_parks_and_the_next_turn_swaps_it_back():
    backend, parking = FakeBackend(n_ctx=1024), KvParking(min_tokens=64)
    sync(backend, np.array(MAIN))
    assert parking.prepare(backend, np.array(SIDE)) == 0  # nothing parked shares more: the KV cache stays
    assert parking.n_parked == 1
    sync(backend, np.array(SIDE))
    turn2 = np.array(MAIN + [9, 10, 11])
    before = backend.n_evaluated
    assert parking.prepare(backend, turn2) == len(MAIN)
    assert sync(backend, turn2) == 3 and backend.n_evaluated - before == 3  # only the new tokens
    assert parking.n_restored == 1 and list(backend.tokens) == list(turn2)


def test_small_losses_are_not_parked_and_small_gains_not_swapped():
    backend, parking = FakeBackend(n_ctx=1024), KvParking(min_tokens=64)
    sync(backend, np.array(MAIN[:50]))
    parking.prepare(backend, np.array(SIDE))  # 50 tokens lost: cheaper to evaluate again
    assert parking.n_parked == 0
    sync(backend, np.array(MAIN))
    parking.prepare(backend, np.array(SIDE))
    sync(backend, np.array(SIDE))
    held = list(backend.tokens)
    assert parking.prepare(backend, np.array(SIDE + MAIN[:40])) == 0  # shares 4 with the KV, 0 with the parked
    assert list(backend.tokens) == held


def test_a_context_that_edits_the_held_state_does_not_park_it():
    """An editor's next completion keeps all but the few hundred tokens after its cursor (7/8 of the state or more):
    the state with the old ones is not wanted again, and each completion would park a whole state (a copy of it
    on the serving loop's thread, and memory). A context keeping less (another file, a side request) parks it."""
    backend, parking = FakeBackend(n_ctx=4096), KvParking(min_tokens=64)
    document = [2 + i % 28 for i in range(1000)]
    sync(backend, np.array(document))
    parking.prepare(backend, np.array(document[:880] + [31] * 120))  # 120 of 1000 cut: an edit
    assert parking.n_parked == 0
    parking.prepare(backend, np.array(document[:860] + [31] * 140))  # 140 cut: another part of the file
    assert parking.n_parked == 1


def test_the_least_recently_used_state_goes_first_past_max_bytes():
    backend = FakeBackend(n_ctx=1024)
    parking = KvParking(min_tokens=16, max_bytes=4 * 450)  # the fake's state: 4 bytes a token
    a, b = [3] * 300, [4] * 200
    for tokens in (a, b):
        sync(backend, np.array(tokens))
        parking.prepare(backend, np.array(SIDE))
        sync(backend, np.array(SIDE))
    assert parking.n_parked == 2 and parking.n_bytes == 4 * 200  # a was dropped to make room for b
    assert parking.prepare(backend, np.array(a)) == 0


def test_a_refused_state_leaves_an_empty_cache_and_evaluates_instead():
    class Refusing(FakeBackend):
        def restore_snapshot(self, data, tokens):
            self._tokens = []
            raise StateError("refused")

    backend, parking = Refusing(n_ctx=1024), KvParking(min_tokens=64)
    sync(backend, np.array(MAIN))
    parking.prepare(backend, np.array(SIDE))
    sync(backend, np.array(SIDE))
    assert parking.prepare(backend, np.array(MAIN)) == 0
    assert len(backend.tokens) == 0


def test_through_the_server_a_turn_after_a_side_request_evaluates_only_its_new_tokens():
    anthropic = pytest.importorskip("anthropic")
    pytest.importorskip("fastapi")
    from helpers import serving

    conversation = " ".join(f"w{t}" for t in MAIN)
    with serving(FakeBackend(hashed_logits, n_ctx=1024)) as s:
        client = anthropic.Anthropic(base_url=s.url.removesuffix("/v1"), api_key="x", max_retries=0, timeout=20)
        first = client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": conversation}])
        client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "w5 w6 w7"}])
        turn2 = client.messages.create(
            model="m",
            max_tokens=3,
            messages=[
                {"role": "user", "content": conversation},
                {"role": "assistant", "content": first.content[0].text},
                {"role": "user", "content": "w9 w10"},
            ],
        )
    assert first.usage.input_tokens == len(MAIN)
    # the conversation and most of the first reply come from the parked state: a few tokens evaluated, not 300
    assert turn2.usage.cache_read_input_tokens >= len(MAIN)
    assert turn2.usage.input_tokens <= 8


@pytest.mark.real
def test_a_parked_llama_state_gives_the_same_logits_as_evaluating_again(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    backend = LlamaBackend(smollm2_path, n_ctx=1024, n_batch=512)
    try:
        main = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 30)
        parking = KvParking(min_tokens=64)
        sync(backend, np.array(main[:-1]))
        evaluated = backend.decode(main[-1:], n_logits=1).copy()
        backend.truncate(len(main) - 1)
        parking.prepare(backend, np.array([5, 6, 7]))
        sync(backend, np.array([5, 6, 7]))
        assert parking.prepare(backend, np.array(main[:-1])) == len(main) - 1
        restored = backend.decode(main[-1:], n_logits=1)
        np.testing.assert_array_equal(restored, evaluated)
    finally:
        backend.close()
