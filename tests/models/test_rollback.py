"""Recurrent and hybrid targets on the fake backend: rollback by llama.cpp's snapshots or by a checkpoint and a
replay, and the guard (`rollback.RecurrentGuard`) that keeps every other trim from reaching llama.cpp partially.

`FakeBackend(recurrent=...)` follows llama.cpp b11312's rules, including its silent corruption: a partial trim of a
token the last decode call did not hold returns success and poisons every later logits row, so an output built on
it differs from plain greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeBackend, greedy_reference, hashed_logits, noisy
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.models.backend import sync
from specdec_cli.stores.prompt_cache import PromptCache

PROMPT = [5, 9, 3, 17, 4, 22, 8]


def generate(engine, prompt=PROMPT, max_tokens=40):
    records = list(engine.generate(prompt, GenerationConfig(max_tokens=max_tokens)))
    steps = [r for r in records if isinstance(r, Step)]
    return records, steps, [t for s in steps for t in s.emitted]


@pytest.mark.parametrize("mode", ["snapshots", "checkpoints"])
def test_speculative_greedy_output_on_a_recurrent_target_equals_plain_decoding(mode):
    target = FakeBackend(hashed_logits, recurrent=mode, n_rs_seq=4)
    engine = SpeculativeEngine(target, ModelDrafter(FakeBackend(noisy(hashed_logits))), FixedK(4))
    _, steps, tokens = generate(engine)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 40)
    assert any(s.n_accepted < len(s.drafted) for s in steps)  # rollbacks really happened
    assert target.n_poisoned == 0 and target.n_cleared == 0
    if mode == "snapshots":
        assert target.n_snapshot_rollbacks > 0 and target.n_checkpoint_rollbacks == 0
    else:
        assert target.n_checkpoint_rollbacks > 0


def test_a_draft_is_never_longer_than_the_granted_snapshots():
    # the controller asks for 8, llama.cpp granted 3 snapshots: every pass carries at most 3 drafts, so every
    # rollback is a snapshot's (no checkpoint needed) and the output is plain greedy decoding's
    target = FakeBackend(hashed_logits, recurrent="snapshots", n_rs_seq=3)
    engine = SpeculativeEngine(target, ModelDrafter(FakeBackend(noisy(hashed_logits, flip_every=5))), FixedK(8))
    _, steps, tokens = generate(engine)
    assert target.draft_limit == 3
    assert max(len(s.drafted) for s in steps) == 3
    assert target.n_checkpoint_rollbacks == 0 and target.n_snapshot_rollbacks > 0
    assert tokens == greedy_reference(hashed_logits, PROMPT, 40)


def test_no_partial_trim_of_a_recurrent_state_outside_a_verify_pass():
    # a second prompt that leaves the cached history 3 tokens back: those tokens came from three earlier passes, so
    # no snapshot holds the state before them; the guard clears the sequence and the prompt is evaluated again
    target = FakeBackend(hashed_logits, recurrent="snapshots", n_rs_seq=4)
    engine = SpeculativeEngine(target, None)
    generate(engine, max_tokens=10)
    held = [int(t) for t in target.tokens]
    prompt = held[:-3] + [11, 12]
    _, _, tokens = generate(engine, prompt, max_tokens=20)
    assert target.n_poisoned == 0
    assert tokens == greedy_reference(hashed_logits, prompt, 20)
    assert target.n_cleared == 1


def test_a_rollback_inside_the_last_pass_is_a_snapshot_and_only_once():
    target = FakeBackend(hashed_logits, recurrent="snapshots", n_rs_seq=4)
    target.decode(PROMPT, n_logits=1)
    target.decode([7, 8, 9, 10], n_logits=4)
    target.truncate(len(PROMPT) + 2)  # two of the pass's own tokens: a snapshot
    assert target.n_snapshot_rollbacks == 1 and len(target.tokens) == len(PROMPT) + 2
    target.truncate(len(PROMPT) + 1)  # a second rollback of the same pass: not by a snapshot, never partially
    assert target.n_poisoned == 0 and target.n_snapshot_rollbacks == 1 and target.n_cleared == 1
    sync(target, np.asarray(PROMPT + [7], np.int32))
    np.testing.assert_array_equal(target.decode([8], n_logits=1)[0], hashed_logits(PROMPT + [7, 8]))


def test_checkpoint_and_replay_restores_exactly():
    # no snapshots (a Mamba-2): a checkpoint before the verify pass, restored, then the kept tokens evaluated again;
    # the next logits are exactly those of a cache that never saw the rejected tokens
    target = FakeBackend(hashed_logits, recurrent="checkpoints")
    target.decode(PROMPT, n_logits=1)
    target.decode([7, 8, 9, 10, 11], n_logits=5)
    target.truncate(len(PROMPT) + 2)
    assert [int(t) for t in target.tokens] == PROMPT + [7, 8]
    assert target.n_checkpoint_rollbacks == 1 and target.n_cleared == 0 and target.n_poisoned == 0
    np.testing.assert_array_equal(target.decode([13], n_logits=1)[0], hashed_logits(PROMPT + [7, 8, 13]))


def test_sync_of_a_changed_history_on_a_recurrent_backend_gives_a_fresh_prefills_logits():
    # a chat's next turn whose re-tokenized history differs 4 tokens back (earlier turns were decoded one by one)
    target = FakeBackend(hashed_logits, recurrent="snapshots", n_rs_seq=4)
    history = PROMPT + [20, 21, 22, 23, 24, 25]
    sync(target, np.asarray(PROMPT, np.int32))
    for t in history[len(PROMPT) :]:
        target.decode([t], n_logits=1)
    changed = np.asarray(history[:-4] + [26, 27, 28], np.int32)
    sync(target, changed[:-1])
    assert [int(t) for t in target.tokens] == changed[:-1].tolist()
    np.testing.assert_array_equal(target.decode(changed[-1:], n_logits=1)[0], hashed_logits(changed.tolist()))
    assert target.n_poisoned == 0


def test_the_prompt_cache_of_a_recurrent_backend_restores_whole_states_only_and_writes_one_entry(tmp_path):
    model = tmp_path / "hybrid.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    cache = PromptCache(tmp_path / "prompts", min_tokens=4)
    prompt = list(range(2, 30))
    firsts = []
    for _ in range(3):  # three runs, each a new process with a cold backend
        target = FakeBackend(hashed_logits, recurrent="snapshots", path=str(model))
        engine = SpeculativeEngine(target, None, prompt_cache=cache)
        records, _, tokens = generate(engine, prompt, max_tokens=6)
        engine.save_prompt()
        firsts.append(records[0])
        assert tokens == greedy_reference(hashed_logits, prompt, 6)
        assert target.n_cleared == 0 and target.n_poisoned == 0  # nothing was loaded then trimmed
    assert firsts[0].n_restored == 0 and firsts[1].n_restored == firsts[2].n_restored == len(prompt) - 1
    assert len(cache.stats().entries) == 1  # the prompt's state, saved once
    # a prompt sharing only part of the saved state: not restored (a recurrent state cannot be cut)
    target = FakeBackend(hashed_logits, recurrent="snapshots", path=str(model))
    shorter = prompt[:20] + [3, 3]
    records, _, tokens = generate(SpeculativeEngine(target, None, prompt_cache=cache), shorter, max_tokens=6)
    assert records[0].n_restored == 0 and target.n_loads == 0 and target.n_cleared == 0
    assert tokens == greedy_reference(hashed_logits, shorter, 6)


def test_a_checkpoint_rollback_is_timed_as_part_of_its_step_and_priced_by_the_cost_model():
    # a virtual clock: a pass over b tokens costs 10 + b ms, so the replay of the kept tokens after a partial
    # acceptance (the pending token and the accepted drafts) shows in the step as rollback_ms
    from fakes import Clock
    from specdec_cli.core.cost_model import CostModel

    clock = Clock()
    target = FakeBackend(hashed_logits, recurrent="checkpoints", clock=clock, cost=lambda b: 10.0 + b)
    engine = SpeculativeEngine(target, ModelDrafter(FakeBackend(noisy(hashed_logits))), FixedK(4), clock=clock)
    _, steps, tokens = generate(engine)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 40)
    rolled = [s for s in steps if s.n_accepted < len(s.drafted)]
    assert rolled and all(s.rollback_ms == pytest.approx(10.0 + s.n_accepted + 1) for s in rolled)
    assert all(s.rollback_ms == 0.0 for s in steps if s.n_accepted == len(s.drafted))
    model = CostModel()
    step = rolled[0]
    model.observe(step)
    assert model.points[step.batch_size].ms == pytest.approx(step.verify_ms + step.rollback_ms)
