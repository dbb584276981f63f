"""What the host loop's shortcuts must keep exact (benchmarks/bench_parts.py --part host, docs/host-work.md): the
argmax of read-only logits rows read in place, greedy verification that stops reading at the first rejection, and the
cost model's kept values (run acceptance chains, the measured curve's array) that must follow what they are computed
from."""

from __future__ import annotations

import numpy as np
import pytest

from specdec_cli.core.cost_model import BUCKET_EDGES, CostModel
from specdec_cli.core.records import Step
from specdec_cli.core.sampling import argmax_rows, verify_greedy
from specdec_cli.core.verify_curve import B_MAX, VerifyCurve

V = 151_936  # Qwen2.5's vocabulary: rows of whole chunks and a tail


def _read_only(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False  # as the backends' logits views are
    return a


@pytest.mark.parametrize("vocab", [V, 4096 * 5, 4096 * 4 + 1, 100])
def test_argmax_rows_is_numpys_argmax_on_read_only_rows(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((9, vocab)).astype(np.float32)
    x[1, vocab - 1] = 50.0  # the maximum in the tail past the last whole chunk
    x[2, [7, vocab // 2, vocab - 2]] = 60.0  # a tie: the first one wins
    x[3, :] = -np.inf  # a fully masked row: index 0
    x[4, [vocab - 3, 11]] = np.nan  # NaN counts as the maximum, the first one
    x[5, 4096 * (vocab // 4096 // 2)] = 70.0  # the first index of a chunk
    x[6, :] = 0.0
    x[6, [5000 % vocab, 9000 % vocab]] = -0.0  # signed zeros tie with zeros
    x[7, 4095 % vocab] = 80.0  # the last index of a chunk
    got = argmax_rows(_read_only(x))
    assert got.tolist() == np.argmax(x, axis=1).tolist()
    assert argmax_rows(_read_only(x[:0])).shape == (0,)


def _reference_greedy(draft: np.ndarray, logits: np.ndarray) -> tuple[int, int]:
    best = np.argmax(logits, axis=1)
    for i, d in enumerate(draft):
        if best[i] != d:
            return i, int(best[i])
    return len(draft), int(best[len(draft)])


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 11, 12, 13, 28, 40, 64])
def test_greedy_verification_in_blocks_agrees_with_every_row_at_once(k):
    rng = np.random.default_rng(k)
    for _ in range(12):
        logits = rng.standard_normal((k + 1, 20_000)).astype(np.float32)
        target = np.argmax(logits, axis=1)
        n_right = int(rng.integers(0, k + 1))  # the draft follows the target for n_right tokens, then leaves it
        draft = target[:k].astype(np.int32).copy()
        if n_right < k:
            draft[n_right] = (draft[n_right] + 1) % 20_000
            draft[n_right + 1 :] = rng.integers(0, 20_000, size=k - n_right - 1)
        assert verify_greedy(draft, _read_only(logits)) == _reference_greedy(draft, logits)


def _step(n_drafted: int, n_accepted: int, source: str = "prompt", match_len: int = 5) -> Step:
    drafted = tuple(range(n_drafted))
    return Step(
        index=0,
        k=n_drafted,
        drafted=drafted,
        n_accepted=n_accepted,
        target_token=7,
        emitted=drafted[:n_accepted] + (7,),
        segments=(),
        draft_ms=0.1,
        verify_ms=10.0,
        source=source,
        match_len=match_len,
    )


def test_run_acceptance_kept_across_steps_equals_it_computed_afresh():
    rng = np.random.default_rng(0)
    model = CostModel(k_max=64)
    sources = ("prompt", "store", "predict")
    for _ in range(300):
        source = sources[int(rng.integers(0, 3))]
        bucket = int(rng.integers(0, len(BUCKET_EDGES)))
        for b in rng.permutation(len(BUCKET_EDGES))[:3]:  # asked in any order, some buckets kept from earlier steps
            for s in sources:
                fresh = model._bucket_chain(model._run_counts(s), int(b), s, model.prior.acceptance)
                assert model.run_acceptance(int(b), s).tolist() == fresh.tolist()
        n = int(rng.integers(1, 40))
        model.observe(_step(n, int(rng.integers(0, n + 1)), source), bucket, source)


def test_the_chain_past_its_evidence_is_the_loop_it_replaces():
    def loop(acc, m, floor, s):
        hits, trials = acc.tolist()
        floors = floor.tolist() if floor is not None else [0.0] * len(hits)
        out = []
        for h, t, f in zip(hits, trials, floors, strict=False):
            m = (h + s * max(m, f)) / (t + s)
            out.append(m)
        return out

    rng = np.random.default_rng(1)
    for _ in range(3000):
        k = int(rng.integers(1, 65))
        depth = int(rng.integers(0, k + 1))
        acc = np.zeros((2, k))
        acc[1, :depth] = rng.random(depth) * 40 * 0.5 ** int(rng.integers(0, 60))
        acc[0, :depth] = acc[1, :depth] * rng.random(depth)
        floor = None if rng.random() < 0.5 else rng.random(k)
        s = float(rng.choice([2.0, 1.0, 4.0, 3.0, 0.5]))
        m = float(rng.random())
        assert CostModel._chain(acc, m, floor, s).tolist() == loop(acc, m, floor, s)


def test_the_kept_curve_array_follows_a_new_curve():
    flat = VerifyCurve(ms=tuple(10.0 for _ in range(B_MAX)))
    steep = VerifyCurve(ms=tuple(10.0 * b for b in range(1, B_MAX + 1)))
    model = CostModel(k_max=16, curve=flat)
    model.observe(_step(3, 3), None)
    assert model.verify_curve()[15] == pytest.approx(model.verify_curve()[0], rel=0.01)
    model.curve = steep
    model.observe(_step(3, 3), None)  # the next fit (a step changed the points) prices passes on the new curve
    v = model.verify_curve()
    assert v[15] > 5 * v[0]
