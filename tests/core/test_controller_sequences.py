"""`--k auto` per sequence (issue 56): one `AdaptiveK` shared by several sequences (a server's lanes) shares what it
learns across replies, while each sequence keeps its own per-reply state, so sequences generating at once never
overwrite each other's schedule; one sequence alone decides exactly as the controller in place."""

from __future__ import annotations

import numpy as np

from fakes import Clock, FakeBackend, hashed_logits
from specdec_cli.core.controller import AdaptiveK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.suffix import SuffixDrafter

CURVE = VerifyCurve(ms=tuple(45.0 + 30.0 * b for b in range(1, 66)))  # a nearly linear CPU curve
VOCAB = 64


def copying(seed: int):
    """A prompt and a target that writes it again, one token in 20 changed (runs that prompt lookup drafts)."""
    prompt = [int(t) for t in np.random.default_rng(seed).integers(2, 60, 300)]

    def fn(prefix):
        logits = np.zeros(VOCAB, np.float32)
        i = len(prefix) - len(prompt)
        logits[(prompt[i] if i % 20 != 19 else 61) if 0 <= i < len(prompt) else 2] = 5.0
        return logits

    return prompt, fn


def free_text(seed: int):
    """A prompt and a target whose tokens prompt lookup nearly never drafts right."""
    return [int(t) for t in np.random.default_rng(seed).integers(2, 60, 300)], lambda p: hashed_logits(p, VOCAB, seed)


def engine(case, controller: AdaptiveK) -> SpeculativeEngine:
    clock = Clock()
    target = FakeBackend(case[1], n_ctx=1024, n_batch=128, vocab=VOCAB, clock=clock, cost=CURVE.at)
    return SpeculativeEngine(target, AutoDrafter(SuffixDrafter(None)), controller, clock=clock, curve=CURVE)


def schedule(records) -> list[tuple[int, int]]:
    """(K, tokens verified) of each step."""
    return [(r.k, len(r.drafted)) for r in records if isinstance(r, Step)]


def interleaved(cases, controller: AdaptiveK, n: int = 160) -> list[list[tuple[int, int]]]:
    """The cases generated at once, one record of each in turn (as a server's lanes take turns), on one controller."""
    gens = [
        engine(case, controller).generate(np.asarray(case[0], np.int32), GenerationConfig(max_tokens=n))
        for case in cases
    ]
    out: list[list] = [[] for _ in cases]
    live = set(range(len(cases)))
    while live:
        for i in sorted(live):
            record = next(gens[i], None)
            if record is None:
                live.discard(i)
            else:
                out[i].append(record)
    return [schedule(records) for records in out]


def test_sequences_at_once_each_get_the_schedule_they_get_alone():
    cases = [copying(1), free_text(2)]
    alone = [interleaved([case], AdaptiveK(curve=CURVE))[0] for case in cases]
    assert max(k for k, _ in alone[0]) > 8 and max(n for _, n in alone[1][8:]) <= 2  # different acceptance, K
    together = interleaved(cases, AdaptiveK(curve=CURVE))
    assert together == alone


def test_the_next_reply_of_any_sequence_starts_from_what_the_others_learnt():
    shared = AdaptiveK(curve=CURVE)
    interleaved([copying(1)], shared)  # one lane's reply
    steps_before = shared.model.steps
    assert steps_before > 0 and "prompt" in shared.snapshot()["by_source"]
    again = interleaved([copying(3)], shared)[0]  # another lane (a new engine): it starts from that learning
    fresh = interleaved([copying(3)], AdaptiveK(curve=CURVE))[0]
    assert again != fresh and shared.model.steps > steps_before


class InPlace(AdaptiveK):
    """The controller itself as its only sequence: learning in place, as before sequences."""

    def sequence(self) -> AdaptiveK:
        return self


def test_one_sequence_decides_as_the_controller_in_place():
    # the CLI's one sequence (a chat's engine, two turns): the same schedules and the same learning
    runs = []
    for controller in (AdaptiveK(curve=CURVE), InPlace(curve=CURVE)):
        e = engine(copying(1), controller)
        turns = [
            schedule(e.generate(np.asarray(case[0], np.int32), GenerationConfig(max_tokens=120)))
            for case in (copying(1), copying(1))
        ]
        runs.append((turns, controller.state(), controller.snapshot()["k"]))
    assert runs[0] == runs[1]


def two_conversations(seed: int):
    """Prompt A, after which the target counts up through tokens no prompt holds (nothing to look up: a greeting),
    prompt B, which it copies (one token in 20 changed), and the target."""
    prompt_a = [int(t) for t in np.random.default_rng(seed).integers(2, 30, 40)]
    prompt_b, copy = copying(seed)

    def fn(prefix):
        if list(prefix[: len(prompt_b)]) == prompt_b:
            return copy(prefix)
        logits = np.zeros(VOCAB, np.float32)
        logits[40 + (len(prefix) - len(prompt_a)) % 20] = 5.0
        return logits

    return prompt_a, prompt_b, fn


def test_a_lane_s_next_conversation_schedules_as_a_fresh_lane_would():
    # A server's lane after an unrelated request: a greeting's empty lookups left the probe schedule just reset, so the
    # next conversation on that lane drafted nothing for probe_every steps (four chats at once: 16 plain passes where a
    # fresh lane made 5)
    prompt_a, prompt_b, fn = two_conversations(1)
    steep = VerifyCurve(ms=tuple(20.0 + 55.0 * b for b in range(1, 66)))  # the prior's best K is 0 here: probes
    runs = []
    for same_lane in (True, False):
        shared, clock = AdaptiveK(curve=steep), Clock()
        target = FakeBackend(fn, n_ctx=1024, n_batch=128, vocab=VOCAB, clock=clock, cost=steep.at)
        drafter = AutoDrafter(SuffixDrafter(None))
        lane = SpeculativeEngine(target, drafter, shared, clock=clock, curve=steep)
        list(lane.generate(np.asarray(prompt_a, np.int32), GenerationConfig(max_tokens=8)))
        if not same_lane:  # the same learning, drafter and KV cache: only the sequence is new
            lane = SpeculativeEngine(target, drafter, shared, clock=clock, curve=steep)
        runs.append(schedule(lane.generate(np.asarray(prompt_b, np.int32), GenerationConfig(max_tokens=120))))
    assert max(n for _, n in runs[1][:8]) > 0  # a fresh lane drafts within its first steps
    assert runs[0] == runs[1]


def test_a_conversation_s_next_turn_keeps_its_sequence():
    prompt_a, prompt_b, fn = two_conversations(1)
    e = engine((prompt_b, fn), AdaptiveK(curve=CURVE))
    list(e.generate(np.asarray(prompt_b, np.int32), GenerationConfig(max_tokens=40)))
    first = e.sequence
    turn = prompt_b + [5, 6, 7]  # the next turn: the last prompt, the reply and a new message
    list(e.generate(np.asarray(turn, np.int32), GenerationConfig(max_tokens=20)))
    assert e.sequence is first
    list(e.generate(np.asarray(prompt_a, np.int32), GenerationConfig(max_tokens=20)))
    assert e.sequence is not first  # another conversation: a sequence of its own
