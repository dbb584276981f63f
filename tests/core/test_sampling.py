"""Sampling and verification math: literal cases, a full-sort reference for `process`, and statistical tests that
the tokens speculative sampling emits follow the target's processed distribution (with broken variants of the
acceptance rule that the same statistical test must reject, so it is known to have power)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec_cli.core import sampling
from specdec_cli.core.draft import Draft
from specdec_cli.core.sampling import (
    GREEDY,
    Dist,
    SamplingParams,
    make_rng,
    process,
    sample,
    verify,
    verify_greedy,
    verify_stochastic,
)

PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def frozen(a) -> np.ndarray:
    """A read-only float32 copy, like a view into llama.cpp's logits buffer."""
    a = np.array(a, dtype=np.float32)
    a.setflags(write=False)
    return a


def dense(dist: Dist, vocab: int) -> np.ndarray:
    """A Dist as float64 [vocab]."""
    assert dist.ids.dtype == np.int32 and dist.probs.dtype == np.float64
    assert len(np.unique(dist.ids)) == len(dist.ids), "candidate ids must be distinct"
    assert abs(dist.probs.sum() - 1.0) < 1e-9
    out = np.zeros(vocab)
    out[dist.ids] = dist.probs
    return out


def reference(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, bool]:
    """Slow, obvious llama.cpp-order processing: full sort, then top-k → top-p → min-p → temperature.

    Returns (probs float64 [V], ambiguous): ambiguous when the top-p boundary is within float noise (process sums
    top-p's normaliser in float32 when top-k is off), where either answer is right.
    """
    vocab = len(logits)
    out = np.zeros(vocab)
    if params.temperature <= 0:
        out[np.argmax(logits)] = 1.0
        return out, False
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    ls = logits.astype(np.float64)[order]
    n = vocab if params.top_k <= 0 else min(params.top_k, vocab)
    ambiguous = False
    if params.top_p < 1.0:
        p = np.exp(ls[:n] - ls[0])
        p /= p.sum()
        cum = 0.0
        for i in range(n):
            cum += p[i]
            ambiguous |= abs(cum - params.top_p) < 1e-6
            if cum >= params.top_p:
                n = i + 1
                break
    if params.min_p > 0.0:
        threshold = ls[0] + math.log(min(params.min_p, 1.0))
        n = int(np.sum(ls[:n] >= threshold))
    z = np.exp((ls[:n] - ls[0]) / params.temperature)
    out[order[:n]] = z / z.sum()
    return out, ambiguous


# --- process: literal cases -------------------------------------------------------------------------------------

# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1, tokens in shuffled order
P4 = np.array([0.15, 0.5, 0.05, 0.3])
L4 = frozen(np.log(P4))


def check(params: SamplingParams, expected) -> None:
    before = L4.copy()
    got = dense(process(L4, params), 4)
    np.testing.assert_allclose(got, expected, atol=1e-7)
    np.testing.assert_array_equal(L4, before)


def test_process_untruncated_is_softmax():
    check(PLAIN, P4)


def test_process_top_k():
    check(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0), [0, 0.5 / 0.8, 0, 0.3 / 0.8])


def test_process_top_p_keeps_the_crossing_token():
    check(SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0), [0, 0.5 / 0.8, 0, 0.3 / 0.8])
    check(SamplingParams(temperature=1.0, top_k=0, top_p=0.85, min_p=0.0), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95])
    check(SamplingParams(temperature=1.0, top_k=0, top_p=0.0, min_p=0.0), [0, 1, 0, 0])


def test_process_min_p_is_relative_to_the_top_token():
    # threshold 0.25 × 0.5 = 0.125: keeps 0.5, 0.3, 0.15
    check(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25), [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95])
    check(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.55), [0, 0.5 / 0.8, 0, 0.3 / 0.8])
    check(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.7), [0, 1, 0, 0])


def test_process_temperature_reshapes_the_survivors():
    # T = 2 on log-probabilities: p ∝ sqrt(p)
    s = np.sqrt(P4)
    check(SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0), s / s.sum())


def test_process_combined_truncates_at_temperature_one():
    # top-k 3 → {0.5, 0.3, 0.15} renormalised /0.95: 0.526, 0.316, 0.158; top-p 0.8 crosses at the second token;
    # min-p 0.1 keeps both; T = 0.5 squares them: 0.25 : 0.09.
    check(SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1), [0, 0.25 / 0.34, 0, 0.09 / 0.34])
    # same, min-p 0.7 (0.3 < 0.7 × 0.5): only the top token
    check(SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.7), [0, 1, 0, 0])
    # top-p 0.85 keeps three tokens at temperature 1 (cum 0.526, 0.842, 1), but would keep two at T = 0.5
    squared = np.array([0.0225, 0.25, 0, 0.09]) / 0.3625
    check(SamplingParams(temperature=0.5, top_k=3, top_p=0.85, min_p=0.0), squared)
    check(SamplingParams(temperature=0.5, top_k=0, top_p=0.9, min_p=0.0), squared)  # cum 0.5, 0.8, 0.95


def test_process_temperature_zero_is_one_hot_argmax():
    d = process(L4, SamplingParams(temperature=0.0))
    assert d.ids.tolist() == [1] and d.probs.tolist() == [1.0]


def test_process_rejects_a_batch_of_rows():
    with pytest.raises(ValueError, match=r"shape \[V\]"):
        process(np.zeros((2, 4), np.float32), PLAIN)


def test_process_keeps_masked_tokens_out():
    d = process(frozen([0.0, -np.inf, 1.0, -np.inf]), SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0))
    assert set(d.ids.tolist()) <= {0, 2} and np.isfinite(d.probs).all()


# --- process: against the reference ------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([1, 2, 7, 60, 3000]),
    scale=st.sampled_from([0.003, 1.0, 6.0]),
    temperature=st.sampled_from([0.0, 1.0]) | st.floats(0.05, 3.0) | st.floats(0.05, 3.0),
    top_k=st.sampled_from([0, 1, 40, 10**6]) | st.integers(0, 80),
    top_p=st.sampled_from([1.0, 0.0]) | st.floats(0.0, 1.0) | st.floats(0.3, 0.99),
    min_p=st.sampled_from([0.0, 0.05, 1.0]) | st.floats(0.0, 1.0) | st.floats(0.0, 0.2),
)
def test_process_matches_full_sort_reference(seed, vocab, scale, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = frozen(np.random.default_rng(seed).standard_normal(vocab) * scale)
    expected, ambiguous = reference(logits, params)
    assume(not ambiguous)
    before = logits.copy()
    got = dense(process(logits, params), vocab)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize(
    "scale, params",
    [
        (3.5, SamplingParams(temperature=0.8)),  # the defaults: top-k 40 (strided pre-filter), top-p 0.95, min-p 0.05
        (3.5, SamplingParams(temperature=0.8, top_k=0)),  # top-k off: min-p bounds the sort
        (3.5, SamplingParams(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0)),  # nucleus 813: the first pool
        (3.5, SamplingParams(temperature=1.2, top_k=0, top_p=0.95, min_p=0.0)),  # nucleus 5741: the second pool
        (2.0, SamplingParams(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0)),  # nucleus 18985: full sort
        (2.0, SamplingParams(temperature=1.0, top_k=5000, top_p=0.9, min_p=0.0)),
        (2.0, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)),  # no truncation at all
    ],
)
def test_process_matches_reference_at_full_vocabulary(scale, params):
    logits = frozen(np.random.default_rng(7).standard_normal(151_936) * scale)
    expected, ambiguous = reference(logits, params)
    assert not ambiguous
    np.testing.assert_allclose(dense(process(logits, params), len(logits)), expected, rtol=1e-9, atol=1e-12)


def test_top_k_is_exact_when_the_top_tokens_sit_on_the_prefilter_stride():
    # _top_ids takes a threshold from every 16th logit; here that sample holds exactly the top 40
    logits = np.random.default_rng(0).standard_normal(151_936).astype(np.float32)
    top = np.arange(40) * 16 * 7
    logits[top] = 10.0 + np.arange(40)
    params = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)
    assert sorted(process(frozen(logits), params).ids.tolist()) == top.tolist()


# --- statistical tests of verify_stochastic ------------------------------------------------------------------------

N_TRIALS = 100_000
N_BROKEN = 10_000  # broken rules already miss by p-values below 1e-20 at this size; 100k would only slow the suite
ALPHA = 1e-3
V = 6


def _memoised_process(monkeypatch) -> None:
    """`process` is pure; memoising it per row keeps 100k verifications fast without changing their result."""
    real, memo = sampling.process, {}

    def cached(row, params):
        key = (row.tobytes(), id(params))
        if key not in memo:
            memo[key] = real(row, params)
        return memo[key]

    monkeypatch.setattr(sampling, "process", cached)


def p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of `counts` [V] against the distribution `expected` [V] (0 if a token outside its
    support was ever emitted)."""
    support = expected > 0
    if counts[~support].any():
        return 0.0
    return float(chisquare(counts[support], counts.sum() * expected[support]).pvalue)


def one_of(probs: np.ndarray, ids=None) -> Dist:
    ids = np.arange(V) if ids is None else np.asarray(ids)
    return Dist(ids.astype(np.int32), np.asarray(probs, dtype=np.float64))


# Target rows 0..2 (row i predicts position i+1), processed with truncation so p_i has zeros where q does not.
TARGET = frozen(
    [
        [2.0, 1.5, 0.2, -0.5, 1.0, -3.0],
        [-1.0, 0.3, 1.8, 0.9, 0.0, 1.1],
        [0.4, 0.4, -2.0, 1.0, 0.1, 0.6],
    ]
)
TRUNCATED = SamplingParams(temperature=0.9, top_k=4, top_p=0.97, min_p=0.05)


def scenarios() -> dict:
    """name → (the drafter's q_i per position, or None for a deterministic drafter; that drafter's fixed draft;
    the target's sampling params)."""
    p1, p2 = (process(TARGET[i], TRUNCATED) for i in range(2))
    return {
        # overlapping, different: q has mass where the truncated target has none (3, 5 at position 1; 0 at
        # position 2), and at position 2 the target has mass where q has none (5: only reachable as a correction)
        "overlap": (
            (one_of([0.1, 0.45, 0.05, 0.2, 0.05, 0.15]), one_of([0.3, 0.1, 0.3, 0.3], [0, 1, 2, 3])),
            None,
            TRUNCATED,
        ),
        # disjoint supports: top-k 2 keeps {0, 1}; the draft proposes only {3, 4, 5}
        "disjoint": (
            (one_of([0.5, 0.3, 0.2], [3, 4, 5]),),
            None,
            SamplingParams(temperature=1.3, top_k=2, top_p=1.0, min_p=0.0),
        ),
        # q = p: every draft token is accepted
        "q_equals_p": ((p1,), None, TRUNCATED),
        # a deterministic drafter (q = one-hot): token 1 at position 1 (p ~ 0.3), token 3 at position 2
        "one_hot": (None, np.array([1, 3], dtype=np.int32), TRUNCATED),
    }


def run(name: str, n_trials: int, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """`n_trials` draft → verify steps of scenario `name`: counts [V] of the first emitted token, and counts [V] of
    the second emitted token in the trials whose first draft token was accepted."""
    dists, fixed, params = scenarios()[name]
    draft_rng, rng = np.random.default_rng(seed), make_rng(seed + 1)
    if dists is None:
        drafts = np.broadcast_to(fixed, (n_trials, len(fixed)))
    else:  # draw every trial's draft at once, d_i ~ q_i (inverse CDF): [N, k]
        drafts = np.stack(
            [
                q.ids[np.minimum(np.searchsorted(np.cumsum(q.probs), draft_rng.random(n_trials)), len(q.ids) - 1)]
                for q in dists
            ],
            axis=1,
        )
    n, token = np.array([sampling.verify_stochastic(d, dists, TARGET, params, rng) for d in drafts]).T  # [N] each
    first = np.where(n > 0, drafts[:, 0], token)  # the accepted d_1, or the correction
    if drafts.shape[1] == 1:
        return np.bincount(first, minlength=V), np.zeros(V, np.int64)
    second = np.where(n > 1, drafts[:, 1], token)[n > 0]  # after an accepted d_1: the accepted d_2, or the target's
    return np.bincount(first, minlength=V), np.bincount(second, minlength=V)


def p_values(name: str, n_trials: int = N_TRIALS) -> tuple[float, float | None]:
    """(p-value of the first emitted token against p_1, of the second against p_2 or None for one-token drafts)
    over `n_trials` steps."""
    params = scenarios()[name][2]
    first, second = run(name, n_trials)
    assert first.sum() == n_trials
    p1, p2 = (reference(np.asarray(TARGET[i]), params)[0] for i in range(2))
    return p_value(first, p1), (p_value(second, p2) if second.sum() else None)


@pytest.mark.parametrize("name", ["overlap", "disjoint", "q_equals_p", "one_hot"])
def test_emitted_tokens_follow_the_target(monkeypatch, name):
    _memoised_process(monkeypatch)
    first, second = p_values(name)
    assert first > ALPHA, f"first emitted token does not follow p_1 (p-value {first:.2e})"
    assert second is None or second > ALPHA, f"second emitted token does not follow p_2 (p-value {second:.2e})"


# Broken rules, swapped into the real verify_stochastic: the statistical test above must reject each of them.


def always_accept(p_x: float, q_x: float) -> float:
    return 1.0


def accept_q_over_p(p_x: float, q_x: float) -> float:
    return min(1.0, q_x / p_x) if p_x > 0 else 0.0


def correction_from_p(p: Dist, q: Dist | None, token: int) -> np.ndarray:
    return p.probs


@pytest.mark.parametrize(
    "name, attr, broken",
    [
        ("overlap", "_acceptance", always_accept),
        ("disjoint", "_acceptance", always_accept),
        ("overlap", "_acceptance", accept_q_over_p),
        ("overlap", "_residual", correction_from_p),  # model drafter: correction from p, not max(0, p − q)
        ("one_hot", "_residual", correction_from_p),  # deterministic drafter: d not removed from p
    ],
)
def test_broken_rules_are_detected(monkeypatch, name, attr, broken):
    _memoised_process(monkeypatch)
    monkeypatch.setattr(sampling, attr, broken)
    first, second = p_values(name, N_BROKEN)
    assert first < ALPHA or (second is not None and second < ALPHA), f"{broken.__name__} passed ({first}, {second})"


def test_sample_follows_the_dist():
    d = one_of([0.5, 0.05, 0.25, 0.2], [4, 0, 5, 2])
    rng = make_rng(3)
    counts = np.bincount([sample(d, rng) for _ in range(20_000)], minlength=V)
    assert p_value(counts, dense(d, V)) > ALPHA


# --- verify_stochastic: literal and edge cases ---------------------------------------------------------------------


def test_k_zero_samples_the_first_row():
    n, token = verify_stochastic(np.zeros(0, np.int32), (), TARGET[:1], TRUNCATED, make_rng(0))
    assert n == 0 and process(TARGET[0], TRUNCATED).prob_of(token) > 0


def test_certain_target_accepts_and_rejects_deterministically():
    logits = frozen([[0, 30, 0, 0], [0, 0, 30, 0], [30, 0, 0, 0]])  # p_i ≈ one-hot on 1, 2, 0
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)
    assert verify_stochastic(np.array([1, 2]), None, logits, params, make_rng(0)) == (2, 0)  # all + bonus
    assert verify_stochastic(np.array([1, 3]), None, logits, params, make_rng(0)) == (1, 2)  # correction
    q = (one_of([0.5, 0.5], [1, 3]), one_of([1.0], [2]))
    assert verify_stochastic(np.array([3, 2]), q, logits, params, make_rng(0)) == (0, 1)


def test_draft_token_the_drafter_gave_no_probability_is_rejected():
    logits = frozen([[0, 0, 0, 0], [0, 0, 0, 0]])  # p uniform
    q = (one_of([1.0], [2]),)  # claims q(3) = 0, yet proposes 3
    n, token = verify_stochastic(np.array([3]), q, logits, PLAIN, make_rng(0))
    assert n == 0 and token != 2  # residual max(0, p − q) has no mass on 2


def test_rejection_with_an_all_zero_residual_samples_the_target():
    # p = q = one-hot on 2, but the drafter proposed 3 (q(3) = 0): rejected, and max(0, p − q) is all zero
    logits = frozen([[0, 0, 5, 0], [0, 0, 0, 0]])
    params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
    assert verify_stochastic(np.array([3]), (one_of([1.0], [2]),), logits, params, make_rng(0)) == (0, 2)


@pytest.mark.parametrize("n", [5, 300])  # 300 × 300 candidates: the binary-search path
def test_residual_is_max_of_p_minus_q(n):
    rng = np.random.default_rng(n)
    p_ids, q_ids = rng.choice(2 * n, n, replace=False), rng.choice(2 * n, n, replace=False)
    p = Dist(p_ids.astype(np.int32), rng.dirichlet(np.ones(n)))
    q = Dist(q_ids.astype(np.int32), rng.dirichlet(np.ones(n)))
    expected = np.maximum(dense(p, 2 * n) - dense(q, 2 * n), 0.0)[p.ids]
    np.testing.assert_allclose(sampling._residual(p, q, int(q_ids[0])), expected, atol=1e-15)
    one_hot = dense(p, 2 * n)
    one_hot[p_ids[1]] = 0.0
    np.testing.assert_array_equal(sampling._residual(p, None, int(p_ids[1])), one_hot[p.ids])


def test_rows_after_the_first_rejection_are_not_processed(monkeypatch):
    seen = []
    real = sampling.process
    monkeypatch.setattr(sampling, "process", lambda row, params: seen.append(1) or real(row, params))
    logits = frozen([[30, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])  # p_1 ≈ one-hot on 0
    params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)  # p_1 exactly one-hot on 0
    assert verify_stochastic(np.array([1, 2, 3]), None, logits, params, make_rng(0)) == (0, 0)
    assert len(seen) == 1


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match=r"needs logits of shape \[3, V\]"):
        verify_stochastic(np.array([1, 2]), None, TARGET[:2], TRUNCATED, make_rng(0))
    with pytest.raises(ValueError, match="2 draft tokens but 1 draft distributions"):
        verify_stochastic(np.array([1, 2]), (one_of([1.0], [1]),), TARGET, TRUNCATED, make_rng(0))


def test_same_seed_same_results():
    def steps(seed):
        rng = make_rng(seed)
        q = scenarios()["overlap"][0]
        return [verify_stochastic(np.array([i % V, (i * 5) % V]), q, TARGET, TRUNCATED, rng) for i in range(300)]

    assert steps(42) == steps(42)
    assert steps(42) != steps(43)
    assert make_rng(None).random() != make_rng(None).random()


# --- verify_greedy and the dispatch ---------------------------------------------------------------------------------

# argmax per row: 2, 0, 3, 1
GREEDY_LOGITS = frozen([[0, 1, 5, 2], [9, 1, 0, 2], [0, 1, 2, 3], [0, 8, 0, 1]])


@pytest.mark.parametrize(
    "draft, expected",
    [
        ([2, 0, 3], (3, 1)),  # all accepted: bonus from the last row
        ([1, 0, 3], (0, 2)),  # first rejected: correction from row 0
        ([2, 3, 3], (1, 0)),  # middle rejected: correction from row 1
        ([], (0, 2)),  # k = 0: plain decoding
    ],
)
def test_verify_greedy(draft, expected):
    k = len(draft)
    assert verify_greedy(np.array(draft, dtype=np.int32), GREEDY_LOGITS[: k + 1]) == expected


def test_verify_dispatches_on_temperature():
    draft = Draft(tokens=np.array([2, 3], dtype=np.int32))
    assert verify(draft, GREEDY_LOGITS[:3], SamplingParams(temperature=0.0), make_rng(0)) == (1, 0)
    certain = frozen([[0, 0, 40, 0], [0, 0, 0, 40], [40, 0, 0, 0]])
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    assert verify(draft, certain, params, make_rng(0)) == (2, 0)
    q = Draft(tokens=np.array([2, 3], dtype=np.int32), dists=(one_of([1.0], [2]), one_of([1.0], [3])))
    assert verify(q, certain, params, make_rng(0)) == (2, 0)


# --- a grammar's mask: the target distribution is the masked, renormalised one --------------------------------------


def bitmask(rows: list[list[int]], vocab: int = V) -> np.ndarray:
    """int32 [len(rows), ceil(vocab/32)] llguidance-layout bitmask allowing the listed token ids of each row."""
    out = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int64)
    for i, ids in enumerate(rows):
        for t in ids:
            out[i, t >> 5] |= 1 << (t & 31)
    return out.astype(np.uint32).view(np.int32)


# row 0 forbids 0 (the target's favourite) and 5; row 1 forbids 2 (its favourite)
MASKS = bitmask([[1, 2, 3, 4], [0, 1, 3, 4, 5], list(range(V))])


def masked_run(n_trials: int, seed: int = 99) -> tuple[np.ndarray, np.ndarray]:
    """The "overlap" drafter (q puts mass on forbidden tokens too: verification must still be exact) under MASKS:
    counts [V] of the first and (after an accepted d_1) second emitted token."""
    dists, _, params = scenarios()["overlap"]
    draft_rng, rng = np.random.default_rng(seed), make_rng(seed + 1)
    drafts = np.stack(
        [
            q.ids[np.minimum(np.searchsorted(np.cumsum(q.probs), draft_rng.random(n_trials)), len(q.ids) - 1)]
            for q in dists
        ],
        axis=1,
    )  # [N, 2]
    n, token = np.array([sampling.verify_stochastic(d, dists, TARGET, params, rng, MASKS) for d in drafts]).T
    first = np.where(n > 0, drafts[:, 0], token)
    second = np.where(n > 1, drafts[:, 1], token)[n > 0]
    return np.bincount(first, minlength=V), np.bincount(second, minlength=V)


def masked_reference(i: int, params: SamplingParams) -> np.ndarray:
    """The constrained target distribution of row i: the row with forbidden logits at -inf, then processed."""
    keep = np.unpackbits(MASKS[i].astype("<i4").view(np.uint8), count=V, bitorder="little").astype(bool)
    return reference(np.where(keep, np.asarray(TARGET[i]), -np.inf), params)[0]


def test_mask_rows_and_bits():
    row = np.arange(V, dtype=np.float32)
    assert sampling.allowed(MASKS[:2], np.array([1, 2])).tolist() == [True, False]
    assert sampling.allowed(MASKS[:2], np.array([0, 0])).tolist() == [False, True]
    masked = sampling.apply_mask(row, MASKS[0])
    assert (
        masked.dtype == np.float32
        and np.isneginf(masked[[0, 5]]).all()
        and masked[[1, 2, 3, 4]].tolist() == [1, 2, 3, 4]
    )
    big = bitmask([[0, 31, 32, 151_935]], 151_936)[0]  # bit 31 is the sign bit of an int32 word
    assert np.flatnonzero(np.isfinite(sampling.apply_mask(np.zeros(151_936, np.float32), big))).tolist() == [
        0,
        31,
        32,
        151_935,
    ]
    assert sampling.allowed(np.stack([big] * 3), np.array([31, 30, 151_935])).tolist() == [True, False, True]


def test_greedy_verification_takes_the_masked_argmax():
    logits = np.asarray(TARGET, dtype=np.float32)  # argmax by row: 0, 2, 3
    assert verify_greedy(np.array([0, 2], np.int32), logits) == (2, 3)
    # row 0 forbids 0: the masked argmax is 1 (the draft's 0 cannot even be proposed; 1 is accepted)
    assert verify_greedy(np.array([1, 3], np.int32), logits, MASKS) == (1, 5)  # row 1 forbids 2: 5 (1.1) wins
    assert verify_greedy(np.array([1, 5], np.int32), logits, MASKS) == (2, 3)


def test_sampling_under_a_mask_follows_the_masked_target(monkeypatch):
    _memoised_process(monkeypatch)
    params = scenarios()["overlap"][2]
    first, second = masked_run(N_TRIALS)
    for counts, i in ((first, 0), (second, 1)):
        p = p_value(counts, masked_reference(i, params))
        assert p > ALPHA, f"emitted token {i + 1} does not follow the masked target (p-value {p:.2e})"


def test_sampling_that_ignores_the_mask_is_detected(monkeypatch):
    _memoised_process(monkeypatch)
    monkeypatch.setattr(sampling, "_row", lambda logits, masks, i: logits[i])  # the bug: rows never masked
    params = scenarios()["overlap"][2]
    first, _ = masked_run(N_BROKEN)
    assert p_value(first, masked_reference(0, params)) < ALPHA


def test_logprob_is_the_masked_log_softmax():
    row = np.asarray(TARGET[0], dtype=np.float32)
    lp, top = sampling.token_logprob(row, 2, 3, MASKS[0])
    x = np.asarray(TARGET[0], dtype=np.float64)[[1, 2, 3, 4]]
    logz = np.log(np.exp(x).sum())
    assert lp == pytest.approx(float(x[1] - logz), abs=1e-6)
    assert [t for t, _ in top] == [1, 4, 2]
    assert [v for _, v in top] == pytest.approx([float(x[0] - logz), float(x[3] - logz), float(x[1] - logz)], abs=1e-6)
    lp_free, top_free = sampling.token_logprob(row, 0, 0)
    full = np.asarray(TARGET[0], dtype=np.float64)
    assert lp_free == pytest.approx(float(full[0] - np.log(np.exp(full).sum())), abs=1e-6) and top_free == ()


# --- two branches in one pass: the multi-candidate rule (SpecInfer; recursive rejection sampling) -------------------

# A token tree over TARGET-like rows: row 0 after the committed token, branch A = [1, 3] (rows 0, 1, 2) and branch
# B = [4, 0] (rows 0, 3, 4): both candidates for the first position, then each its own continuation.
TREE = frozen(
    [
        [2.0, 1.5, 0.2, -0.5, 1.0, -3.0],  # row 0: predicts position 1 (candidates 1 and 4)
        [-1.0, 0.3, 1.8, 0.9, 0.0, 1.1],  # row 1: after A's 1 (candidate 3)
        [0.4, 0.4, -2.0, 1.0, 0.1, 0.6],  # row 2: after A's 1, 3
        [0.9, -0.2, 0.5, 1.4, -1.0, 0.3],  # row 3: after B's 4 (candidate 0)
        [0.0, 1.0, 0.2, -0.3, 0.8, 0.1],  # row 4: after B's 4, 0
    ]
)
BRANCHES = (np.array([1, 3], np.int32), np.array([4, 0], np.int32))
TREE_ROWS = (np.array([0, 1, 2]), np.array([0, 3, 4]))
TREE_MASKS = bitmask([[1, 2, 3, 4], [0, 1, 3, 4, 5], list(range(V)), [0, 1, 2, 4, 5], list(range(V))])


def tree_run(n_trials: int, masks=None, seed: int = 7) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n_trials` verifications of the tree: counts [V] of the first emitted token, and of the second emitted token
    after a first token of 1 (A's path) and of 4 (B's path)."""
    rng = make_rng(seed)
    out = [sampling.verify_branches(BRANCHES, TREE, TREE_ROWS, TRUNCATED, rng, masks) for _ in range(n_trials)]
    first, after_a, after_b = np.zeros(V, np.int64), np.zeros(V, np.int64), np.zeros(V, np.int64)
    for j, n, token in out:
        path = [*BRANCHES[j][:n].tolist(), token]
        first[path[0]] += 1
        if len(path) > 1:
            (after_a if path[0] == 1 else after_b)[path[1]] += 1
    return first, after_a, after_b


def tree_reference(row: int, masks=None) -> np.ndarray:
    logits = np.asarray(TREE[row])
    if masks is not None:
        keep = np.unpackbits(masks[row].astype("<i4").view(np.uint8), count=V, bitorder="little").astype(bool)
        logits = np.where(keep, logits, -np.inf)
    return reference(logits, TRUNCATED)[0]


@pytest.mark.parametrize("masked", [False, True])
def test_two_branches_keep_the_target_distribution(monkeypatch, masked):
    _memoised_process(monkeypatch)
    masks = TREE_MASKS if masked else None
    first, after_a, after_b = tree_run(N_TRIALS, masks)
    for counts, row in ((first, 0), (after_a, 1), (after_b, 3)):
        p = p_value(counts, tree_reference(row, masks))
        assert p > ALPHA, f"tokens after row {row} do not follow the target (p-value {p:.2e})"


def residual_kept(p, children, rng):  # the bug: a rejected candidate stays in the residual
    for x in children:
        if rng.random() < float(p.probs[p.ids == x].sum()):
            return x, p.probs.copy()
    return None, p.probs.copy()


def unnormalised(p, children, rng):  # the bug: the second candidate accepted with r(x), not r(x) / sum(r)
    r = p.probs.copy()
    for x in children:
        hit = p.ids == x
        if rng.random() < float(r[hit].sum()):
            return x, r
        r[hit] = 0.0
    return None, r


@pytest.mark.parametrize("broken", [residual_kept, unnormalised])
def test_broken_multi_candidate_rules_are_detected(monkeypatch, broken):
    _memoised_process(monkeypatch)
    monkeypatch.setattr(sampling, "_try_candidates", broken)
    first, _, _ = tree_run(N_BROKEN)
    assert p_value(first, tree_reference(0)) < ALPHA


def test_two_branches_that_ignore_the_mask_are_detected(monkeypatch):
    _memoised_process(monkeypatch)
    monkeypatch.setattr(sampling, "_row", lambda logits, masks, i: logits[i])  # the bug: rows never masked
    first, _, _ = tree_run(N_BROKEN, TREE_MASKS)
    assert p_value(first, tree_reference(0, TREE_MASKS)) < ALPHA


def test_two_branches_greedy_follow_the_branch_the_argmax_takes():
    logits = np.asarray(TREE, np.float32)  # argmax: row 0 → 0, so neither 1 nor 4: n = 0, token 0
    assert sampling.verify_branches(BRANCHES, logits, TREE_ROWS, GREEDY, make_rng(0)) == (0, 0, 0)
    l2 = logits.copy()
    l2[0, 4] = 9.0  # row 0 now prefers 4 (B); row 3's argmax is 3, not B's 0
    assert sampling.verify_branches(BRANCHES, l2, TREE_ROWS, GREEDY, make_rng(0)) == (1, 1, 3)
    l2[3, 0] = 9.0  # and after 4, B's 0; after 4, 0: row 4's argmax 1 is the bonus token
    assert sampling.verify_branches(BRANCHES, l2, TREE_ROWS, GREEDY, make_rng(0)) == (1, 2, 1)
    with pytest.raises(ValueError, match="one row more"):
        sampling.verify_branches(BRANCHES, logits, (TREE_ROWS[0], TREE_ROWS[1][:2]), GREEDY, make_rng(0))
