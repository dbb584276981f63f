"""Prompt lookup with literal token arrays."""

import numpy as np

from specdec_cli.core.sampling import GREEDY
from specdec_cli.drafters.ngram import NgramDrafter

rng = np.random.default_rng(0)


def propose(drafter, ctx, k):
    return list(drafter.propose(np.asarray(ctx, np.int32), k, GREEDY, rng).tokens)


def test_longest_ngram_wins_over_shorter_more_recent_one():
    d = NgramDrafter(1, 3)
    #        [1 2 3] 9 9 | [3] 7 7 | ... ends with 1 2 3
    ctx = [1, 2, 3, 9, 9, 3, 7, 7, 1, 2, 3]
    assert propose(d, ctx, 2) == [9, 9]


def test_most_recent_occurrence_of_the_same_ngram_wins():
    d = NgramDrafter(2, 2)
    ctx = [4, 5, 1, 1, 4, 5, 2, 2, 4, 5]
    assert propose(d, ctx, 2) == [2, 2]


def test_draft_is_cut_at_k_and_at_the_end_of_the_context():
    d = NgramDrafter(1, 2)
    ctx = [7, 8, 1, 2, 3, 7, 8]
    assert propose(d, ctx, 3) == [1, 2, 3]
    assert propose(d, ctx, 10) == [1, 2, 3, 7, 8]


def test_no_match_gives_an_empty_draft():
    d = NgramDrafter(2, 4)
    assert propose(d, [1, 2, 3, 4, 5], 4) == []
    assert propose(d, [1], 4) == []


def test_n_min_is_respected():
    d = NgramDrafter(2, 3)
    assert propose(d, [5, 1, 9, 5], 2) == []  # only a 1-gram match exists


def test_the_occurrence_matching_furthest_back_wins_and_is_the_evidence():
    d = NgramDrafter(2, 2)
    #      x [4 5] 1 | y [4 5] 2 | x 4 5
    ctx = [8, 4, 5, 1, 9, 4, 5, 2, 8, 4, 5]
    draft = d.propose(np.asarray(ctx, np.int32), 1, GREEDY, rng)
    assert list(draft.tokens) == [1]  # 8 4 5 matches 3 tokens back; the more recent 9 4 5 only 2
    assert draft.match_len == 3
    assert d.propose(np.asarray([4, 5, 7, 4, 5], np.int32), 1, GREEDY, rng).match_len == 2
