"""The MTP drafter (`drafters.mtp`, `--method mtp`): the target's own multi-token-prediction block proposes the draft.
On the fake backend with a fake block: greedy output is the target's greedy decode, and under sampling the drafter
returns the q it drew each token from, so rejection sampling keeps the target's distribution (chi-square)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from scipy.stats import chisquare

from fakes import FakeBackend, greedy_reference, hashed_logits
from specdec_cli.core import sampling
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Source, Step
from specdec_cli.core.sampling import SamplingParams, make_rng, process
from specdec_cli.drafters.mtp import MtpDrafter
from specdec_cli.spec import Method, parse_method


class FakeHead:
    """An MTP block over a fake target: it sees the target's committed tokens (positions < pos) and `last`, and
    predicts with `fn(prefix)` (the target's own fn for a perfect block, another for a poor one)."""

    def __init__(self, target: FakeBackend, fn: Callable) -> None:
        self.target, self.fn = target, fn
        self.calls: list[tuple[int, int, int]] = []

    def draft(self, last: int, pos: int, k: int, choose: Callable[[np.ndarray, int], int]) -> list[int]:
        self.calls.append((last, pos, k))
        assert len(self.target.tokens) == pos, "the target's cache holds the positions before the newest token"
        prefix = [*map(int, self.target.tokens), last]
        out = []
        for i in range(k):
            tok = choose(np.asarray(self.fn(prefix), np.float32), i)
            if tok < 0:
                break
            out.append(tok)
            prefix.append(tok)
        return out


def noisy(seed: int) -> Callable:
    """A block that agrees with the target's argmax at most positions: the target's logits plus noise."""
    return lambda prefix: hashed_logits(prefix) + 2.5 * hashed_logits(prefix, seed=seed, peak=0.0)


def test_greedy_output_is_the_targets_greedy_decode_and_the_drafts_are_the_blocks() -> None:
    target = FakeBackend(n_ctx=256)
    head = FakeHead(target, noisy(7))
    engine = SpeculativeEngine(target, MtpDrafter(head), FixedK(4))
    prompt = [3, 5, 7, 9, 11]
    steps = [r for r in engine.generate(prompt, GenerationConfig(max_tokens=60)) if isinstance(r, Step)]
    out = [t for s in steps for t in s.emitted]
    assert out == greedy_reference(hashed_logits, prompt, 60)[: len(out)] and len(out) >= 40
    drafted = [s for s in steps if s.drafted]
    assert drafted and all(s.source is Source.mtp for s in drafted)
    assert 0 < sum(s.n_accepted for s in steps) < sum(len(s.drafted) for s in steps)  # some accepted, some not
    assert head.calls[0][1] == len(prompt) - 1  # the first draft starts at the prompt's last token


def test_a_perfect_block_has_every_draft_accepted() -> None:
    target = FakeBackend(n_ctx=256)
    engine = SpeculativeEngine(target, MtpDrafter(FakeHead(target, hashed_logits)), FixedK(4))
    steps = [r for r in engine.generate([2, 4, 6], GenerationConfig(max_tokens=40)) if isinstance(r, Step)]
    assert all(s.n_accepted == len(s.drafted) for s in steps)


def test_a_fork_for_another_sequence_drafts_nothing() -> None:
    target = FakeBackend()
    fork = MtpDrafter(FakeHead(target, hashed_logits)).fork()
    assert not fork.has_model and len(fork.propose(np.array([1, 2], np.int32), 4, SamplingParams(), make_rng(0))) == 0


def test_mtp_is_a_method_with_the_fields_names() -> None:
    assert parse_method("mtp") is Method.mtp and parse_method("draft-mtp") is Method.mtp
    assert Source.mtp.label == "MTP head"


# -- sampling: the q the drafter returns is the q it drew from ---------------------------------------------------

V = 6
TARGET_ROWS = np.array(
    [[2.0, 1.5, 0.2, -0.5, 1.0, -3.0], [-1.0, 0.3, 1.8, 0.9, 0.0, 1.1], [0.4, 0.4, -2.0, 1.0, 0.1, 0.6]],
    dtype=np.float32,
)
HEAD_ROWS = np.array([[0.0, 2.2, 0.5, 1.0, -1.0, 0.3], [1.0, -0.5, 0.2, 1.9, 0.4, 0.0]], dtype=np.float32)
PARAMS = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0)


class RowsHead:
    """A block whose i-th draft position has the fixed logits HEAD_ROWS[i]."""

    def draft(self, last: int, pos: int, k: int, choose: Callable[[np.ndarray, int], int]) -> list[int]:
        out = []
        for i in range(k):
            tok = choose(HEAD_ROWS[i].copy(), i)
            if tok < 0:
                break
            out.append(tok)
        return out


def first_tokens(n: int, drafter: MtpDrafter, seed: int = 11) -> np.ndarray:
    """Counts [V] of the first emitted token over n draft → verify steps of two MTP tokens."""
    rng = make_rng(seed)
    ctx = np.array([1], np.int32)
    counts = np.zeros(V, np.int64)
    for _ in range(n):
        d = drafter.propose(ctx, 2, PARAMS, rng)
        n_acc, token = sampling.verify_stochastic(d.tokens, d.dists, TARGET_ROWS, PARAMS, rng)
        counts[int(d.tokens[0]) if n_acc > 0 else token] += 1
    return counts


def p_value(counts: np.ndarray) -> float:
    p = process(TARGET_ROWS[0], PARAMS)
    expected = np.zeros(V)
    expected[p.ids] = p.probs
    if counts[expected == 0].any():
        return 0.0
    support = expected > 0
    return float(chisquare(counts[support], counts.sum() * expected[support]).pvalue)


def test_rejection_sampling_with_the_blocks_q_keeps_the_targets_distribution() -> None:
    assert p_value(first_tokens(8000, MtpDrafter(RowsHead()))) > 1e-3


def test_a_drafter_that_reports_another_q_than_it_drew_from_is_detected(monkeypatch) -> None:
    import specdec_cli.drafters.mtp as mtp

    # the planted bug: the block's argmax is drafted while q is reported (a greedy draft passed off as a draw)
    monkeypatch.setattr(mtp, "sample", lambda q, rng: int(q.ids[np.argmax(q.probs)]))
    assert p_value(first_tokens(8000, MtpDrafter(RowsHead()))) < 1e-3


def test_the_method_needs_a_target_with_an_mtp_block(tmp_path) -> None:
    from specdec_cli.assemble import Assembler
    from specdec_cli.errors import UsageError
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions

    session = Session(target=FakeBackend(), target_path=tmp_path / "dense.gguf")
    with pytest.raises(UsageError, match="MTP block"):
        Assembler(session).make_drafter(SpecOptions(method=Method.mtp))


def test_under_a_seed_the_block_drafts_the_draws_the_target_makes_with_the_same_q() -> None:
    # the Gumbel coupling: a block whose rows are the target's draws, at each position, the token the target draws
    class TargetHead:
        def draft(self, last, pos, k, choose):
            return [choose(TARGET_ROWS[i].copy(), i) for i in range(k)]

    for seed in range(40):
        params = SamplingParams(temperature=0.9, top_k=5, top_p=1.0, min_p=0.0, seed=seed)
        d = MtpDrafter(TargetHead()).propose(np.array([1, 2, 3], np.int32), 2, params, make_rng(0))
        assert sampling.verify_keyed(d.tokens, TARGET_ROWS, params, 3) == (
            2,
            sampling.sample_at(process(TARGET_ROWS[2], params), seed, 5),
        )
