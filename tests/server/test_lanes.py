"""Several sequences at once (`server.lanes`): one loop's shared passes, the scheduler's order, each slot's K.

Each test drives `Scheduler.step` itself, so when a request arrives is a pass count, never a wall-clock moment."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from fakes import EstimatingK, FakeBackend, greedy_reference, hashed_logits
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, Rows, SpeculativeEngine
from specdec_cli.core.records import Prefill, Step
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.server.lanes import BATCH, INTERACTIVE, MIN_PIECE, Priority, Scheduler, Slot, _Sub

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [10, 11, 12, 10, 11, 12, 10], [3, 4, 3, 4, 3, 4, 3, 4], [20, 21, 22, 23]]


def _engines(
    backend: FakeBackend, n: int, k: int = 4, curve: VerifyCurve | None = None
) -> tuple[Scheduler, list[SpeculativeEngine]]:
    """A scheduler of n slots over `backend` (its verify curve `curve`); an engine per slot."""
    sched = Scheduler(backend, n, curve=curve)
    return sched, [_engine(slot, k) for slot in sched.slots]


def _engine(slot, k: int = 4) -> SpeculativeEngine:
    """An engine over `slot`'s sequence, its passes priced by the scheduler (`SpeculativeEngine.passes`)."""
    engine = SpeculativeEngine(slot.backend, NgramDrafter(1, 3), FixedK(k))
    engine.passes = slot
    return engine


def _program(
    engine: SpeculativeEngine,
    prompt: list[int],
    config: GenerationConfig,
    got: list[int],
    stop_after: int | None = None,
    prefills: list | None = None,
):
    """The engine's steps as a scheduler program: its rows go out, its emitted tokens into `got` (its Prefill records
    into `prefills`); it stops (as a client that went away) once it has `stop_after` tokens."""
    steps = engine.steps(prompt, config)
    answer = None
    try:
        while True:
            try:
                item = steps.send(answer)
            except StopIteration:
                return
            answer = None
            if isinstance(item, Rows):
                answer = yield item
            elif isinstance(item, Prefill) and prefills is not None:
                prefills.append(item)
            elif isinstance(item, Step):
                got += item.emitted
                if stop_after is not None and len(got) >= stop_after:
                    return  # the engine's finally trims the slot's KV cache
    finally:
        steps.close()


def _run(
    sched: Scheduler,
    jobs: list[tuple[int, SpeculativeEngine, list[int], GenerationConfig, Priority]],
    arrivals: dict[int, tuple] | None = None,
) -> dict[int, list[int]]:
    """Start each (slot, engine, prompt, config, priority) and step until every sequence ended; `arrivals`: pass count
    -> such a job, started before the step after that many passes. The output tokens by slot."""
    out: dict[int, list[int]] = {}
    arrivals = dict(arrivals or {})

    def start(i, engine, prompt, config, priority):
        out[i] = []
        sched.start(sched.slots[i], _program(engine, prompt, config, out[i]), priority)

    for job in jobs:
        start(*job)
    for _ in range(10_000):
        for at in [at for at in arrivals if at <= len(sched.backend.__dict__.get("passes", []))]:
            start(*arrivals.pop(at))
        if not sched.busy and not arrivals:
            return out
        sched.step()
    raise AssertionError("a sequence never finished")


def _flat() -> VerifyCurve:
    """A flat verify curve (a GPU's): long requests share the passes (on a CPU's they run one at a time)."""
    return _curve(lambda b: 50.0 + 0.1 * b)


def test_shared_passes_give_each_sequence_its_own_greedy_output():
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 4, curve=_flat())
    config = GenerationConfig(max_tokens=40)
    jobs = [(i, engines[i], PROMPTS[i], config, Priority(BATCH, seq=i)) for i in range(4)]
    out = _run(sched, jobs)
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
    sched2, engines2 = _engines(backend2, 2, curve=_flat())
    other = GenerationConfig(max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=7))
    both = _run(
        sched2,
        [(0, engines2[0], PROMPTS[0], sampled, Priority(seq=0)), (1, engines2[1], PROMPTS[1], other, Priority(seq=1))],
    )
    assert any(len(p) > 1 for p in backend2.passes)
    assert both[0] == alone


def test_a_seeded_sampled_request_is_unchanged_when_a_neighbour_shortens_its_drafts(monkeypatch):
    # a slot's controller may give it fewer draft tokens beside others; keyed sampling makes the output independent
    # of K.
    # A target with one favourite after each token: its outputs repeat, so n-gram drafts are often accepted.
    def markov(prefix):
        return hashed_logits(prefix[-1:])

    sampled = GenerationConfig(max_tokens=30, sampling=SamplingParams(temperature=0.9, seed=1234))
    sched, engines = _engines(FakeBackend(markov, n_ctx=256, n_batch=64), 2)
    alone = _run(sched, [(0, engines[0], PROMPTS[0], sampled, Priority())])[0]
    monkeypatch.setattr(Slot, "draft_limit", property(lambda self: 1 if len(self._s._active) > 1 else 4))
    backend2 = FakeBackend(markov, n_ctx=256, n_batch=64)
    sched2, engines2 = _engines(backend2, 2, curve=_flat())
    other = GenerationConfig(max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=7))
    both = _run(
        sched2,
        [(0, engines2[0], PROMPTS[0], sampled, Priority(seq=0)), (1, engines2[1], PROMPTS[1], other, Priority(seq=1))],
    )
    assert any(len(p) > 1 for p in backend2.passes)
    assert both[0] == alone


def test_a_cancelled_sequence_leaves_the_others_kv_intact():
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 2, curve=_flat())
    config = GenerationConfig(max_tokens=40)
    got: list[int] = []
    sched.start(sched.slots[1], _program(engines[1], PROMPTS[1], config, got, stop_after=5), Priority(seq=1))
    out = _run(sched, [(0, engines[0], PROMPTS[0], config, Priority(seq=0))])
    assert out[0] == greedy_reference(hashed_logits, PROMPTS[0], 40)
    assert any(len(p) > 1 for p in backend.passes)  # they shared passes before B stopped
    slot_b = sched.slots[1]
    committed = list(PROMPTS[1]) + got
    held = list(slot_b.backend.tokens)
    assert held == committed[: len(held)]  # only committed tokens left, none of A's
    assert len(held) >= len(committed) - 1


def _fake_subs(sched: Scheduler, spec: list[tuple[int, int, int, Priority]]) -> list[_Sub]:
    """Waiting rows for `_compose`: (lane, tokens, n_logits, priority) each."""
    subs = []
    for lane, n, n_logits, priority in spec:
        sched.slots[lane].priority = priority
        sub = _Sub(sched.slots[lane], np.zeros(n, np.int32), n_logits)
        sched._subs[lane] = sub
        subs.append(sub)
    return subs


def test_a_long_prefill_gets_a_piece_at_most_from_one_run_of_interactive_requests_to_the_next_and_one_pass_at_least():
    """A KV stream per lane: llama.cpp would run an agent's rows beside an editor's as ubatches of their own anyway,
    so no pass mixes them. From the end of one run of interactive requests to the end of the next, the agent gets at
    most a piece (`piece_s`, 0.5 s here) beside them, what it had between the two runs included: an editor's request
    that came just after the agent's pieces gets no piece of it, however long it runs (over 5 s of passes here); and one
    pass at least: a request sent as the previous one ended, before the loop could give the agent its pass, waits
    for one piece (a virtual clock, passes of 10 + 5 ms a row, share 0.25)."""
    from fakes import Clock

    clock = Clock()
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512, clock=clock, cost=lambda b: 10.0 + 5.0 * b)
    sched = Scheduler(backend, 2, clock=clock, piece_s=0.5, share=0.25)
    engines = [_engine(slot) for slot in sched.slots]
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(2, 30, 3000)]
    sched.note(Priority(INTERACTIVE, editor=True))  # the editor's warm-up: it is in use
    out: dict[int, list[int]] = {0: [], 1: [], 2: []}
    sched.start(sched.slots[0], _program(engines[0], long_prompt, GenerationConfig(max_tokens=4), out[0]), Priority())
    windows = []
    for n, (prompt, max_tokens) in enumerate([(PROMPTS[3], 400), (PROMPTS[2], 300)], start=1):
        while sched.passes < 2 * n:  # the agent's pieces before the first request; none before the second
            sched.step()
        first = sched.passes
        config = GenerationConfig(max_tokens=max_tokens)
        sched.start(sched.slots[1], _program(engines[1], prompt, config, out[n]), Priority(INTERACTIVE, seq=n))
        while sched.slots[1].program is not None:
            sched.step()
        windows.append(backend.passes[first:])
    while sched.busy:
        sched.step()
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    assert out[1] == greedy_reference(hashed_logits, PROMPTS[3], 400)
    assert out[2] == greedy_reference(hashed_logits, PROMPTS[2], 300)
    assert not any(len(p) > 1 for p in backend.passes)  # never an agent's rows beside the editor's
    for window in windows:
        assert sum(10.0 + 5.0 * p[0][1] for p in window) > 5_000  # (long enough for the share, 0.25, to pass a piece)
    assert all(p[0][0] == 1 for p in windows[0])  # the agent's pieces just before it were its piece
    agent = [10.0 + 5.0 * p[0][1] for p in windows[1] if p[0][0] == 0]
    assert windows[1][0][0][0] == 0  # its owed pass first: it had none since the last run (half a piece)
    assert 0 < sum(agent) <= 500.0 + 10.0  # a piece in all, priced per row (give or take a pass's fixed 10 ms)
    assert any(p[0][0] == 0 for p in backend.passes[len(backend.passes) - 1 :])  # the agent's prompt goes on after


def test_an_editor_request_alone_reads_its_prompt_in_whole_batches():
    """Pieces let a newcomer in; an editor's completion with no other interactive lane beside it has none to let in,
    and a CPU reads 512 rows a pass cheaper per row than 64 (a FIM re-reads ~500 tokens after the cursor)."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = Scheduler(backend, 2)
    sched.note(Priority(INTERACTIVE, editor=True))  # an editor is in use
    sched._ms_per_row = 20.0  # timed: 1-s pieces would be 50 rows
    engine = _engine(sched.slots[1])
    prompt = [int(x) for x in np.random.default_rng(3).integers(2, 30, 1100)]
    out = _run(sched, [(1, engine, prompt, GenerationConfig(max_tokens=4), Priority(INTERACTIVE, seq=2, editor=True))])
    assert out[1] == greedy_reference(hashed_logits, prompt, 4)
    assert [p[0][1] for p in backend.passes[:2]] == [512, 512]


@pytest.mark.parametrize("gap_ms", [960.0, 300.0])
def test_a_long_requests_pass_between_an_editors_requests_counts_as_its_share_and_its_piece(gap_ms):
    """KV stream per lane: the agent's piece that ran while no editor request was in (it cost that request nothing)
    pays for the share of the next request's passes and counts against the piece the agent may have beside it (ms
    per row 15, share 0.1, piece_s 1 s: the smallest piece, MIN_PIECE rows at 15 ms, costs 480 ms). After a 960-ms
    piece in the gap the completion's passes never stop for the agent; after a 300-ms one, once: when the completion's
    passes made up for the gap's piece and owed it that much again."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = Scheduler(backend, 2, piece_s=1.0, share=0.1)
    sched._ms_per_row = 15.0
    (agent,) = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1))])
    sched._account([(agent, 64)], gap_ms)  # between two editor requests
    sched.start(sched.slots[1], (rows for rows in ()), Priority(INTERACTIVE, seq=2))  # the next one arrives
    (fim,) = _fake_subs(sched, [(1, 4, 4, Priority(INTERACTIVE, seq=2))])
    agent_passes = []
    for n in range(200):
        parts = sched._compose()
        if parts[0][0] is agent:
            assert parts == [(agent, MIN_PIECE)]
            agent_passes.append(n)
        else:
            assert parts == [(fim, 4)]
        sched._account(parts, MIN_PIECE * 15.0 if parts[0][0] is agent else 200.0)
    if gap_ms > 1000.0 - MIN_PIECE * 15.0:
        assert agent_passes == []
        return
    due = (gap_ms + MIN_PIECE * 15.0) / (0.1 * 200.0)  # passes of 200 ms, a tenth of each owed
    assert len(agent_passes) == 1 and due - 2 <= agent_passes[0] <= due + 2


def test_a_long_request_gets_a_piece_beside_each_interactive_one_even_where_the_smallest_costs_more_than_piece_s():
    """Deep in a context a piece of MIN_PIECE rows can cost more than `piece_s` (an editor's completion 4k tokens
    deep read 37 ms a row): the long request still gets that one piece beside each interactive request, and no
    second (it was starved: back-to-back completions ran for minutes without it)."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    sched = Scheduler(backend, 2, piece_s=1.0, share=0.1)
    sched._ms_per_row = 40.0  # the smallest piece: 1,280 ms
    (agent,) = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1))])
    sched.start(sched.slots[1], (rows for rows in ()), Priority(INTERACTIVE, seq=2))
    (fim,) = _fake_subs(sched, [(1, 4, 4, Priority(INTERACTIVE, seq=2))])
    agent_passes = []
    for n in range(400):
        parts = sched._compose()
        if parts[0][0] is agent:
            assert parts == [(agent, MIN_PIECE)]
            agent_passes.append(n)
        sched._account(parts, MIN_PIECE * 40.0 if parts[0][0] is agent else 200.0)
    assert len(agent_passes) == 1  # once a tenth of the completion's passes paid for it


@pytest.mark.parametrize("flat", [False, True], ids=["cpu-curve", "flat-curve"])
def test_on_a_cpu_long_prompts_are_read_one_at_a_time_before_their_steps_which_share_passes(flat):
    """A KV stream per lane and a CPU's curve: three chats sent at once have their prompts read one after another in
    arrival order, each alone in its pass (a piece beside a step only makes the step wait), and then their verify
    steps share the passes (steps of equal rows share a ubatch); a fourth arriving while they decode has its prompt
    read in the next pass, alone. Each its greedy reply. On a flat curve (a GPU) they share every pass."""
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 4)
    sched.curve = _curve(lambda b: 50.0 + (0.1 if flat else 10.0) * b)
    config = GenerationConfig(max_tokens=30)
    jobs = [(i, engines[i], PROMPTS[i], config, Priority(BATCH, seq=i)) for i in range(3)]
    out = _run(sched, jobs, arrivals={6: (3, engines[3], PROMPTS[3], config, Priority(BATCH, seq=3))})
    for i in range(4):
        assert out[i] == greedy_reference(hashed_logits, PROMPTS[i], 30), f"lane {i}"
    passes = backend.passes
    if flat:
        assert passes[0] == tuple((i, len(PROMPTS[i]) - 1) for i in range(3))  # the three prompts in one pass
        return
    assert passes[:3] == [((i, len(PROMPTS[i]) - 1),) for i in range(3)]  # each prompt alone, in arrival order
    assert all(sorted(lane for lane, _ in p) == [0, 1, 2] for p in passes[3:6])  # then their steps, together
    assert passes[6] == ((3, len(PROMPTS[3]) - 1),)  # the newcomer's prompt, before the others' next step
    assert sorted(lane for lane, _ in passes[7]) == [0, 1, 2, 3]


def test_compose_earliest_deadline_first_among_interactive():
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=64)
    sched = Scheduler(backend, 2)
    late, soon = _fake_subs(
        sched,
        [
            (0, 60, 0, Priority(INTERACTIVE, deadline=50.0, seq=1)),
            (1, 60, 0, Priority(INTERACTIVE, deadline=10.0, seq=2)),
        ],
    )
    # the earlier deadline's prefill first, whole; the other's waits (one interactive prompt at a time)
    assert sched._compose() == [(soon, 60)]
    del sched._subs[1]
    assert sched._compose() == [(late, 60)]


def test_one_interactive_prompt_is_read_at_a_time():
    """An interruptible backend: the interactive prompt first in line (the earlier deadline: a FIM
    beside a short reply) is read in whole batches, and the other's waits (its piece would be a llama_decode of its
    own in the same pass, slowing the first); a newcomer ahead of it would interrupt the pass."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = True
    sched = Scheduler(backend, 3)
    sched._ms_per_row, sched._editor_at = 20.0, sched.clock()  # an editor in use: 1-s pieces would be 64 rows
    late, soon = _fake_subs(
        sched, [(0, 600, 1, Priority(INTERACTIVE, seq=1)), (1, 300, 1, Priority(INTERACTIVE, deadline=10.0, seq=2))]
    )
    sched._active = {0, 1}
    assert sched._compose() == [(soon, 300)]


def _long_beside_editor(interruptible: bool = False):
    """An editor in use (its warm-up ran) and an agent's 1500-token prompt on slot 0: (backend, sched, engines,
    prompt, agent's job)."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = interruptible
    sched = Scheduler(backend, 2)
    sched.note(Priority(INTERACTIVE, editor=True))
    engines = [_engine(slot) for slot in sched.slots]
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(2, 30, 1500)]
    return (
        backend,
        sched,
        engines,
        long_prompt,
        (0, engines[0], long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH, seq=1)),
    )


def test_a_long_prefill_alone_goes_in_pieces_so_a_newcomer_joins_within_one():
    """With an editor in use (its warm-up ran), an agent's prefill runs alone in pieces; an editor's request that
    arrives meanwhile is in the next pass."""
    backend, sched, engines, long_prompt, agent = _long_beside_editor()
    editor = (1, engines[1], PROMPTS[3], GenerationConfig(max_tokens=8), Priority(INTERACTIVE, seq=2))
    out = _run(sched, [agent], {2: editor})  # it arrives after the second piece
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    assert out[1] == greedy_reference(hashed_logits, PROMPTS[3], 8)
    pieces = [p for p in backend.passes if p[0][0] == 0 and p[0][1] > 8]
    assert len(pieces) >= 3  # the prompt went in pieces, not in 512-token chunks only
    joined = next(i for i, p in enumerate(backend.passes) if any(slot == 1 for slot, _ in p))
    assert joined == 2  # the editor's prompt was in the pass after it arrived


def test_an_interactive_request_interrupts_a_long_requests_pass_under_way():
    """An editor's request that arrives while a pass holds only an agent's prefill piece stops that pass (the backend
    raises PassInterrupted, nothing evaluated): the editor's prompt is the next pass, the agent's piece goes again
    after it, both outputs are their own, and the request to stop is cleared so later passes run whole."""
    from specdec_cli.errors import PassInterrupted

    backend, sched, engines, long_prompt, agent = _long_beside_editor(interruptible=True)
    asked: list[bool] = []
    backend.interrupt = lambda on=True: asked.append(on)
    orig = backend.decode_many
    out: dict[int, list[int]] = {1: []}

    def arrives_during_second(parts, calls=None):  # the editor's request comes while the agent's second piece runs
        if len(backend.__dict__.get("passes", [])) == 1 and sched.slots[1].program is None and not out[1]:
            priority = Priority(INTERACTIVE, seq=2)
            sched.start(
                sched.slots[1], _program(engines[1], PROMPTS[3], GenerationConfig(max_tokens=8), out[1]), priority
            )
            sched.preempt(priority)  # what the worker does as it takes the request
            if asked[-1] is True:
                raise PassInterrupted(2, sum(len(t) for _, t, _ in parts))
        return orig(parts, calls)

    backend.decode_many = arrives_during_second
    out.update(_run(sched, [agent]))
    assert sched.interrupted == 1
    assert [slot for slot, _ in backend.passes[1]] == [1]  # the editor's prompt: the pass after the interrupted one
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)  # the agent's piece went again, its KV intact
    assert out[1] == greedy_reference(hashed_logits, PROMPTS[3], 8)
    assert asked[-1] is False and asked.count(True) == 1  # cleared after the pass: later passes run whole


def test_who_may_interrupt_a_pass():
    """`_preemption`: a newcomer ahead of every sequence in the pass may stop it: a long request's piece (any
    interactive request), an interactive prefill read in a whole batch (an earlier deadline); never the long requests'
    share while an interactive slot waits for it, nor an interactive slot's verify step."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = True
    sched = Scheduler(backend, 3)
    (agent,) = _fake_subs(sched, [(0, 512, 0, Priority(BATCH, seq=1))])
    below = sched._preemption([(agent, 64)])
    assert Priority(INTERACTIVE, seq=9) < below  # any interactive newcomer
    (chat,) = _fake_subs(sched, [(1, 600, 1, Priority(INTERACTIVE, seq=2))])  # a short reply reading its prompt
    assert sched._preemption([(agent, 64)]) is None  # the share, paid while `chat` waits
    below = sched._preemption([(chat, 512)])
    assert Priority(INTERACTIVE, deadline=5.0, seq=9) < below  # a FIM with a deadline
    assert not Priority(INTERACTIVE, seq=9) < below  # a later short reply waits its turn
    assert sched._preemption([(chat, 600)]) is None  # its last rows want logits: it finishes
    sched._due = True  # the long requests are owed their pass: it is not interrupted, an interactive one's pass is
    assert Priority(INTERACTIVE, deadline=5.0, seq=9) < sched._preemption([(chat, 512)])
    sched.interruptible = False  # a backend that cannot stop a pass (read from it as the scheduler is made)
    assert sched._preemption([(chat, 512)]) is None


def test_the_long_requests_pass_as_interactive_requests_end_is_a_piece_that_is_not_interrupted():
    """As the last interactive request ends, the long request's next pass is the one it is owed (one pass at least
    from one run of interactive requests to the next): half a piece (`piece_s` at the measured ms per row, though no
    editor came for a minute), never interrupted: a completion arriving meanwhile (an editor sends the next as the
    last is answered) waits for the rest of it and then goes first (it was the long request's piece beside it),
    where an interruption would make it wait more (the long request would be owed its pass again before the
    newcomer's first). Its next pass is a whole batch again, and a newcomer may interrupt it."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = True
    sched = Scheduler(backend, 2, piece_s=1.0)
    sched._ms_per_row = 20.0
    (agent,) = _fake_subs(sched, [(0, 2048, 0, Priority(BATCH, seq=1))])
    sched._active.add(0)
    sched.start(sched.slots[1], (rows for rows in ()), Priority(INTERACTIVE, seq=2))
    sched._owed_ms = 5000.0  # it waited through the interactive request's passes
    sched._end(sched.slots[1])
    parts = sched._compose()
    assert parts == [(agent, 25)]  # 0.5 s at 20 ms a row, not the whole batch
    assert sched._preemption(parts) is None
    sched._account(parts, 500.0)
    assert sched._preemption(sched._compose()) is not None and sched._compose() == [(agent, 512)]
    sched.start(sched.slots[1], (rows for rows in ()), Priority(INTERACTIVE, seq=3))  # it came during the piece
    (fim,) = _fake_subs(sched, [(1, 4, 4, Priority(INTERACTIVE, seq=3))])
    assert sched._compose() == [(fim, 4)]


def test_the_pass_owed_as_interactive_requests_end_is_forgotten_once_no_long_request_is_left():
    """The long request owed a pass as the last interactive one ended ends (cancelled) before it had it: nobody is
    owed anything, so the next long request's first pass is a whole batch that a newcomer may interrupt, not the
    owed half piece nobody may."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    backend.interruptible = True
    sched = Scheduler(backend, 2, piece_s=1.0)
    sched._ms_per_row = 20.0
    _fake_subs(sched, [(0, 2048, 0, Priority(BATCH, seq=1))])
    sched._active.add(0)
    sched.start(sched.slots[1], (rows for rows in ()), Priority(INTERACTIVE, seq=2))
    sched._end(sched.slots[1])
    assert sched._due  # the agent is owed its pass
    sched._end(sched.slots[0])  # the agent's client went away
    (agent,) = _fake_subs(sched, [(0, 2048, 0, Priority(BATCH, seq=3))])
    sched._active.add(0)
    parts = sched._compose()
    assert parts == [(agent, 512)] and sched._preemption(parts) is not None


def test_a_slot_whose_request_ended_is_free_at_once_while_another_reads_its_prompt():
    """A slot whose request ended takes the next one at once, whatever another slot's prefill still has to read: an
    editor's next completion, sent to the slot holding its prefix, joins the next pass instead of waiting for an
    agent's prompt to be read to its end."""
    backend, sched, engines, long_prompt, agent = _long_beside_editor()
    first: list[int] = []
    sched.start(
        sched.slots[1],
        _program(engines[1], PROMPTS[3], GenerationConfig(max_tokens=2), first),
        Priority(INTERACTIVE, seq=2),
    )
    out = {0: []}
    sched.start(sched.slots[0], _program(*agent[1:4], out[0]), agent[4])
    while sched.slots[1].program is not None:
        sched.step()
    ended_at = len(backend.passes)
    second: list[int] = []
    sched.start(
        sched.slots[1],
        _program(engines[1], PROMPTS[2], GenerationConfig(max_tokens=4), second),
        Priority(INTERACTIVE, seq=3),
    )
    while sched.busy:
        sched.step()
    assert first == greedy_reference(hashed_logits, PROMPTS[3], 2)
    assert second == greedy_reference(hashed_logits, PROMPTS[2], 4)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    assert any(slot == 1 for slot, _ in backend.passes[ended_at])  # the next request joined the very next pass
    agent_rows_after = sum(rows for p in backend.passes[ended_at:] for slot, rows in p if slot == 0)
    assert agent_rows_after > 512  # long before the agent's prompt was read


def _curve(cost) -> VerifyCurve:
    sizes = list(range(1, 129))
    return VerifyCurve(ms=tuple(float(cost(b)) for b in sizes))


@pytest.mark.parametrize("estimates", [True, False])
def test_steps_of_unequal_rows_are_cut_to_meet_in_one_call_each_reply_its_greedy_one(estimates):
    """Three lanes with K 3, 6 and 9 on a curve where a call's fixed cost is dear: their verify steps (which
    `decode_many` would run as a call per row count) are cut to one count per pass. Drafts without an estimate are
    never cut."""

    def markov(prefix):  # one favourite after each token: the outputs repeat and n-gram drafts run long
        return hashed_logits(prefix[-1:])

    backend = FakeBackend(markov, n_ctx=256, n_batch=64)
    sched = Scheduler(backend, 3, curve=_curve(lambda b: 200.0 + 4.0 * b))
    engines = []
    for slot, k in zip(sched.slots, (3, 6, 9), strict=True):
        engines.append(SpeculativeEngine(slot.backend, NgramDrafter(1, 3), (EstimatingK if estimates else FixedK)(k)))
        engines[-1].passes = slot
    config = GenerationConfig(max_tokens=40)
    out = _run(sched, [(i, engines[i], PROMPTS[i], config, Priority(BATCH, seq=i)) for i in range(3)])
    for i in range(3):
        assert out[i] == greedy_reference(markov, PROMPTS[i], 40), f"lane {i}"
    drafting = [p for p in backend.passes if len([m for _, m in p if m > 1]) > 1]  # passes of two drafts or more
    assert drafting
    unequal = [p for p in drafting if len({m for _, m in p if m > 1}) > 1]
    assert (unequal == []) == estimates, unequal


def test_steps_of_equal_rows_go_in_calls_by_depth_where_attention_is_dear():
    """Two lanes deep in their contexts and two shallow, 16 rows each, on a curve that prices attention per row and
    token of context: one llama_decode would make the shallow lanes' rows attend over the deep ones' cells, so the
    pass is two calls, neighbours in depth together (`cost_model.meet`), handed to `decode_many` as keys."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512)
    curve = VerifyCurve(ms=tuple(80.0 + 12.0 * b for b in range(1, 66)), depth_ms=(0.0, 5.0))
    sched = Scheduler(backend, 4, curve=curve)
    for slot, depth in zip(sched.slots, (3000, 100, 3100, 200), strict=True):
        slot.backend.decode(np.full(depth, 5, np.int32), 0)

    def done():  # a program at its step, ending once answered
        yield None

    subs = _fake_subs(sched, [(i, 16, 16, Priority(BATCH, seq=i)) for i in range(4)])
    for slot in sched.slots:
        slot.program = done()
        next(slot.program)
        sched._active.add(slot.index)
    parts = sched._compose()
    assert [s.call for s in subs] == [1, 0, 1, 0] and [m for _, m in parts] == [16] * 4
    sched._pass(parts)
    assert backend.calls == [(1, 0, 1, 0)] and not sched.busy


def test_a_lane_keeps_its_own_k_beside_others():
    """Each lane's rows are a ubatch of their own (`LlamaBackend.decode_many`): the others' rows do not make its
    draft dearer, so nothing shrinks it below what a batch takes."""
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=64)
    sched = Scheduler(backend, 4, curve=_curve(lambda b: 80.0 + 12.0 * b))
    for x in sched.slots:
        sched._active.add(x.index)
    assert sched.slots[0].draft_limit == 63


def test_prefill_pieces_last_about_piece_s_at_the_measured_cost_per_row():
    """A waiting request joins within one piece: pieces are cut to ~piece_s seconds of prefill once a pass is timed."""
    from fakes import Clock

    clock = Clock()
    backend = FakeBackend(hashed_logits, n_ctx=4096, n_batch=512, clock=clock, cost=lambda b: 5.0 * b)
    sched = Scheduler(backend, 2, clock=clock, piece_s=0.5, quiet_s=60.0)
    engine = _engine(sched.slots[0])
    long_prompt = [int(x) for x in np.random.default_rng(1).integers(2, 30, 1200)]
    job = [(0, engine, long_prompt, GenerationConfig(max_tokens=4), Priority(BATCH))]
    sched.note(Priority(INTERACTIVE))  # a short chat: not an editor's
    out = _run(sched, job)  # no editor in use: whole batches (a CPU pays ~0.2 s a pass besides its rows)
    assert out[0] == greedy_reference(hashed_logits, long_prompt, 4)
    prefill = [rows for p in backend.passes for lane, rows in p if rows > 8]
    assert prefill[:2] == [512, 512] and sum(prefill) >= 1199 - 8
    sched.note(Priority(INTERACTIVE, editor=True))  # an editor's warm-up: it is in use now
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


def test_lanes_of_a_recurrent_target_draft_within_its_snapshots_and_give_greedy_output():
    # a hybrid target with 2 snapshots per sequence: every lane's drafts stay within them (`Slot.draft_limit` takes the
    # target's draft_limit), so each rollback is a snapshot's, and each lane's output is its own greedy one
    from fakes import bigram_logits

    backend = FakeBackend(bigram_logits, n_ctx=256, n_batch=64, recurrent="snapshots", n_rs_seq=2)
    sched, engines = _engines(backend, 2, k=8)
    config = GenerationConfig(max_tokens=40)
    prompts = [[2, 3, 4], [9, 10, 11]]
    out = _run(sched, [(i, engines[i], prompts[i], config, Priority(BATCH, seq=i)) for i in range(2)])
    for i, lane in enumerate(sched.slots):
        assert out[i] == greedy_reference(bigram_logits, prompts[i], 40), f"lane {i}"
        assert lane.backend.n_checkpoint_rollbacks == 0 and lane.backend.n_poisoned == 0, f"lane {i}"
        assert lane.backend.n_decode_calls < 30  # it speculated: plain decoding takes a pass per token


@pytest.mark.parametrize("same_client", [True, False])
def test_a_prompt_prefix_another_slot_of_its_client_read_is_copied_not_read_again(same_client):
    """Three chats at once with a 40-token system prompt in common, on a CPU's curve (prompts read one at a time):
    the second and third copy the common prefix from a slot that read it (`copy_prefix`) and evaluate only their own
    rows, each reply its greedy one, its Prefill counting only the rows it evaluated. Slots of two clients
    (`Slot.scope`) copy nothing from each other."""
    from specdec_cli.models.llama import COPY_MIN

    common = [int(x) for x in np.random.default_rng(3).integers(2, 30, 40)]
    assert len(common) >= COPY_MIN
    prompts = [common + tail for tail in ([40, 41, 42], [43, 44], [45, 46, 47, 48])]
    backend = FakeBackend(hashed_logits, n_ctx=256, n_batch=64)
    sched, engines = _engines(backend, 3, curve=_curve(lambda b: 50.0 + 10.0 * b))
    for slot in sched.slots:
        slot.scope = "a" if same_client or slot.index == 0 else f"client {slot.index}"
    config = GenerationConfig(max_tokens=20)
    out, seen, checked = {}, {}, []
    for i in range(3):
        out[i], seen[i] = [], []
        program = _program(engines[i], prompts[i], config, out[i], prefills=seen[i])
        sched.start(sched.slots[i], program, Priority(BATCH, seq=i), check=partial(checked.append, i))
    while sched.busy:
        sched.step()
    for i in range(3):
        assert out[i] == greedy_reference(hashed_logits, prompts[i], 20), f"lane {i}"
    copies = backend.__dict__.get("copies", [])
    if not same_client:
        assert copies == [] and [s[0].n_evaluated for s in seen.values()] == [len(p) - 1 for p in prompts]
        return
    assert copies == [(0, 1, 40), (0, 2, 40)]
    assert backend.passes[:3] == [((0, 42),), ((1, 1),), ((2, 3),)]  # each prompt's own rows only
    assert [s[0].n_evaluated for s in seen.values()] == [42, 1, 3]
    # a prefill whose rows so far were copied is not checked before its pass: llama.cpp runs the copy at the start of
    # the next llama_decode, and a state read before that (a parked or saved one) would hold the cells uncopied
    assert checked == []
