"""The speculative engine on the fake backend, where greedy equivalence with plain decoding is exact."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fakes import CHARS, EOS, Clock, EstimatingK, FakeBackend, bigram_logits, greedy_reference, hashed_logits, word
from specdec_cli.core.controller import FixedK
from specdec_cli.core.draft import Draft, DrafterBase
from specdec_cli.core.engine import GenerationConfig, Rows, SpeculativeEngine
from specdec_cli.core.records import ACCEPTED, REJECTED, TARGET, Finish, FinishReason, Prefill, Source, Step
from specdec_cli.core.stats import summarize
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.errors import ContextOverflowError, UsageError

PROMPT = [5, 9, 3, 17, 4, 22, 8]


def run(engine, prompt=PROMPT, **cfg):
    records = list(engine.generate(prompt, GenerationConfig(**cfg)))
    steps = [r for r in records if isinstance(r, Step)]
    assert isinstance(records[-1], Finish)  # every completed generation ends with its Finish record
    return records, steps, [t for s in steps for t in s.emitted]


def finish_reason(records):
    return records[-1].finish_reason


def noisy(fn, seed=1, flip_every=3):
    """A draft model that agrees with `fn` except at some prefixes (a deterministic 'worse' model)."""

    def draft_fn(prefix):
        logits = np.array(fn(prefix))
        if (sum(prefix) * 7 + len(prefix) * seed) % flip_every == 0:
            logits[int(np.argmax(logits))] -= 100.0
        return logits

    return draft_fn


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("flip_every", [2, 3, 5])
def test_greedy_speculative_output_equals_plain_decoding(k, flip_every):
    reference = greedy_reference(hashed_logits, PROMPT, 40)
    target = FakeBackend(hashed_logits)
    drafter = ModelDrafter(FakeBackend(noisy(hashed_logits, flip_every=flip_every)))
    _, steps, tokens = run(SpeculativeEngine(target, drafter, FixedK(k)), max_tokens=40)
    assert tokens == reference
    # The draft disagreed sometimes, so this really exercised rejection and rollback.
    assert any(s.n_accepted < len(s.drafted) for s in steps)
    assert any(s.n_accepted == len(s.drafted) > 0 for s in steps)


def test_plain_decoding_through_engine_equals_reference():
    target = FakeBackend(hashed_logits)
    _, steps, tokens = run(SpeculativeEngine(target, None), max_tokens=30)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 30)
    assert all(s.k == 0 and s.drafted == () for s in steps)
    assert len(steps) == len(tokens)  # one target pass per token


def test_draft_equal_to_target_accepts_every_draft_token():
    target = FakeBackend(hashed_logits)
    drafter = ModelDrafter(FakeBackend(hashed_logits))
    records, steps, tokens = run(SpeculativeEngine(target, drafter, FixedK(5)), max_tokens=41)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 41)
    for s in steps[:-1]:
        assert s.n_accepted == len(s.drafted) == 5
        assert s.segments[-1][0] == TARGET  # the bonus token
    stats = summarize(records)
    assert stats.acceptance_rate == 1.0
    # 41 tokens = 6 per pass (5 accepted + 1 bonus): 7 passes, the last one cut by max_tokens
    assert stats.n_target_passes == 7


def test_target_cache_holds_exactly_the_committed_tokens_after_every_step():
    target = FakeBackend(hashed_logits)
    drafter = ModelDrafter(FakeBackend(noisy(hashed_logits)))
    engine = SpeculativeEngine(target, drafter, FixedK(4))
    committed = list(PROMPT)
    for rec in engine.generate(PROMPT, GenerationConfig(max_tokens=30)):
        if isinstance(rec, Prefill):
            assert list(target.tokens) == PROMPT[:-1]
        elif isinstance(rec, Step):
            committed += rec.emitted
            # all but the newest committed token are in the cache; nothing rejected remains
            assert list(target.tokens) == committed[:-1]


def test_rollback_truncates_to_context_plus_accepted():
    target = FakeBackend(hashed_logits)
    drafter = ModelDrafter(FakeBackend(noisy(hashed_logits, flip_every=5)))
    engine = SpeculativeEngine(target, drafter, FixedK(4))
    n = len(PROMPT)  # committed tokens before the step
    kinds = set()
    for rec in engine.generate(PROMPT, GenerationConfig(max_tokens=40)):
        if isinstance(rec, Step):
            # after verifying [last, d1..dk] the cache was cut to n + n_accepted tokens: the committed context and
            # the accepted drafts, nothing rejected (also when every draft was accepted: nothing to cut, same length)
            assert target.truncations[-1] == n + rec.n_accepted and len(target.tokens) == n + rec.n_accepted
            kinds.add("rejected" if rec.rejected else "all accepted" if rec.n_accepted == len(rec.drafted) > 0 else "")
            n += len(rec.emitted)
    assert {"all accepted", "rejected"} <= kinds  # both kinds of step were checked


def test_draft_model_catches_up_when_all_drafts_are_accepted():
    # draft = target: every draft is accepted. The draft model then never evaluated d_K (it was proposed from the
    # logits after d_(K-1)) nor the bonus token: the next propose must evaluate exactly those two, in one batch with
    # the first draft, so that it drafts from the whole committed context.
    class Spy(ModelDrafter):
        def propose(self, context, k, sampling, rng):
            before = self.backend.n_evaluated
            draft = super().propose(context, k, sampling, rng)
            calls.append(
                (
                    list(context),
                    list(self.backend.tokens[: len(context)]),
                    self.backend.n_evaluated - before,
                    len(draft),
                )
            )
            return draft

    calls = []
    engine = SpeculativeEngine(FakeBackend(hashed_logits), Spy(FakeBackend(hashed_logits)), FixedK(3))
    _, steps, tokens = run(engine, max_tokens=20)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 20)
    assert len(calls) == len(steps) >= 4 and all(s.n_accepted == len(s.drafted) == 3 for s in steps[:-1])
    for i, (context, held, evaluated, drafted) in enumerate(calls):
        assert held == context  # the draft model drafted from exactly the committed context
        # the first call catches up on the prompt's last token (begin evaluated the rest); later ones on d_K and the
        # bonus token of the all-accepted step before; then k - 1 tokens to draft k
        assert evaluated == (1 if i == 0 else 2) + drafted - 1


def test_eog_ends_generation_and_is_not_emitted():
    def fn(prefix):
        logits = np.zeros(32, np.float32)
        logits[EOS if len(prefix) >= len(PROMPT) + 5 else 7] = 9.0
        return logits

    records, steps, tokens = run(
        SpeculativeEngine(FakeBackend(fn), ModelDrafter(FakeBackend(fn)), FixedK(3)), max_tokens=50
    )
    assert tokens == [7] * 5
    assert finish_reason(records) == "eog"
    assert EOS not in tokens


def test_max_tokens_is_exact_even_mid_draft():
    records, steps, tokens = run(
        SpeculativeEngine(FakeBackend(), ModelDrafter(FakeBackend()), FixedK(6)), max_tokens=10
    )
    assert len(tokens) == 10
    assert finish_reason(records) == "length"


def test_finish_reasons_and_sources_are_their_types_and_serialise_as_before():
    """The engine's finish reason is a `FinishReason` and every step's draft source a `Source` (`Source.none` for a
    plain step); both StrEnums, so --json and the server still see "length", "eog", "" and "draft"."""
    records, steps, _ = run(SpeculativeEngine(FakeBackend(), ModelDrafter(FakeBackend()), FixedK(6)), max_tokens=10)
    assert finish_reason(records) is FinishReason.length and summarize(records).finish_reason is FinishReason.length
    assert json.dumps({"finish_reason": finish_reason(records)}) == '{"finish_reason": "length"}'
    assert {type(s.source) for s in steps} == {Source} and steps[0].source == "draft"
    _, plain, _ = run(SpeculativeEngine(FakeBackend(), None), max_tokens=3)
    assert [s.source for s in plain] == [Source.none] * 3 and json.dumps(plain[0].source) == '""'
    assert {type(s.source) for s in plain} == {type(s.branch_source) for s in plain} == {Source}


def test_stop_string_cuts_output_and_nothing_after_it_is_emitted():
    reference = greedy_reference(hashed_logits, PROMPT, 30)
    words = [f"w{t} " for t in reference]
    stop = words[6] + words[7].strip()  # spans two tokens
    expected_text = "".join(words[:6])
    records, steps, tokens = run(
        SpeculativeEngine(FakeBackend(), ModelDrafter(FakeBackend(noisy(hashed_logits))), FixedK(4)),
        max_tokens=30,
        stop=(stop,),
    )
    text = "".join(s.text for s in steps)
    assert text == expected_text
    assert finish_reason(records) == "stop"
    assert tokens == reference[:8]  # the tokens that completed the stop string, and none after


def test_rejected_drafts_are_shown_between_accepted_and_correction():
    # A 30-token vocabulary has no token that renders half a character, so every pushed token is one segment.
    def fn(prefix):
        return hashed_logits(prefix, vocab=30)

    def noisy30(prefix):
        return noisy(fn, flip_every=2)(prefix)

    _, steps, _ = run(
        SpeculativeEngine(FakeBackend(fn, vocab=30), ModelDrafter(FakeBackend(noisy30, vocab=30)), FixedK(4)),
        max_tokens=30,
    )
    rejected = [s for s in steps if s.rejected]
    assert len(rejected) >= 3
    for s in rejected:
        n = s.n_accepted
        assert [kind for kind, _ in s.segments] == [ACCEPTED] * n + [REJECTED, TARGET]
        assert [t for _, t in s.segments[:n]] == [word(t).decode() for t in s.drafted[:n]]
        assert s.segments[n][1] == b"".join(word(t) for t in s.drafted[n:]).decode()  # all of the rejected drafts
        assert s.segments[n + 1][1] == word(s.target_token).decode()  # the correction
        assert s.text == "".join(word(t).decode() for t in s.emitted)  # rejected drafts are never output text


def test_a_verify_batch_never_exceeds_one_llama_batch():
    # n_batch 4: a K = 8 draft would need 9 logits rows in one decode call, which llama.cpp (and the fake) refuse.
    target = FakeBackend(hashed_logits, n_batch=4)
    _, steps, tokens = run(
        SpeculativeEngine(target, ModelDrafter(FakeBackend(hashed_logits)), FixedK(8)), max_tokens=20
    )
    assert tokens == greedy_reference(hashed_logits, PROMPT, 20)
    assert max(len(s.drafted) for s in steps) == 3 and target.max_logit_rows == 4


def test_the_fake_backend_refuses_what_llama_cpp_refuses():
    fake = FakeBackend(n_batch=4)
    with pytest.raises(ValueError, match="negative"):
        fake.truncate(-1)
    with pytest.raises(ValueError, match="n_batch 4"):
        fake.decode([2, 3, 4, 5, 6], n_logits=5)


def test_closing_the_generator_mid_stream_leaves_only_committed_tokens_cached():
    target = FakeBackend(hashed_logits)
    engine = SpeculativeEngine(target, ModelDrafter(FakeBackend(noisy(hashed_logits))), FixedK(4))
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=50))
    committed = list(PROMPT)
    for rec in gen:
        if isinstance(rec, Step):
            committed += rec.emitted
            if rec.index == 3:
                break
    gen.close()
    assert list(target.tokens) == committed[: len(target.tokens)]
    assert len(target.tokens) == len(committed) - 1


def test_second_generation_reuses_the_cached_prefix():
    target = FakeBackend(hashed_logits)
    engine = SpeculativeEngine(target, None)
    first = list(engine.generate(PROMPT, GenerationConfig(max_tokens=5)))
    assert first[0].n_evaluated == len(PROMPT) - 1
    longer = PROMPT + [11, 12, 13]
    second = list(engine.generate(longer, GenerationConfig(max_tokens=5)))
    assert second[0].n_prompt == len(longer)
    # only the new tokens, less the last one, which is evaluated with the first step's verify batch
    assert second[0].n_evaluated == 2


def test_empty_prompt_and_context_overflow_are_clear_errors():
    from specdec_cli.driver import stream

    engine = SpeculativeEngine(FakeBackend(n_ctx=16), None)
    with pytest.raises(UsageError):
        stream(engine, [], GenerationConfig())
    with pytest.raises(ContextOverflowError, match="20 tokens"):
        stream(engine, list(range(2, 22)), GenerationConfig())


def test_context_fills_up_gracefully():
    target = FakeBackend(hashed_logits, n_ctx=20)
    records, steps, tokens = run(
        SpeculativeEngine(target, ModelDrafter(FakeBackend(hashed_logits, n_ctx=20)), FixedK(4)), max_tokens=100
    )
    assert finish_reason(records) == "context"
    assert tokens == greedy_reference(hashed_logits, PROMPT, len(tokens))
    assert len(PROMPT) + len(tokens) <= 21


def test_logits_are_requested_only_for_verified_rows():
    target = FakeBackend(hashed_logits)
    run(SpeculativeEngine(target, ModelDrafter(FakeBackend()), FixedK(6)), max_tokens=20)
    assert target.max_logit_rows == 7  # K + 1, never the whole context


class Never(DrafterBase):
    """A drafter that never finds anything to propose (every hook is the base class's no-op)."""

    name = "never"


def test_drafter_proposing_fewer_tokens_is_a_plain_step():
    _, steps, tokens = run(SpeculativeEngine(FakeBackend(), Never(), FixedK(4)), max_tokens=10)
    assert tokens == greedy_reference(hashed_logits, PROMPT, 10)
    assert all(s.drafted == () and s.batch_size == 1 for s in steps)


def test_ngram_drafter_on_a_repetitive_target_accepts_long_drafts():
    # The bigram model cycles through a pattern; after one cycle, prompt lookup predicts it exactly.
    prompt = [2, 3, 4]
    _, steps, tokens = run(
        SpeculativeEngine(FakeBackend(bigram_logits), NgramDrafter(1, 3), FixedK(8)), prompt, max_tokens=80
    )
    assert tokens == greedy_reference(bigram_logits, prompt, 80)
    pos, late = 0, []
    for s in steps:
        if pos > 28 and s.drafted:  # after two cycles of the 14-token pattern
            late.append(s)
        pos += len(s.emitted)
    assert len(late) >= 4 and all(s.n_accepted == len(s.drafted) == 8 for s in late[:-1])


def test_a_verify_batch_answered_with_its_first_rows_only_cuts_the_draft_there():
    """Beside other sequences a server may evaluate a verify batch's first rows only (`Rows.expected`): the step
    verifies the draft cut there, the cache holds only what was committed, the output stays greedy."""
    backend, prompt = FakeBackend(bigram_logits), [2, 3, 4]
    engine = SpeculativeEngine(backend, NgramDrafter(1, 3), EstimatingK(8))
    engine.passes = backend  # (as the server's slot: `SpeculativeEngine.passes`)
    gen, answer, steps, cut = engine.steps(prompt, GenerationConfig(max_tokens=80)), None, [], 0
    while True:
        try:
            item = gen.send(answer)
        except StopIteration:
            break
        answer = None
        if isinstance(item, Rows) and item.n_logits > 3:
            assert item.expected is not None and len(item.expected) == len(item.tokens)
            cut += 1
            answer = backend.decode(item.tokens[:3], n_logits=3)  # two drafts of it evaluated, as `meet` may cut
        elif isinstance(item, Rows):
            answer = item.evaluate(backend)
        elif isinstance(item, Step):
            steps.append(item)
            if item.target_token is not None:  # (not cut by the token budget)
                assert len(backend.tokens) == len(prompt) + sum(len(s.emitted) for s in steps) - 1
    assert cut >= 4 and all(len(s.drafted) <= 2 for s in steps)
    assert [t for s in steps for t in s.emitted] == greedy_reference(bigram_logits, prompt, 80)


def test_the_controller_trims_lookup_drafts_and_the_steps_record_what_was_verified():
    class TrimToTwo(FixedK):
        def __init__(self):
            super().__init__(8)
            self.seen = []

        def trim(self, draft):
            self.seen.append((len(draft), draft.match_len))
            return min(2, len(draft))

    prompt = [2, 3, 4]
    ctrl = TrimToTwo()
    _, steps, tokens = run(
        SpeculativeEngine(FakeBackend(bigram_logits), NgramDrafter(1, 3), ctrl), prompt, max_tokens=60
    )
    assert tokens == greedy_reference(bigram_logits, prompt, 60)  # trimming never changes greedy output
    assert any(n == 8 and m >= 3 for n, m in ctrl.seen)  # asked with the full draft and its evidence
    assert all(len(s.drafted) <= 2 for s in steps)
    assert all(s.k == len(s.drafted) for s in steps if s.drafted)  # the step records the K verified


def test_an_empty_draft_after_an_ask_for_everything_is_recorded_as_a_plain_step():
    class AsksAll(FixedK):
        asked_all = True  # like AdaptiveK asking a free lookup drafter for up to 64 tokens

    _, steps, _ = run(SpeculativeEngine(FakeBackend(), Never(), AsksAll(64)), max_tokens=12)
    assert all(s.k == 0 for s in steps)  # "K chosen" must not show K = 64 for steps that verified nothing
    _, steps, _ = run(SpeculativeEngine(FakeBackend(), Never(), FixedK(4)), max_tokens=12)
    assert all(s.k == 4 for s in steps[:6])  # a fixed K asked for 4: the drafter's shortfall stays visible


@pytest.mark.parametrize("max_tokens, stored", [(50, [7] * 5 + [EOS]), (3, [7] * 3)])
def test_a_learning_drafter_is_given_the_output_and_the_end_of_generation_token_that_ended_it(max_tokens, stored):
    def fn(prefix):
        logits = np.zeros(32, np.float32)
        logits[EOS if len(prefix) >= len(PROMPT) + 5 else 7] = 9.0
        return logits

    class Recorder(Never):
        def finish(self, prompt, output):
            self.finished = (list(prompt), list(output))

    drafter = Recorder()
    _, steps, tokens = run(SpeculativeEngine(FakeBackend(fn), drafter, FixedK(3)), max_tokens=max_tokens)
    assert drafter.finished == (list(PROMPT), stored)  # a reply cut by --max-tokens has no end to learn
    assert EOS not in tokens


# --- a second branch in the same pass --------------------------------------------------------------------------


class TwoCandidates(DrafterBase):
    """A lookup drafter with two candidates every step: the target's own greedy continuation (known from the
    reference) and a copy of it changed at one position; which comes first alternates, so either branch wins."""

    name = "two"

    def __init__(self, reference: list[int], prompt_len: int) -> None:
        self.reference, self.prompt_len, self.calls = reference, prompt_len, 0

    def lookup(self, context, k, sampling, rng):
        done = len(context) - self.prompt_len
        right = np.asarray(self.reference[done : done + min(k, 6)], dtype=np.int32)
        if len(right) < 2:
            return []
        wrong = right.copy()
        wrong[self.calls % len(wrong)] = (wrong[self.calls % len(wrong)] + 3) % 28 + 2  # differs at one position
        self.calls += 1
        pair = [Draft(tokens=right, source="prompt", match_len=9), Draft(tokens=wrong, source="store", match_len=9)]
        return pair if self.calls % 2 else pair[::-1]


class AlwaysBranch(FixedK):
    """K = 6, and the other draft as a second branch whenever there is one."""

    def choose(self, drafts, has_model, k):
        return (len(drafts[0]), drafts[0]) if drafts else (0, None)

    def branch(self, draft, drafts, room):
        return drafts[0] if drafts else None


def test_two_branch_verification_returns_exactly_plain_greedy_decoding():
    reference = greedy_reference(hashed_logits, PROMPT, 60)
    target = FakeBackend(hashed_logits)
    engine = SpeculativeEngine(target, TwoCandidates(reference, len(PROMPT)), AlwaysBranch(6))
    _, steps, tokens = run(engine, max_tokens=60)
    assert tokens == reference
    branched = [s for s in steps if s.branch]
    assert target.branch_passes == len(branched) > 5
    assert any(s.branch_won for s in branched) and any(not s.branch_won for s in branched)
    assert all(s.batch_size == 1 + len(s.drafted) + len(s.branch) - _shared(s.drafted, s.branch) for s in branched)
    assert list(target.tokens) == [*PROMPT, *reference][: len(target.tokens)]  # only committed tokens cached


def _shared(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_branch_pass_scores_each_branch_as_a_one_branch_pass_would():
    from specdec_cli.models.backend import branch_rows

    target = FakeBackend(hashed_logits)
    target.decode(PROMPT[:-1])
    a, b = np.array([3, 4, 5, 6], np.int32), np.array([3, 4, 9, 2, 7], np.int32)
    logits = target.decode_branches([PROMPT[-1], *a], b).copy()
    rows_a, rows_b = branch_rows(a, b)
    assert logits.shape[0] == 1 + 4 + 3 and rows_b.tolist() == [0, 1, 2, 5, 6, 7]
    target.truncate(len(PROMPT) + 2, branch=True)  # keep the branch's first two tokens (shared with a anyway)
    assert list(target.tokens) == [*PROMPT, 3, 4]
    for branch, rows in ((a, rows_a), (b, rows_b)):
        alone = FakeBackend(hashed_logits)
        alone.decode(PROMPT[:-1])
        np.testing.assert_array_equal(logits[rows], alone.decode([PROMPT[-1], *branch], n_logits=len(branch) + 1))


def test_past_the_line_time_the_output_ends_after_the_next_newline_and_not_before():
    """llama-server's t_max_predict_ms (`GenerationConfig.line_time_ms`): lines of "ab" then a newline, 100 ms a
    pass, plain decoding: a newline before the limit does not end the reply, the first one after it does (and the rest
    of a speculative step after it is dropped); without a limit the reply runs to max_tokens."""
    line = [ord("a"), ord("b"), 10]

    def lines(prefix):
        logits = np.zeros(len(CHARS), np.float32)
        logits[line[len(prefix) % 3]] = 5.0
        return logits

    def engine(k):
        clock = Clock()
        target = FakeBackend(lines, vocab=len(CHARS), pieces=CHARS, clock=clock, cost=lambda b: 100.0)
        drafter = ModelDrafter(FakeBackend(lines, vocab=len(CHARS), pieces=CHARS)) if k else None
        return SpeculativeEngine(target, drafter, FixedK(k), clock=clock)

    prompt = [ord("a"), ord("b"), 10]  # the next line starts at a multiple of 3
    records, steps, tokens = run(engine(0), prompt, max_tokens=30, line_time_ms=450)
    text = bytes(CHARS[t][0] for t in tokens).decode()
    # passes end at 100, 200, ... ms after the prefill: the newline of 300 ms is early, the one of 600 ms ends it
    assert text == "ab\nab\n" and finish_reason(records) == "length"
    _, _, unlimited = run(engine(0), prompt, max_tokens=30)
    assert len(unlimited) == 30
    records, steps, tokens = run(engine(8), prompt, max_tokens=30, line_time_ms=50)
    # the first pass (100 ms) accepts 8 drafts and a bonus token: cut after its first newline
    assert bytes(CHARS[t][0] for t in tokens).decode() == "ab\n" and len(steps) == 1
