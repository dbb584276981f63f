"""A seeded sampled generation is drafter-invariant: the token at each position is drawn from the target's distribution
there with noise keyed by (seed, position, token), so speculative and plain decoding give the same tokens for any
drafter and any K, and the output is still distributed as the target's (chi-square over many seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare, kstest

from fakes import FakeBackend, hashed_logits, noisy
from specdec_cli.core import sampling
from specdec_cli.core.controller import FixedK
from specdec_cli.core.draft import Draft, DrafterBase
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.sampling import SamplingParams, exponential, make_rng, process, sample_at
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.ngram import NgramDrafter

PROMPT = [5, 9, 3, 17, 4, 22, 8, 5, 9, 3, 17]


def markov(prefix) -> np.ndarray:
    """The fake target: one clear favourite after each token (a Markov chain), so outputs repeat and n-grams match."""
    return hashed_logits(prefix[-1:])


SEEDED = SamplingParams(temperature=0.8, top_k=8, top_p=0.97, min_p=0.0, seed=7)


def generate(drafter, k: int = 4, params: SamplingParams = SEEDED, max_tokens: int = 40, prompt=PROMPT, fn=markov):
    """(emitted tokens, steps) of one generation on the fake target."""
    engine = SpeculativeEngine(FakeBackend(fn), drafter, FixedK(k) if drafter is not None else None)
    steps = [
        r
        for r in engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, sampling=params))
        if isinstance(r, Step)
    ]
    return [t for s in steps for t in s.emitted], steps


class Copy(DrafterBase):
    """A lookup drafter that drafts a known continuation with every third draft's token at `flip` changed, and, with
    `branches`, also the unchanged copy as a second candidate, in alternating order (the engine verifies both in one
    pass)."""

    name = "copy"

    def __init__(self, reference: list[int], flip: int = 1, branches: bool = False) -> None:
        self.reference, self.flip, self.branches, self.calls = reference, flip, branches, 0

    def lookup(self, context, k, sampling, rng):
        done = len(context) - len(PROMPT)
        right = np.asarray(self.reference[done : done + k], dtype=np.int32)
        if len(right) == 0:
            return []
        wrong = right.copy()
        self.calls += 1
        if self.calls % 3 == 0:
            i = min(self.flip, len(wrong) - 1)
            wrong[i] = (wrong[i] + 5) % 28 + 2
        first = Draft(tokens=wrong, source="prompt", match_len=9)
        if not self.branches:
            return [first]
        pair = [first, Draft(tokens=right, source="store", match_len=9)]
        return pair if self.calls % 2 else pair[::-1]  # either branch is the first one


class TwoBranches(FixedK):
    """The first lookup draft, and the other one as a second branch of the same pass."""

    def choose(self, drafts, has_model, k):
        return (len(drafts[0]), drafts[0]) if drafts else (0, None)

    def branch(self, draft, drafts, room):
        return drafts[0] if drafts else None


DRAFTERS = {
    "ngram": lambda ref: NgramDrafter(),
    "lookup": lambda ref: Copy(ref),
    "noisy draft model": lambda ref: ModelDrafter(FakeBackend(noisy(markov, flip_every=2))),
    "draft model = target": lambda ref: ModelDrafter(FakeBackend(markov)),
}


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_seed_gives_plain_decodings_tokens_whatever_is_drafted(name, k):
    plain, _ = generate(None)
    tokens, steps = generate(DRAFTERS[name](plain), k)
    assert tokens == plain
    assert any(s.n_accepted > 0 for s in steps)  # drafts were really verified, accepted ...
    if name != "draft model = target":
        assert any(s.n_accepted < len(s.drafted) for s in steps)  # ... and rejected


def test_two_branches_in_one_pass_give_plain_decodings_tokens():
    plain, _ = generate(None, max_tokens=60)
    engine = SpeculativeEngine(FakeBackend(markov), Copy(plain, branches=True), TwoBranches(6))
    steps = [
        r for r in engine.generate(PROMPT, GenerationConfig(max_tokens=60, sampling=SEEDED)) if isinstance(r, Step)
    ]
    assert [t for s in steps for t in s.emitted] == plain
    assert any(s.branch and s.branch_won for s in steps) and any(s.branch and not s.branch_won for s in steps)


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted_under_a_seed():
    # the Gumbel coupling: q = p and the same noise, so the draft model draws what the target draws, every time
    _, steps = generate(ModelDrafter(FakeBackend(markov)), 5)
    assert all(s.n_accepted == len(s.drafted) == 5 for s in steps[:-1])


def test_different_seeds_give_different_outputs():
    outputs = {
        tuple(generate(None, params=SamplingParams(temperature=0.8, seed=s), max_tokens=20)[0]) for s in range(8)
    }
    assert len(outputs) == 8


def test_the_same_seed_in_a_new_engine_gives_the_same_output():
    assert generate(None)[0] == generate(None)[0]


# -- the keyed noise --------------------------------------------------------------------------------------------


def test_the_noise_of_a_token_depends_only_on_seed_position_and_token():
    ids = np.arange(5000)
    full = exponential(3, 17, ids)
    some = np.array([4321, 7, 0, 999])
    np.testing.assert_array_equal(exponential(3, 17, some), full[some])  # whichever other ids, in whatever order
    assert not np.array_equal(exponential(3, 18, ids), full)  # another position
    assert not np.array_equal(exponential(4, 17, ids), full)  # another seed
    assert kstest(full, "expon").pvalue > 1e-3  # standard exponential: -log of it is standard Gumbel
    # independent across positions and seeds: uncorrelated at the same token
    assert abs(np.corrcoef(full, exponential(3, 18, ids))[0, 1]) < 0.06
    assert abs(np.corrcoef(full, exponential(4, 17, ids))[0, 1]) < 0.06


def test_the_draw_at_a_position_ignores_the_candidates_order():
    p = process(
        np.array([1.0, 0.5, 2.0, -1.0, 0.3], np.float32), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    )
    order = np.random.default_rng(0).permutation(len(p.ids))
    shuffled = sampling.Dist(p.ids[order], p.probs[order])
    assert [sample_at(p, 5, i) for i in range(50)] == [sample_at(shuffled, 5, i) for i in range(50)]


def test_keyed_verification_accepts_exactly_the_tokens_plain_sampling_draws():
    rows = np.random.default_rng(1).normal(size=(4, 12)).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    plain = [sample_at(process(rows[i], params), 11, 30 + i) for i in range(4)]
    assert sampling.verify_keyed(np.array(plain[:3]), rows, params, 30) == (3, plain[3])  # all + the bonus
    wrong = (plain[1] + 1) % 12
    assert sampling.verify_keyed(np.array([plain[0], wrong, 0]), rows, params, 30) == (1, plain[1])
    with pytest.raises(ValueError, match="seed"):
        sampling.verify(Draft(), rows[:1], SamplingParams(temperature=1.0, seed=11), make_rng(0))


# -- still the target's distribution ------------------------------------------------------------------------------

TARGET_ROW = np.array([2.0, 1.5, 0.2, -0.5, 1.0, -3.0, 0.7, 0.1], dtype=np.float32)
FEW = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0)


def p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of `counts` against the probabilities `expected` (same shape); 0 when a token the target
    cannot emit was emitted."""
    if counts[expected == 0].any():
        return 0.0
    support = expected > 0
    return float(chisquare(counts[support], counts.sum() * expected[support]).pvalue)


def test_one_position_over_many_seeds_follows_the_target():
    p = process(TARGET_ROW, FEW)
    expected = np.zeros(len(TARGET_ROW))
    expected[p.ids] = p.probs
    counts = np.bincount([sample_at(p, seed, 12) for seed in range(6000)], minlength=len(TARGET_ROW))
    assert p_value(counts, expected) > 1e-3


def small(prefix) -> np.ndarray:
    """A toy target over 32 tokens that only ever emits tokens 2..5 (the same candidates at every position, where
    noise shared between positions would show), their odds shifted by the last token."""
    logits = np.full(32, -np.inf, dtype=np.float32)
    logits[2:6] = [1.0, 0.6, 0.3, 0.0]
    logits[2 + int(prefix[-1]) % 4] += 0.8
    return logits


def test_a_two_token_sequence_over_many_seeds_follows_the_target_speculative_or_not():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    prompt = [4]
    p0 = process(small(prompt), params)
    expected = np.zeros((32, 32))  # the joint p(t0) p(t1 | t0)
    for a, pa in zip(p0.ids, p0.probs, strict=True):
        p1 = process(small([*prompt, int(a)]), params)
        expected[a, p1.ids] = pa * p1.probs
    counts = np.zeros((32, 32))
    for seed in range(3000):
        s = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        drafter = ModelDrafter(FakeBackend(noisy(small, flip_every=2)))
        tokens, _ = generate(drafter, 2, params=s, max_tokens=2, prompt=prompt, fn=small)
        counts[tokens[0], tokens[1]] += 1
    assert p_value(counts.ravel(), expected.ravel()) > 1e-3
