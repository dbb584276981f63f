"""The suffix drafter (SuffixDecoding) and its persistent store: matching, walking, persistence, recovery, CLI."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_cli.core.sampling import GREEDY
from specdec_cli.drafters.suffix import LocalIndex, SuffixDrafter
from specdec_cli.stores.suffix_index import SEP, Corpus
from specdec_cli.stores.suffix_store import SuffixStore, SuffixStoreWarning, read_info, store_path

FP = "ab" * 32  # a vocabulary fingerprint (sha256 hex)
OTHER_FP = "cd" * 32
RNG = np.random.default_rng(0)


def arr(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def propose(drafter: SuffixDrafter, context, k: int = 8):
    return drafter.propose(np.asarray(context, dtype=np.int32), k, GREEDY, RNG)


def data_dir() -> Path:
    from specdec_cli.config import data_dir as dd

    return dd()


def make_store(**kw) -> SuffixStore:
    return SuffixStore(store_path(data_dir(), FP), fingerprint=FP, **kw)


def store_with(*docs, **kw) -> SuffixStore:
    store = make_store(**kw)
    for d in docs:
        store.add(np.asarray(d, dtype=np.int32))
    return store


# -- brute-force references --------------------------------------------------------------------------------------


def occurs(docs: list[list[int]], pattern: list[int]) -> int:
    m = len(pattern)
    return sum(d[i : i + m] == pattern for d in docs for i in range(len(d) - m + 1))


def brute_longest(docs: list[list[int]], context: list[int], max_depth: int) -> int:
    best = 0
    for m in range(1, min(max_depth, len(context)) + 1):
        if occurs(docs, context[-m:]):
            best = m
    return best


# -- matching ------------------------------------------------------------------------------------------------------


def test_local_longest_suffix_match_beats_the_most_recent_shorter_one():
    # "5 2 3 4" occurred at the start (then 7); only "3 4" occurred more recently (then 8).
    ctx = [5, 2, 3, 4, 7, 0, 9, 3, 4, 8, 1, 5, 2, 3, 4]
    drafter = SuffixDrafter(None, factor=1.0)
    draft = propose(drafter, ctx, k=8)
    assert drafter.last.match_len == 4
    assert draft.tokens.tolist() == [7, 0, 9, 3]  # 4 tokens: factor 1 × match length 4
    assert draft.dists is None and draft.source == "prompt" and draft.tokens.dtype == np.int32  # a local match


def test_global_longest_suffix_match_and_its_occurrences():
    corpus = Corpus.build([arr(1, 2, 3, 4, 10, 11), arr(9, 3, 4, 20, 21), arr(3, 4, 20, 22)])
    m, lo, hi = corpus.longest_match(arr(7, 2, 3, 4), max_depth=64)
    assert (m, hi - lo) == (3, 1)  # "2 3 4" once
    assert corpus.walk(lo, hi, m, 8, 0.1).tokens.tolist() == [10, 11]
    m, lo, hi = corpus.longest_match(arr(8, 3, 4), max_depth=64)
    assert (m, hi - lo) == (2, 3)  # "3 4" three times
    m, lo, hi = corpus.longest_match(arr(1, 2, 3, 4), max_depth=2)
    assert m == 2  # capped by max_depth
    assert corpus.longest_match(arr(99), 64) == (0, 0, 0)


def test_matches_never_cross_documents():
    corpus = Corpus.build([arr(1, 2, 3), arr(4, 5, 6)])
    m, lo, hi = corpus.longest_match(arr(3, 4), 64)
    assert m == 1  # "3 4" spans the separator: only "4" matches
    walk = corpus.walk(*corpus.longest_match(arr(9, 2, 3), 64)[1:], 2, 8, 0.0)
    assert walk.tokens.tolist() == []  # document 0 ends after "2 3"


@settings(max_examples=60, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=25), min_size=1, max_size=6),
    extra=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=10), max_size=3),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=12),
)
def test_global_match_and_counts_equal_brute_force(docs, extra, context):
    corpus = Corpus.build([arr(*d) for d in docs * 4])
    for d in extra:  # merged into the suffix array, not rebuilt (the corpus is > 8x larger)
        corpus = corpus.with_documents([arr(*d)], [0.0])
    all_docs = docs * 4 + extra
    m, lo, hi = corpus.longest_match(arr(*context), max_depth=8)
    assert m == brute_longest(all_docs, context, 8)
    if m:
        pattern = context[-m:]
        assert hi - lo == occurs(all_docs, pattern)
        walk = corpus.walk(lo, hi, m, 1, 0.0)
        if len(walk.tokens):
            counts = {t: occurs(all_docs, pattern + [t]) for t in range(4)}
            assert walk.first_count == max(counts.values()) == counts[int(walk.tokens[0])]


def test_a_node_with_thousands_of_occurrences_is_counted_exactly():
    # 1,301 occurrences of "5": above the exact-count limit, the children are sampled, then bisected exactly.
    docs = [[5, 7]] * 600 + [[5, 8, 3]] * 601 + [[5, 9]] * 100
    RNG.shuffle(docs)
    corpus = Corpus.build([arr(*d) for d in docs])
    m, lo, hi = corpus.longest_match(arr(5), 64)
    walk = corpus.walk(lo, hi, m, 4, 0.0)
    assert (hi - lo, walk.tokens.tolist(), walk.first_count) == (1301, [8, 3], 601)
    assert walk.probs.tolist() == [601 / 1301, 1.0]
    # Mostly document ends after "5 8", a handful of continuations: min_prob 0 still drafts the best one.
    corpus = Corpus.build([arr(5, 8)] * 1500 + [arr(5, 8, 1)] * 3 + [arr(5, 8, 2)] * 2)
    walk = corpus.walk(*corpus.longest_match(arr(5, 8), 64)[1:], 2, 4, 0.0)
    assert walk.tokens.tolist() == [1] and walk.first_count == 3
    assert len(corpus.walk(*corpus.longest_match(arr(5, 8), 64)[1:], 2, 4, 0.01).tokens) == 0


# -- frequency, sizing, cut-off --------------------------------------------------------------------------------------


def test_global_frequency_wins_over_recency():
    store = store_with([1, 2, 3, 7, 8], [1, 2, 3, 7, 8], [1, 2, 3, 7, 8], [1, 2, 3, 9, 9])  # 9 is the newest
    drafter = SuffixDrafter(store, factor=4.0)
    draft = propose(drafter, [5, 2, 3])
    assert draft.tokens.tolist() == [7, 8]
    assert drafter.last.source == "global"
    assert drafter.last.probs[0] == pytest.approx(0.75)
    assert draft.score == pytest.approx(3 / 5)  # confidence: first_count / (occurrences + 1)


def test_local_frequency_wins_over_recency_and_ties_go_to_the_most_recent():
    drafter = SuffixDrafter(None, factor=4.0)
    assert propose(drafter, [2, 3, 7, 2, 3, 7, 2, 3, 9, 2, 3]).tokens[0] == 7  # 2 of 3
    drafter.begin(arr(2, 3, 7, 2, 3, 9, 2, 3))  # a new generation
    assert propose(drafter, [2, 3, 7, 2, 3, 9, 2, 3]).tokens[0] == 9  # 1 of 2 each: the most recent


def test_draft_length_is_capped_by_factor_times_match_length_and_by_k():
    store = store_with(list(range(10, 40)))
    ctx = [0, 13, 14]  # matches "13 14": 2 tokens
    assert len(propose(SuffixDrafter(store, factor=1.0), ctx, k=16)) == 2
    assert len(propose(SuffixDrafter(store), ctx, k=16)) == 8  # the default factor, 4
    assert len(propose(SuffixDrafter(store, factor=2.5), ctx, k=16)) == 5  # ceil(2.5 × 2)
    assert len(propose(SuffixDrafter(store, factor=2.5), ctx, k=3)) == 3
    assert propose(SuffixDrafter(store, factor=100), ctx, k=64).tokens.tolist() == list(range(15, 40))  # doc end


def test_probability_cut_off_stops_the_walk():
    store = store_with([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 8, 9])
    # after "2 3": 4 (3/3), then 5 (2/3), then 6 (2/2)
    assert propose(SuffixDrafter(store, factor=4, min_token_prob=0.6), [0, 2, 3]).tokens.tolist() == [4, 5, 6]
    assert propose(SuffixDrafter(store, factor=4, min_token_prob=0.7), [0, 2, 3]).tokens.tolist() == [4]
    flat = store_with([1, 2, 3, 4], [1, 2, 3, 6], [1, 2, 3, 7])  # three children, 1/3 each
    drafter = SuffixDrafter(flat, factor=4, min_token_prob=0.4)
    draft = propose(drafter, [0, 2, 3])
    assert len(draft) == 0 and draft.score == 0.0


def test_local_vs_global_choice_by_match_length_then_expected_accepted_tokens():
    # Equal matches ("2 3"). Global: "2 3" -> 4 5 6 7 seen three times. Local: "2 3" -> 9 then 1 of 2 ... weaker.
    store = store_with([2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7])
    drafter = SuffixDrafter(store, factor=4)
    draft = propose(drafter, [2, 3, 9, 1, 2, 3, 8, 0, 2, 3])
    assert drafter.last.source == "global" and draft.source == "store" and draft.tokens.tolist() == [4, 5, 6, 7]
    # Local: a long match of this very prompt beats a short global one.
    drafter.begin(arr(11, 12, 13, 2, 3, 21, 22, 23, 24, 0, 11, 12, 13, 2, 3))
    draft = propose(drafter, [11, 12, 13, 2, 3, 21, 22, 23, 24, 0, 11, 12, 13, 2, 3])
    assert drafter.last.source == "local" and drafter.last.match_len == 5
    assert draft.tokens.tolist() == [21, 22, 23, 24, 0, 11, 12, 13]  # k = 8
    assert 0.0 < draft.score <= 1.0


def test_a_longer_global_match_beats_a_longer_local_draft():
    # The prompt holds the original text (matching the context's last 3 tokens, with a long continuation); a past
    # output matches the last 6: it is the better evidence (a repeated edit), although its draft is shorter.
    store = store_with([50, 51, 52, 1, 2, 3, 60, 61])
    drafter = SuffixDrafter(store, factor=4)
    draft = propose(drafter, [1, 2, 3, 70, 71, 72, 73, 74, 75, 76, 77, 9, 50, 51, 52, 1, 2, 3], k=16)
    assert drafter.last.source == "global" and drafter.last.match_len == 6
    assert draft.tokens.tolist() == [60, 61]


def test_a_reply_opening_and_its_end_are_learnt():
    # Outputs are stored after the last `lead_in` prompt tokens (the assistant header), and with the end-of-
    # generation token that ended them: a second reply is drafted from its first token to its end.
    store = make_store()
    drafter = SuffixDrafter(store, lead_in=3)
    drafter.finish(arr(7, 8, 90, 91, 92), arr(40, 41, 42, 43, 1))  # 1: the end-of-generation token
    assert [d.tolist() for d in store.documents()] == [[90, 91, 92, 40, 41, 42, 43, 1]]
    drafter.begin(arr(5, 6, 90, 91, 92))
    draft = propose(drafter, [5, 6, 90, 91, 92], k=16)
    assert drafter.last.source == "global" and draft.tokens.tolist() == [40, 41, 42, 43, 1]
    bare = SuffixDrafter(store_with([40, 41, 42, 43, 1]))  # the same reply stored without its lead-in
    assert len(propose(bare, [5, 6, 90, 91, 92], k=16)) == 0  # ... cannot draft its opening


def test_nothing_to_match_gives_an_empty_draft():
    drafter = SuffixDrafter(store_with([1, 2, 3]))
    draft = propose(drafter, [7, 8, 9])
    assert len(draft) == 0 and draft.dists is None


def test_propose_is_deterministic_and_does_not_touch_the_context():
    ctx = arr(1, 2, 3, 4, 1, 2, 3, 4, 1, 2)
    before = ctx.copy()
    d1 = propose(SuffixDrafter(store_with([1, 2, 5, 5])), ctx)
    d2 = propose(SuffixDrafter(store_with([1, 2, 5, 5])), ctx)
    assert d1.tokens.tolist() == d2.tokens.tolist() and d1.score == d2.score
    assert np.array_equal(ctx, before)


# -- the local index grows incrementally ---------------------------------------------------------------------------


def _index_state(idx: LocalIndex):
    return idx.tokens.tolist(), {k: list(v) for k, v in idx.uni.items()}, {k: list(v) for k, v in idx.bi.items()}


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    steps=st.lists(st.integers(1, 5), min_size=1, max_size=40),
    k=st.integers(1, 6),
)
def test_incremental_local_index_equals_a_from_scratch_build(tokens, steps, k):
    incremental = SuffixDrafter(None, max_depth=8, factor=2.0)
    n = min(len(tokens), steps[0])
    for step in [*steps[1:], len(tokens)]:
        ctx = arr(*tokens[:n])
        got = propose(incremental, ctx, k)
        fresh = SuffixDrafter(None, max_depth=8, factor=2.0)
        want = propose(fresh, ctx, k)
        assert _index_state(incremental.local) == _index_state(fresh.local)
        assert got.tokens.tolist() == want.tokens.tolist() and got.score == want.score
        if n == len(tokens):
            break
        n = min(len(tokens), n + step)


def test_local_index_starts_over_on_a_context_that_does_not_extend_it():
    drafter = SuffixDrafter(None, factor=1.0)
    propose(drafter, [1, 2, 3, 1, 2])
    draft = propose(drafter, [7, 8, 9, 7, 8])  # no reset(): detected, re-indexed
    assert drafter.local.tokens.tolist() == [7, 8, 9, 7, 8] and draft.tokens.tolist() == [9, 7]


# -- the store: learning, eviction, persistence ------------------------------------------------------------------------


def test_finish_learns_the_output_for_the_next_generation_and_close_saves():
    store = make_store()
    drafter = SuffixDrafter(store, factor=4, lead_in=0)
    propose(drafter, [1, 2])
    drafter.finish(arr(1, 2), arr(40, 41, 42, 43, 44))
    drafter.begin(arr(9, 40, 41))
    assert propose(drafter, [9, 40, 41]).tokens.tolist() == [42, 43, 44]
    assert drafter.last.source == "global"
    drafter.close()
    again = SuffixDrafter(make_store(), factor=4)
    assert propose(again, [9, 40, 41]).tokens.tolist() == [42, 43, 44]
    assert [d.tolist() for d in make_store().documents()] == [[40, 41, 42, 43, 44]]  # the prompt is not stored


def test_store_is_lazy_or_preloaded_in_the_background(monkeypatch):
    store = SuffixStore(Path("/nonexistent/dir/abababababababab.npz"), fingerprint=FP)
    drafter = SuffixDrafter(store, preload=False)
    assert not store.loaded and store._loader is None  # no I/O until the first propose
    propose(drafter, [1, 2, 1])
    assert store.loaded and store.corpus.n_docs == 0

    saved = store_with([1, 2, 3, 4])
    assert saved.save()
    store = make_store()
    reads = []
    real = SuffixStore._load
    monkeypatch.setattr(SuffixStore, "_load", lambda self, warn=None: reads.append(1) or real(self, warn))
    drafter = SuffixDrafter(store, factor=4)  # starts the read in a thread
    drafter.begin(arr(0, 1, 2))  # the engine's hook at the start of a generation: collects it
    assert store.loaded and not store._loader and reads == [1]
    assert propose(drafter, [0, 1, 2]).tokens.tolist() == [3, 4] and reads == [1]


def test_eviction_keeps_the_store_under_max_tokens_and_drops_the_oldest():
    store = make_store(max_tokens=10)
    docs = [[i * 10 + j for j in range(4)] for i in range(1, 6)]  # 5 documents of 4 tokens, oldest first
    for d in docs:
        store.add(arr(*d))
    assert store.corpus.n_tokens <= 10
    assert store.save()
    kept = [d.tolist() for d in make_store().documents()]
    assert kept == docs[-2:]
    assert read_info(store.path).n_tokens == 8
    drafter = SuffixDrafter(make_store(max_tokens=10), factor=4)
    assert propose(drafter, [0, 50, 51]).tokens.tolist() == [52, 53]  # the newest is searchable
    assert len(propose(drafter, [0, 10, 11])) == 0  # the oldest is gone
    store.add(arr(*range(100, 130)))  # longer than max_tokens: cut to its first 10 tokens
    assert [d.tolist() for d in store.documents()] == [list(range(100, 110))]


def test_persistence_round_trip_format_and_permissions():
    docs = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9, 9, 9]]
    store = store_with(*docs)
    assert store.save()
    path = store.path
    assert path == data_dir() / "suffix" / f"{FP[:16]}.npz"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]))
        assert meta["format"] == "specdec-suffix" and meta["version"] == 1 and meta["fingerprint"] == FP
        assert (meta["n_docs"], meta["n_tokens"]) == (3, 12)
        assert z["tokens"].tolist() == [1, 2, 3, 4, SEP, 5, 6, 7, SEP, 1, 2, 9, 9, 9, SEP]
        assert z["offsets"].tolist() == [0, 5, 9, 15]
        assert sorted(z["sa"].tolist()) == list(range(15))
    loaded = make_store()
    assert [d.tolist() for d in loaded.documents()] == docs
    assert np.array_equal(loaded.corpus.sa, store.corpus.sa)
    assert not list(path.parent.glob(".*tmp*"))
    info = read_info(path)
    assert (info.fingerprint, info.n_docs, info.n_tokens) == (FP, 3, 12)


def test_a_store_without_a_given_fingerprint_saves_and_reopens_with_one():
    path = store_path(data_dir(), FP)
    store = SuffixStore(path)  # the fingerprint comes from the file name
    store.add(arr(1, 2, 3))
    assert store.save()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [d.tolist() for d in SuffixStore(path, fingerprint=FP).documents()] == [[1, 2, 3]]


# -- corrupt files ----------------------------------------------------------------------------------------------------


def _rewrite_meta(path: Path, **changes) -> None:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["meta"]))
    meta.update(changes)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _reverse_the_suffix_array(path: Path) -> None:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["sa"] = arrays["sa"][::-1].copy()
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00not a store\xff" * 100)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside an array member: the zip CRC catches it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_truncate, "unreadable"),
        (_garbage, "not a store file"),
        (_flip_a_byte, "unreadable"),
        (lambda p: _rewrite_meta(p, version=99), "version 99"),
        (lambda p: _rewrite_meta(p, fingerprint=FP[:16] + "0" * 48), "another tokenizer"),
        (lambda p: _rewrite_meta(p, n_docs=7), "inconsistent"),
    ],
    ids=["truncated", "garbage", "bit-flip", "wrong-version", "wrong-fingerprint", "inconsistent"],
)
def test_a_corrupt_store_is_set_aside_with_a_warning_and_a_fresh_one_started(damage, reason):
    store = store_with(list(range(1, 60)), [5, 6, 7])
    assert store.save()
    damage(store.path)
    fresh = make_store()
    drafter = SuffixDrafter(fresh, lead_in=0)
    with pytest.warns(SuffixStoreWarning, match=reason) as caught:
        draft = propose(drafter, [0, 5, 6])  # loads: must not raise
    assert len(draft) == 0 or drafter.last.source == "local"
    assert str(fresh.path) in str(caught[0].message) and "moved it to" in str(caught[0].message)
    aside = list(fresh.path.parent.glob(f"{fresh.path.name}.corrupt-*"))
    assert len(aside) == 1 and not fresh.path.exists()
    assert fresh.corpus.n_docs == 0
    drafter.finish(arr(1), arr(8, 9, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter.close()
    assert [d.tolist() for d in make_store().documents()] == [[8, 9, 10]]


def test_a_hand_made_store_with_an_unsorted_suffix_array_never_crashes_propose():
    store = store_with(*[list(range(i, i + 30)) for i in range(0, 300, 7)], [1, 2, 3] * 20)
    assert store.save()
    _reverse_the_suffix_array(store.path)
    drafter = SuffixDrafter(make_store(), factor=4)
    for ctx in ([1, 2, 3], [5, 6, 7], [1, 2], [299, 300], [3]):
        drafter.begin(arr(*ctx))
        draft = propose(drafter, ctx)
        assert draft.tokens.dtype == np.int32 and len(draft) <= 8


def test_a_store_of_another_tokenizer_under_this_name_is_set_aside():
    other = SuffixStore(store_path(data_dir(), FP), fingerprint=FP[:16] + "f" * 48)
    other.add(arr(1, 2, 3))
    assert other.save()
    with pytest.warns(SuffixStoreWarning, match="another tokenizer"):
        assert make_store().corpus.n_docs == 0


# -- concurrency and failing saves -------------------------------------------------------------------------------


def _writer(home: str, base: int, n: int) -> None:
    os.environ["SPECDEC_HOME"] = home
    store = make_store()
    _ = store.corpus  # loaded once: each save must notice the other process's writes and merge them
    for i in range(n):
        store.add(arr(base + i, base + i + 1, base + i + 2))
        assert store.save()
        if i % 2:  # a fresh process's view, too
            fresh = make_store()
            fresh.add(arr(base + 100 + i, 0, 0))
            assert fresh.save()


def test_two_concurrent_writers_both_keep_their_documents(tmp_path):
    home = os.environ["SPECDEC_HOME"]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(home, base, 8)) for base in (1000, 2000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    docs = {tuple(d.tolist()) for d in make_store().documents()}
    want = {(b + i, b + i + 1, b + i + 2) for b in (1000, 2000) for i in range(8)}
    want |= {(b + 100 + i, 0, 0) for b in (1000, 2000) for i in range(1, 8, 2)}
    assert docs == want


def test_a_save_merges_what_another_process_wrote_meanwhile():
    a, b = make_store(), make_store()
    _ = a.corpus, b.corpus  # both loaded the empty store
    a.add(arr(1, 2, 3))
    b.add(arr(4, 5, 6))
    assert a.save() and b.save()
    assert sorted(d.tolist() for d in make_store().documents()) == [[1, 2, 3], [4, 5, 6]]
    assert [d.tolist() for d in b.documents()] == [[1, 2, 3], [4, 5, 6]]  # b's memory is the merged store


def _save_into(directory: str, as_nobody: bool, results) -> None:
    import filelock  # noqa: F401  (imported before dropping privileges: nobody cannot read root's site-packages)

    if as_nobody:  # root ignores permissions: drop to nobody so the directory is really read-only
        os.setgid(65534)
        os.setuid(65534)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = SuffixStore(Path(directory) / f"{FP[:16]}.npz", fingerprint=FP)
        drafter = SuffixDrafter(store)
        propose(drafter, [1, 2, 1])
        drafter.finish(arr(1, 2), arr(4, 5, 6))
        try:
            drafter.close()
            error = None
        except Exception as e:  # the point of the test: there must be none
            error = repr(e)
    results.put((error, store.pending, [str(w.message) for w in caught if w.category is SuffixStoreWarning]))


def test_save_into_a_read_only_directory_warns_and_does_not_raise():
    import shutil
    import tempfile

    root = os.geteuid() == 0
    top = tempfile.mkdtemp(prefix="specdec-ro-")  # under /tmp: reachable by nobody when we are root
    try:
        os.chmod(top, 0o755)
        directory = Path(top) / "suffix"
        directory.mkdir()
        directory.chmod(0o555)
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        proc = ctx.Process(target=_save_into, args=(str(directory), root, results))
        proc.start()
        error, pending, messages = results.get(timeout=60)
        proc.join(60)
    finally:
        os.chmod(Path(top) / "suffix", 0o755)
        shutil.rmtree(top)
    assert error is None
    assert pending == 1  # kept in memory, not lost
    assert len(messages) == 1 and "Could not save the suffix store" in messages[0]
    assert "Permission denied" in messages[0]
    assert str(directory) in messages[0] and "writable" in messages[0] and "\n" not in messages[0]


@pytest.mark.parametrize(
    "target, code", [("os.replace", errno.EROFS), ("numpy.savez", errno.ENOSPC)], ids=["read-only-fs", "disk-full"]
)
def test_a_failing_save_warns_keeps_the_old_file_and_leaves_no_temp_file(monkeypatch, target, code):
    store = store_with([1, 2, 3])
    assert store.save()
    before = store.path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    store.add(arr(4, 5, 6))
    with monkeypatch.context() as patch:
        patch.setattr(target, fail)
        with pytest.warns(SuffixStoreWarning, match=f"{store.path}.*{os.strerror(code)}.*writable") as caught:
            assert store.save() is False
    assert len(str(caught[0].message).splitlines()) == 1
    assert store.path.read_bytes() == before
    assert not list(store.path.parent.glob(".*tmp*"))
    assert store.save()  # the documents were kept for a later attempt
    assert [d.tolist() for d in make_store().documents()] == [[1, 2, 3], [4, 5, 6]]


def test_save_when_the_data_dir_cannot_be_created_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = SuffixStore(blocker / "suffix" / f"{FP[:16]}.npz", fingerprint=FP)
    store.add(arr(1, 2, 3))
    with pytest.warns(SuffixStoreWarning, match="Could not save"):
        assert store.save() is False


# -- the cache commands ---------------------------------------------------------------------------------------------


@pytest.fixture
def runner():
    pytest.importorskip("typer")
    from typer.testing import CliRunner

    return CliRunner()


def _cache_app():
    from specdec_cli.cli.commands.cache import cache_app

    return cache_app


def test_cache_stats_export_and_clear(runner, tmp_path):
    app = _cache_app()
    result = runner.invoke(app, ["stats"])
    assert result.exit_code == 0, result.output
    store = store_with([1, 2, 3], [4, 5, 6, 7])
    assert store.save()
    result = runner.invoke(app, ["stats"])
    assert result.exit_code == 0, result.output
    assert f"{FP[:16]}.npz" in result.stdout and FP in result.stdout  # COLUMNS=120 (conftest): no folding
    assert "documents" in result.stdout and "size on disk" in result.stdout
    (store.path.parent / f"{OTHER_FP[:16]}.npz").write_bytes(b"junk")
    result = runner.invoke(app, ["stats"])
    assert result.exit_code == 0 and "unusable: not a store file" in result.stdout
    (store.path.parent / f"{OTHER_FP[:16]}.npz").unlink()

    out = tmp_path / "docs.jsonl"
    result = runner.invoke(app, ["export", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [[1, 2, 3], [4, 5, 6, 7]]
    assert {r["tokenizer"] for r in rows} == {FP} and [r["doc"] for r in rows] == [0, 1]

    result = runner.invoke(app, ["clear"], input="n\n")
    assert result.exit_code != 0 and store.path.exists()
    result = runner.invoke(app, ["clear", "--yes"])
    assert result.exit_code == 0, result.output
    assert not store.path.exists()


def test_cache_export_to_an_unwritable_path_is_a_usage_error(runner, tmp_path):
    from specdec_cli.errors import UsageError

    store_with([1, 2, 3]).save()
    result = runner.invoke(_cache_app(), ["export", str(tmp_path / "missing-dir" / "x.jsonl")])
    assert isinstance(result.exception, UsageError) and "Cannot write" in str(result.exception)


def test_cache_help_texts_end_with_examples(runner):
    app = _cache_app()
    for args in (["--help"], ["stats", "--help"], ["clear", "--help"], ["export", "--help"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0
        assert "Examples:" in result.stdout and "specdec cache" in result.stdout.split("Examples:")[1]


# -- through the engine (fake backend) ----------------------------------------------------------------------------


def test_through_the_engine_the_second_run_learns_from_the_first_and_output_stays_exact():
    from fakes import FakeBackend, greedy_reference, hashed_logits
    from specdec_cli.core.controller import FixedK
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.core.records import Step

    prompt = [5, 9, 3, 17, 4, 22, 8]
    reference = greedy_reference(hashed_logits, prompt, 40)
    accepted = []
    for _ in range(2):  # two runs, as two `specdec run` processes: a fresh store object each time
        drafter = SuffixDrafter(make_store(), factor=4)
        engine = SpeculativeEngine(FakeBackend(hashed_logits), drafter, FixedK(6))
        steps = [r for r in engine.generate(prompt, GenerationConfig(max_tokens=40)) if isinstance(r, Step)]
        drafter.close()
        assert [t for s in steps for t in s.emitted] == reference
        accepted.append(sum(s.n_accepted for s in steps))
    assert accepted[1] > accepted[0] and accepted[1] >= len(reference) - 8
    assert read_info(make_store().path).n_docs == 2
