"""Several sequences at once (`server.lanes`): shared verify passes, the scheduler's order, the joint K."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Finish, Step
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.server.lanes import BATCH, INTERACTIVE, PassScheduler, Priority, _Sub

from fakes import FakeBackend, greedy_reference, hashed_logits

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10], [3, 4, 3, 4, 3, 4, 3, 4], [20, 21, 22, 23]]


def _engines(backend: FakeBackend, n: int, k: int = 4) -> tuple[PassScheduler, list[SpeculativeEngine]]:
    """A scheduler of n lanes over `backend` whose first pass lasts 0.3 s, so every lane's thread has entered before
    the first lane could finish alone; an engine per lane."""
    first = backend.decode_many

    def slow_first(parts):
        if not backend.__dict__.get("passes"):
            time.sleep(0.3)
        return first(parts)

    backend.decode_many = slow_first
    sched = PassScheduler(backend, n)
    return sched, [SpeculativeEngine(lane, NgramDrafter(1, 3), FixedK(k)) for lane in sched.lanes]


def _run(sched: PassScheduler, jobs: list[tuple[int, SpeculativeEngine, list[int], GenerationConfig, Priority]],
         start: threading.Barrier | None = None) -> dict[int, list[int]]:
    """Run each (lane, engine, prompt, config, priority) on a thread of its own; the output tokens by lane."""
    out: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def go(i, engine, prompt, config, priority):
        lane = sched.lanes[i]
        if start is not None:
            start.wait()
        sched.enter(lane, priority)
        try:
            out[i] = [t for r in engine.generate(prompt, config) if isinstance(r, Step) for t in r.emitted]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            sched.leave(lane)

    threads = [threading.Thread(target=go, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a lane never finished"
    if errors:
        raise errors[0]
    return out


def test_shared_passes_give_each_sequence_its_own_greedy_output():
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 4)
    config = GenerationConfig(max_tokens=40)
    jobs = [(i, engines[i], PROMPTS[i], config, Priority(BATCH, seq=i)) for i in range(4)]
    out = _run(sched, jobs, threading.Barrier(4))
    for i in range(4):
        assert out[i] == greedy_reference(hashed_logits, PROMPTS[i], 40), f"lane {i}"
    shared = [p for p in backend.passes if len(p) > 1]
    assert shared, "no pass was shared between lanes"
    assert max(len(p) for p in backend.passes) == 4  # all four lanes in one llama_decode
    assert sched.passes == len(backend.passes)


def test_seeded_sampled_request_unchanged_by_a_neighbour():
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sampled = GenerationConfig(max_tokens=30, sampling=SamplingParams(temperature=0.9, seed=1234))
    sched, engines = _engines(backend, 2)
    alone = _run(sched, [(0, engines[0], PROMPTS[0], sampled, Priority())])[0]
    backend2 = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched2, engines2 = _engines(backend2, 2)
    sched2.lanes[0].pinned = True  # what the worker sets for a seeded sampled request
    other = GenerationConfig(max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=7))
    both = _run(sched2, [(0, engines2[0], PROMPTS[0], sampled, Priority(seq=0)),
                         (1, engines2[1], PROMPTS[1], other, Priority(seq=1))], threading.Barrier(2))
    assert any(len(p) > 1 for p in backend2.passes)
    assert both[0] == alone


def test_a_cancelled_sequence_leaves_the_others_kv_intact():
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 2)
    config = GenerationConfig(max_tokens=40)
    results: dict[str, list[int]] = {}
    barrier = threading.Barrier(2)

    def stopped_early():
        lane = sched.lanes[1]
        barrier.wait()
        sched.enter(lane, Priority(seq=1))
        try:
            gen = engines[1].generate(PROMPTS[1], config)
            got = []
            for r in gen:
                if isinstance(r, Step):
                    got += r.emitted
                    if len(got) >= 5:
                        gen.close()  # the client went away: the engine's finally trims the lane's KV cache
                        break
            results["b"] = got
        finally:
            sched.leave(lane)

    t = threading.Thread(target=stopped_early)
    t.start()
    out = _run(sched, [(0, engines[0], PROMPTS[0], config, Priority(seq=0))], barrier)
    t.join(10)
    assert out[0] == greedy_reference(hashed_logits, PROMPTS[0], 40)
    lane_b = sched.lanes[1]
    committed = list(PROMPTS[1]) + results["b"]
    assert list(lane_b.tokens) == committed[: len(lane_b.tokens)]  # only committed tokens left, none of A's
    assert len(lane_b.tokens) >= len(committed) - 1


def _fake_subs(sched: PassScheduler, spec: list[tuple[int, int, int, Priority]]) -> list[_Sub]:
    """Waiting rows for `_compose`: (lane, tokens, n_logits, priority) each."""
    subs = []
    for lane, n, n_logits, priority in spec:
        sched.lanes[lane].priority = priority
        sub = _Sub(sched.lanes[lane], np.zeros(n, np.int32), n_logits)
        sched._subs[lane] = sub
        subs.append(sub)
    return subs


def test_compose_puts_interactive_steps_first_and_cuts_a_long_prefill_to_its_share():
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 3, share_rows=32)
    agent, fim, chat = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1)),  # an agent's prefill chunk
                                          (1, 5, 5, Priority(INTERACTIVE, seq=2)),  # an editor's verify step
                                          (2, 3, 3, Priority(BATCH, seq=3))])
    parts = sched._compose()
    assert parts[0] == (fim, 5)  # the interactive step first
    assert (chat, 3) in parts  # every waiting step rides along
    assert (agent, 32) in parts  # before any pass was timed: the long prefill advances by share_rows, no more
    sched._ms_per_row, sched._owed_ms = 10.0, 0.0
    assert agent not in [s for s, _ in sched._compose()]  # timed, nothing owed yet: the interactive pass runs light
    sched._owed_ms = 45.0
    assert (agent, 5) in sched._compose()  # what 45 ms owed buys at 10 ms a row


def _editor_during(sched: PassScheduler, engine: SpeculativeEngine, arrives: threading.Event, max_tokens: int,
                   seen: dict) -> threading.Thread:
    """An editor's completion on lane 1, on a thread started here, entering once `arrives` is set: `seen["waited"]`
    (s until it held the baton) and `seen["out"]` (its greedy tokens for PROMPTS[3])."""

    def editor():
        arrives.wait(5)
        t0 = time.monotonic()
        sched.enter(sched.lanes[1], Priority(INTERACTIVE, seq=2))
        seen["waited"] = time.monotonic() - t0
        try:
            seen["out"] = [t for r in engine.generate(PROMPTS[3], GenerationConfig(max_tokens=max_tokens))
                           if isinstance(r, Step) for t in r.emitted]
        finally:
            sched.leave(sched.lanes[1])

    t = threading.Thread(target=editor)
    t.start()
    return t


def _agent_beside_editor(kv_streams: bool, n_prompt: int, editor_tokens: int) -> FakeBackend:
    """An agent's long prefill (lane 0) and an editor's completion arriving during its third pass (lane 1), on a
    virtual clock (passes of 10 + 5 ms a row), share 0.25, pieces of 0.5 s; both outputs checked against their greedy
    ones. Returns the backend (its `passes`)."""
    from fakes import Clock

    clock = Clock()
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512, clock=clock, cost=lambda b: 10.0 + 5.0 * b)
    backend.kv_streams = kv_streams
    sched = PassScheduler(backend, 2, clock=clock, piece_s=0.5, share=0.25)
    assert sched.split is kv_streams
    engines = [SpeculativeEngine(lane, NgramDrafter(1, 3), FixedK(4)) for lane in sched.lanes]
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(2, 30, n_prompt)]
    first_piece = threading.Event()
    orig = backend.decode_many

    def spy(parts):
        if len(backend.__dict__.get("passes", [])) == 2:
            first_piece.set()
            time.sleep(0.2)  # the editor arrives now
        return orig(parts)

    backend.decode_many = spy
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))  # the editor's warm-up: it is in use
    seen: dict = {}
    t = _editor_during(sched, engines[1], first_piece, editor_tokens, seen)
    out = _run(sched, [(0, engines[0], long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH, seq=1))])
    t.join(10)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    assert seen["out"] == greedy_reference(hashed_logits, PROMPTS[3], editor_tokens)
    return backend


def test_a_long_prefill_gets_its_time_share_beside_an_interactive_lane_and_no_more():
    """One KV pool: while the editor decodes, the agent's prefill rows ride in its passes and take about `share` of the
    time (it never starves, and does not slow each editor step by a whole piece or a fixed number of rows)."""
    n_prompt = 1500
    backend = _agent_beside_editor(False, n_prompt, 60)
    # the passes with the editor in them while the agent was still reading its prompt
    read, both = 0, []
    for p in backend.passes:
        rows = dict(p)
        if read < n_prompt - 1 and 1 in rows:
            both.append(p)
        read += rows.get(0, 0)
    assert len(both) >= 10
    agent_ms = sum(5.0 * dict(p).get(0, 0) for p in both)
    total_ms = sum(10.0 + 5.0 * sum(r for _, r in p) for p in both)
    assert 0.15 <= agent_ms / total_ms <= 0.35  # about its share of the time
    longest_wait = max(len(list(g)) for k, g in itertools.groupby(both, key=lambda p: 0 in dict(p)) if not k)
    assert longest_wait <= 4  # never starved for long: owed time buys a row every few passes


def test_with_a_kv_stream_per_lane_a_long_prefill_gets_its_share_in_passes_of_its_own():
    """A KV stream per lane (`LlamaBackend.kv_streams`): llama.cpp would run an agent's rows beside an editor's as
    ubatches of their own anyway, so no pass mixes them; the agent's passes take about `share` of the time while the
    editor decodes (never starving)."""
    backend = _agent_beside_editor(True, 3000, 400)
    assert not any(len(p) > 1 for p in backend.passes)  # never an agent's rows beside the editor's
    first = next(i for i, p in enumerate(backend.passes) if p[0][0] == 1)
    last = max(i for i, p in enumerate(backend.passes) if p[0][0] == 1)
    window = backend.passes[first:last + 1]  # from the editor's first pass to its last
    ms = [10.0 + 5.0 * p[0][1] for p in window]
    agent_ms = sum(m for m, p in zip(ms, window) if p[0][0] == 0)
    assert 0.12 <= agent_ms / sum(ms) <= 0.3  # about its share of the time
    assert sum(1 for p in window if p[0][0] == 0) >= 3  # and in several passes: it never starved


def test_an_editor_request_alone_reads_its_prompt_in_whole_batches():
    """Pieces let a newcomer in; an editor's completion with no other interactive lane beside it has none to let in,
    and a CPU reads 512 rows a pass cheaper per row than 64 (a FIM re-reads ~500 tokens after the cursor)."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 2)
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))  # an editor is in use
    sched._ms_per_row = 20.0  # timed: 1-s pieces would be 50 rows
    engine = SpeculativeEngine(sched.lanes[1], NgramDrafter(1, 3), FixedK(4))
    prompt = [int(x) for x in np.random.default_rng(3).integers(2, 30, 1100)]
    out = _run(sched, [(1, engine, prompt, GenerationConfig(max_tokens=4), Priority(INTERACTIVE, seq=2, editor=True))])
    assert out[1] == greedy_reference(hashed_logits, prompt, 4)
    assert [p[0][1] for p in backend.passes[:2]] == [512, 512]


def test_a_long_requests_pass_between_an_editors_requests_counts_as_its_share():
    """KV stream per lane: the agent's piece that ran while no editor request was in (the one the editor's next request
    waited for as it arrived) pays for the share of that request's passes, so they need not stop for another piece
    until that much is owed again (ms per row 15, share 0.1: a 64-row piece, 960 ms, is due after 9.6 s of the
    editor's passes, 19.2 s after a piece in the gap); and it does come: the agent never starves."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.kv_streams = True
    sched = PassScheduler(backend, 2, piece_s=1.0, share=0.1)
    sched._ms_per_row = 15.0
    agent, = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1))])
    sched._account([(agent, 64)], 960.0, 64)  # between two editor requests
    fim, = _fake_subs(sched, [(1, 4, 4, Priority(INTERACTIVE, seq=2))])
    for n in range(1, 200):
        parts = sched._compose()
        if parts[0][0] is agent:
            break
        assert parts == [(fim, 4)]
        sched._account(parts, 200.0, 4)
    assert 94 <= n <= 98  # (960 + 960) / (0.1 x 200 ms) passes


@pytest.mark.parametrize("flat", [False, True], ids=["cpu-curve", "flat-curve"])
def test_with_kv_streams_on_a_cpu_long_requests_run_one_at_a_time(flat):
    """KV stream per lane, a CPU's curve: three chats sent at once run one after another in arrival order (their rows
    could not share a ubatch, so interleaving only made each wait for the others), each its greedy reply; on a flat
    curve (a GPU) they share the passes."""
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    backend.kv_streams = True
    sched, engines = _engines(backend, 3)
    sched.curve = _curve(lambda b: 50.0 + (0.1 if flat else 10.0) * b)
    config = GenerationConfig(max_tokens=30)
    out = _run(sched, [(i, engines[i], PROMPTS[i], config, Priority(BATCH, seq=i)) for i in range(3)],
               threading.Barrier(3))
    for i in range(3):
        assert out[i] == greedy_reference(hashed_logits, PROMPTS[i], 30), f"lane {i}"
    lanes = [tuple(lane for lane, _ in p) for p in backend.passes]
    if flat:
        assert any(len(p) > 1 for p in lanes)
    else:
        assert all(len(p) == 1 for p in lanes)
        switches = sum(1 for a, b in zip(lanes, lanes[1:]) if a != b)
        assert switches <= 4  # one lane's passes, then the next one's (a lane may get one pass before the others
        # have entered); interleaved, they switch at every pass


def test_compose_earliest_deadline_first_among_interactive():
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=64)
    sched = PassScheduler(backend, 2)
    late, soon = _fake_subs(sched, [(0, 60, 0, Priority(INTERACTIVE, deadline=50.0, seq=1)),
                                    (1, 60, 0, Priority(INTERACTIVE, deadline=10.0, seq=2))])
    parts = sched._compose()
    assert parts[0][0] is soon and parts[0][1] == 60  # the earlier deadline's prefill first, whole
    assert parts[1] == (late, 4)  # the other takes what the batch has left


def test_with_kv_streams_one_interactive_prompt_is_read_at_a_time():
    """KV streams and an interruptible backend: the interactive prompt first in line (the earlier deadline: a FIM
    beside a short reply) is read in whole batches, and the other's waits (its piece would be a llama_decode of its
    own in the same pass, slowing the first); a newcomer ahead of it would interrupt the pass."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.kv_streams = backend.interruptible = True
    sched = PassScheduler(backend, 3)
    sched._ms_per_row, sched._editor_at = 20.0, sched.clock()  # an editor in use: 1-s pieces would be 64 rows
    late, soon = _fake_subs(sched, [(0, 600, 1, Priority(INTERACTIVE, seq=1)),
                                    (1, 300, 1, Priority(INTERACTIVE, deadline=10.0, seq=2))])
    sched._active = {0, 1}
    assert sched._compose() == [(soon, 300)]


def test_a_long_prefill_alone_goes_in_pieces_so_a_newcomer_joins_within_one():
    """With an editor in use (its warm-up ran), an agent's prefill runs alone in pieces; an editor's request that
    arrives meanwhile is in the next pass."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 2)
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))
    engines = [SpeculativeEngine(lane, NgramDrafter(1, 3), FixedK(4)) for lane in sched.lanes]
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(2, 30, 1500)]
    first_piece = threading.Event()
    seen = {}

    class Marker(FakeBackend):
        pass

    orig = backend.decode_many

    def spy(parts):
        if len(backend.__dict__.get("passes", [])) == 1:
            first_piece.set()
            time.sleep(0.2)  # the editor arrives during the second piece
        return orig(parts)

    backend.decode_many = spy

    def editor():
        first_piece.wait(5)
        seen["arrived_at"] = len(backend.passes)
        sched.enter(sched.lanes[1], Priority(INTERACTIVE, seq=2))
        try:
            for r in engines[1].generate(PROMPTS[3], GenerationConfig(max_tokens=8)):
                if isinstance(r, Step) and "first_step" not in seen:
                    seen["first_step"] = len(backend.passes)
        finally:
            sched.leave(sched.lanes[1])

    t = threading.Thread(target=editor)
    t.start()
    out = _run(sched, [(0, engines[0], long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH, seq=1))])
    t.join(10)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    pieces = [p for p in backend.passes if p[0][0] == 0 and p[0][1] > 8]
    assert len(pieces) >= 3  # the prompt went in pieces, not in 512-token chunks only
    joined = next(i for i, p in enumerate(backend.passes) if any(lane == 1 for lane, _ in p))
    assert joined <= seen["arrived_at"] + 1  # the editor's prompt was in the pass after it arrived


def test_an_interactive_request_interrupts_a_long_requests_pass_under_way():
    """An editor's request that arrives while a pass holds only an agent's prefill piece stops that pass (the backend
    raises PassInterrupted, nothing evaluated): the editor's prompt is the next pass, the agent's piece goes again
    after it, both outputs are their own, and the request to stop is cleared so later passes run whole."""
    from specdec_cli.errors import PassInterrupted

    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 2)
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))  # an editor is in use: pieces
    engines = [SpeculativeEngine(lane, NgramDrafter(1, 3), FixedK(4)) for lane in sched.lanes]
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(2, 30, 1500)]
    stop, blocked, asked = threading.Event(), threading.Event(), []
    backend.interruptible = True

    def interrupt(on=True):
        asked.append(on)
        stop.set() if on else stop.clear()

    backend.interrupt = interrupt
    orig = backend.decode_many

    def slow_second(parts):  # the agent's second piece takes 5 s unless interrupted
        if len(backend.__dict__.get("passes", [])) == 1 and not blocked.is_set():
            blocked.set()
            if stop.wait(5):
                raise PassInterrupted(2, sum(len(t) for _, t, _ in parts))
        return orig(parts)

    backend.decode_many = slow_second
    seen: dict = {}
    t = _editor_during(sched, engines[1], blocked, 8, seen)
    out = _run(sched, [(0, engines[0], long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH, seq=1))])
    t.join(10)
    assert sched.interrupted == 1 and seen["waited"] < 2.0
    assert [lane for lane, _ in backend.passes[1]] == [1]  # the editor's prompt: the pass after the interrupted one
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)  # the agent's piece went again, its KV intact
    assert seen["out"] == greedy_reference(hashed_logits, PROMPTS[3], 8)
    assert asked[-1] is False and not stop.is_set()


def test_who_may_interrupt_a_pass():
    """`_preemption`: a newcomer ahead of every lane in the pass may stop it: a long request's piece (any interactive
    request), an interactive prefill read in a whole batch (an earlier deadline); never the long requests' share while
    an interactive lane waits for it, nor an interactive lane's verify step."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = True
    sched = PassScheduler(backend, 3)
    agent, = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1))])
    below = sched._preemption([(agent, 64)])
    assert Priority(INTERACTIVE, seq=9) < below  # any interactive newcomer
    chat, = _fake_subs(sched, [(1, 600, 1, Priority(INTERACTIVE, seq=2))])  # a short reply reading its prompt
    assert sched._preemption([(agent, 64)]) is None  # the share, paid while `chat` waits
    below = sched._preemption([(chat, 512)])
    assert Priority(INTERACTIVE, deadline=5.0, seq=9) < below  # a FIM with a deadline
    assert not Priority(INTERACTIVE, seq=9) < below  # a later short reply waits its turn
    assert sched._preemption([(chat, 600)]) is None  # its last rows want logits: it finishes
    backend.interruptible = False
    assert sched._preemption([(chat, 512)]) is None


def test_a_lane_that_leaves_is_free_at_once_while_another_lane_reads_its_prompt():
    """A lane whose request ended (or that ran the server's save: `PassScheduler.run`) returns at once, whatever
    another lane's prefill still has to read: it does not run that prefill's passes on its own thread (an editor's next
    completion waits for this lane, and must not wait for an agent's 512-token chunk to be read in pieces)."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 2)
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))  # an editor is in use: pieces
    engine = SpeculativeEngine(sched.lanes[0], NgramDrafter(1, 3), FixedK(4))
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(2, 30, 1500)]
    first_piece = threading.Event()
    ran_on: list[str] = []
    orig = backend.decode_many

    def spy(parts):
        ran_on.append(threading.current_thread().name)
        first_piece.set()
        time.sleep(0.02)
        return orig(parts)

    backend.decode_many = spy
    seen = {}

    def editor():
        first_piece.wait(5)
        sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, seq=2))  # e.g. the save after a request
        seen["back_after"] = len(ran_on)

    t = threading.Thread(target=editor, name="editor")
    t.start()
    out = _run(sched, [(0, engine, long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH, seq=1))])
    t.join(10)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    assert "editor" not in ran_on  # no pass ran on the leaving lane's thread
    assert seen["back_after"] <= 3 < len(ran_on) - 3  # back within a pass or two, long before the prefill's end


def _curve(cost) -> VerifyCurve:
    sizes = list(range(1, 129))
    return VerifyCurve(ms=tuple(float(cost(b)) for b in sizes))


def test_joint_k_shrinks_as_the_batch_grows_on_a_cpu_curve_and_not_on_a_flat_one():
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=128)
    cpu = _curve(lambda b: 86.0 + 9.0 * (b - 1))  # a pass over 16 rows ~2.6x one row
    sched = PassScheduler(backend, 4, curve=cpu)
    lanes = sched.lanes
    for lane in lanes:
        lane._acc = [7.0, 1.0]  # acceptance 0.875
    sched._active = {0}
    assert lanes[0].draft_limit == 127  # alone: as deep as a batch (its controller decides)
    sched._active = {0, 1}
    lanes[1].last_rows = 8
    two = lanes[0].draft_limit
    sched._active = {0, 1, 2, 3}
    lanes[2].last_rows = lanes[3].last_rows = 8
    four = lanes[0].draft_limit
    assert 0 < four < two < 127
    flat = PassScheduler(backend, 4, curve=_curve(lambda b: 10.0 + 0.01 * b))
    for lane in flat.lanes:
        lane._acc, lane.last_rows = [99.0, 1.0], 8  # a copy: drafts nearly always right
    flat._active = {0, 1, 2, 3}
    assert flat.lanes[0].draft_limit >= 32  # a flat curve: rows are nearly free, speculate deep
    sched_copy = PassScheduler(backend, 4, curve=cpu)
    for lane in sched_copy.lanes:
        lane._acc, lane.last_rows = [99.0, 1.0], 8
    sched_copy._active = {0, 1, 2, 3}
    assert sched_copy.lanes[0].draft_limit < flat.lanes[0].draft_limit  # the steep curve prices the rows


def test_with_a_kv_stream_per_lane_a_lane_keeps_its_own_k():
    """Each lane's rows are a ubatch of their own (`LlamaBackend.decode_many`): the others' rows do not make its
    draft dearer, so no joint bound shrinks it."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=64)
    backend.kv_streams = True
    sched = PassScheduler(backend, 4, curve=_curve(lambda b: 80.0 + 12.0 * b))
    for x in sched.lanes:
        sched._active.add(x.index)
        x.last_rows = 17
    assert sched.draft_limit(sched.lanes[0]) == 63
    backend.kv_streams = False
    assert PassScheduler(backend, 4, curve=_curve(lambda b: 80.0 + 12.0 * b)).split is False


def test_joint_k_never_below_plain_batched_decoding():
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=128)
    sched = PassScheduler(backend, 4, curve=_curve(lambda b: 10.0 * b))  # every row costs a full pass
    for lane in sched.lanes:
        lane._acc, lane.last_rows = [0.0, 5.0], 1  # drafts never accepted
    sched._active = {0, 1, 2, 3}
    assert sched.lanes[0].draft_limit == 0  # plain decoding rows only


def test_prefill_pieces_last_about_piece_s_at_the_measured_cost_per_row():
    """A waiting request joins within one piece: pieces are cut to ~piece_s seconds of prefill once a pass is timed."""
    from fakes import Clock

    clock = Clock()
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512, clock=clock, cost=lambda b: 5.0 * b)
    sched = PassScheduler(backend, 2, clock=clock, piece_s=0.5, quiet_s=60.0)
    engine = SpeculativeEngine(sched.lanes[0], NgramDrafter(1, 3), FixedK(4))
    long_prompt = [int(x) for x in np.random.default_rng(1).integers(2, 30, 1200)]
    job = [(0, engine, long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH))]
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE))  # a short chat, or a save: not an editor's
    out = _run(sched, job)  # no editor in use: whole batches (a CPU pays ~0.2 s a pass besides its rows)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    prefill = [rows for p in backend.passes for lane, rows in p if rows > 8]
    assert prefill[:2] == [512, 512] and sum(prefill) >= 1199 - 8
    sched.run(sched.lanes[1], lambda: None, Priority(INTERACTIVE, editor=True))  # an editor's warm-up: it is in use now
    backend.passes.clear()
    engine.target.truncate(0)
    out = _run(sched, job)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    prefill = [rows for p in backend.passes for lane, rows in p if rows > 8]
    assert all(rows <= 100 for rows in prefill)  # 0.5 s at 5 ms a row (timed by the first run's passes)
    assert sum(prefill) >= 1199 - 8
    clock.advance(61.0)  # the editor went quiet: whole batches again
    backend.passes.clear()
    engine.target.truncate(0)
    _run(sched, job)
    assert [rows for p in backend.passes for lane, rows in p if rows > 8][:2] == [512, 512]


def test_beside_a_long_prefill_a_decoding_lane_speculates_deeper():
    """A lane reading its prompt adds its next piece to the pass and no token: beside it a decoding lane's draft rows
    are nearly free (9 ms against a pass of ~4.7 s on a CPU-shaped curve), so its K is deep; counted as a lane
    decoding one row (what it verified last), the pass looked small and K stayed shallow."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = PassScheduler(backend, 2, curve=_curve(lambda b: 86.0 + 9.0 * (b - 1)))
    reader, decoder = sched.lanes
    decoder._acc = [3.0, 1.0]  # acceptance 0.75
    sched._active = {0, 1}
    _fake_subs(sched, [(0, 1500, 0, Priority(BATCH, seq=1))])  # lane 0's prompt, waiting for its pieces
    beside_prefill = decoder.draft_limit
    sched._subs.clear()
    reader.last_rows = 1  # lane 0 decoding plain steps instead
    beside_decoding = decoder.draft_limit
    assert beside_prefill >= 12 and beside_decoding <= 6


def test_lanes_of_a_recurrent_target_draft_within_its_snapshots_and_give_greedy_output():
    # a hybrid target with 2 snapshots per sequence: every lane's drafts stay within them (the joint K takes the
    # target's draft_limit), so each rollback is a snapshot's, and each lane's output is its own greedy one
    from fakes import bigram_logits

    backend = FakeBackend(bigram_logits, n_ctx=256, n_batch=64, recurrent="snapshots", n_rs_seq=2)
    sched, engines = _engines(backend, 2, k=8)
    config = GenerationConfig(max_tokens=40)
    prompts = [[2, 3, 4], [9, 10, 11]]
    out = _run(sched, [(i, engines[i], prompts[i], config, Priority(BATCH, seq=i)) for i in range(2)],
               threading.Barrier(2))
    for i, lane in enumerate(sched.lanes):
        assert out[i] == greedy_reference(bigram_logits, prompts[i], 40), f"lane {i}"
        assert lane.inner.n_checkpoint_rollbacks == 0 and lane.inner.n_poisoned == 0, f"lane {i}"
        assert lane.inner.n_decode_calls < 30  # it speculated: plain decoding takes a pass per token
