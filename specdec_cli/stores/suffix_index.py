"""The suffix-array index of SuffixDecoding: drafting from past outputs by matching the end of the context.

SuffixDecoding (Oliaro, Jia, Campos, Qiao; "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975, 2024) drafts from a suffix tree over previous outputs: match the end of the
context, then follow the most frequent continuation. ArcticInference (Snowflake) keeps that tree in C++. Here the
tree is a suffix array over the concatenated documents, which is the tree's leaves in order: the occurrences of a
pattern are one contiguous range of the array, the children of the pattern's node are the runs of equal next
tokens inside that range, and a child's count is its run length. Lookups are binary searches (`bisect` over byte
strings, so the comparisons run in C) and a greedy walk over shrinking ranges; nothing is built at start-up, and
an added document is merged into the array by bisection, so it is searchable at once. Suffixes are sorted by
their first `WINDOW` (128) tokens, which bounds match length + draft length (the tree is depth-limited too).

The arrays of a `Corpus` (what `specdec_cli.stores.suffix_store` persists, one store per tokenizer):

    tokens   int32   [T]    the documents concatenated, each followed by the separator -1 (T = n_tokens + n_docs)
    offsets  int64   [D+1]  document i is tokens[offsets[i] : offsets[i+1] - 1]; offsets[0] = 0, offsets[D] = T
    added    float64 [D]    when each document was added (Unix seconds), oldest first
    sa       int32   [T]    suffix array: every position of `tokens`, sorted by the `window` tokens starting there
                            (compared as uint32, so the separator sorts after every token)

Pure: no files, no locks. `SuffixDrafter` drafts from it (and its local index over the prompt and output returns
the same `Continuation`s).
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

WINDOW = 128  # suffixes are sorted by their first WINDOW tokens: match length + draft length must stay below it
SEP = -1  # document separator in `tokens`; as uint32 it is 0xFFFFFFFF, after every real token
_SMALL = 24  # walk steps over at most this many occurrences count the children in a Python loop
_EXACT = 1024  # walk steps over at most this many occurrences count the children exactly
_SAMPLES = 128  # ... above, they sample this many occurrences and bisect the few candidate children


def _be_bytes(tokens: np.ndarray, width: int = 4) -> bytes:
    """int32 [n] -> width·n bytes, big-endian unsigned: bytes order = lexicographic token order (-1 sorts last).
    width 3 keeps the low 24 bits (the separator -1 becomes 0xFFFFFF, still after every token below it)."""
    be = np.asarray(tokens, dtype=np.int32).view(np.uint32).astype(">u4")
    return be.tobytes() if width == 4 else be.view(np.uint8).reshape(-1, 4)[:, 4 - width :].tobytes()


class PackedTokens:
    """Tokens stored big-endian in `width` bytes each (3: ids below 0xFFFFFF, the separator as 0xFFFFFF), read as
    int32 (the separator as -1): what `Corpus` needs of its `tokens` (len, slices, integer-array indexing) over a
    memory map of the packed bytes, without unpacking the whole array."""

    __slots__ = ("_u8", "width", "_sep")

    def __init__(self, data: bytes | memoryview, width: int = 3) -> None:
        self._u8 = np.frombuffer(data, dtype=np.uint8)  # [width·T]
        self.width = width
        self._sep = (1 << (8 * width)) - 1

    def __len__(self) -> int:
        return len(self._u8) // self.width

    @property
    def nbytes(self) -> int:
        return len(self._u8)

    def _unpack(self, rows: np.ndarray) -> np.ndarray:
        """uint8 [n, width] -> int32 [n]."""
        out = np.zeros(len(rows), dtype=np.int32)
        for j in range(self.width):
            out = (out << 8) | rows[:, j]
        out[out == self._sep] = SEP
        return out

    def __getitem__(self, index: slice | np.ndarray) -> np.ndarray:
        w = self.width
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("PackedTokens: slices with a step are not supported")
            return self._unpack(self._u8[w * start : w * max(start, stop)].reshape(-1, w))
        idx = np.asarray(index, dtype=np.int64)
        flat = idx.reshape(-1)
        flat = np.where(flat < 0, flat + len(self), flat)
        rows = self._u8[(w * flat)[:, None] + np.arange(w)]  # [n, width]
        return self._unpack(rows).reshape(idx.shape)


def suffix_array(tokens: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Positions of `tokens` (int32 [T]) sorted by the `window` tokens starting at each (prefix doubling).

    Tokens compare as uint32 (the separator -1 last); a suffix that ends early sorts before its extensions. Ties
    beyond `window` tokens keep position order. Returns int32 [T]. O(T log T log window) with numpy sorts,
    so repetitive text (long equal prefixes) is not compared token by token.
    """
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    key = np.asarray(tokens, dtype=np.int32).view(np.uint32).astype(np.int64)
    sa = np.argsort(key, kind="stable")
    rank, n_ranks = _dense_ranks(key, sa)
    h = 1  # invariant: `rank` orders positions by their first h tokens
    while h < window and n_ranks < n:
        following = np.zeros(n, dtype=np.int64)  # rank of the h tokens after; 0 past the end (sorts first)
        following[: n - h] = rank[h:]
        key = rank * (n + 1) + following
        sa = np.argsort(key, kind="stable")
        rank, n_ranks = _dense_ranks(key, sa)
        h *= 2
    return sa.astype(np.int32)


def _dense_ranks(key: np.ndarray, sa: np.ndarray) -> tuple[np.ndarray, int]:
    """1-based dense ranks (int64 [n]) of `key` given its sorting permutation `sa`, and the number of ranks."""
    ks = key[sa]
    new = np.empty(len(ks), dtype=bool)
    new[0] = True
    np.not_equal(ks[1:], ks[:-1], out=new[1:])
    sorted_rank = np.cumsum(new)
    rank = np.empty(len(ks), dtype=np.int64)
    rank[sa] = sorted_rank
    return rank, int(sorted_rank[-1])


@dataclass(frozen=True, slots=True)
class Continuation:
    """A drafted continuation and the evidence behind it (from the local or the global structure).

    Attributes:
        tokens: int32 [k'] the continuation, most frequent child first to last.
        probs: float64 [k'] each token's empirical probability given the path before it (count / parent count).
        match_len: how many context tokens matched (the length of the matched suffix).
        n_occurrences: how many times the matched suffix occurs (the root count of the walk).
        first_count: how many of those occurrences continue with tokens[0].
        source: "local" (this prompt and output) or "global" (the store).
    """

    tokens: np.ndarray
    probs: np.ndarray
    match_len: int
    n_occurrences: int
    first_count: int
    source: str

    @property
    def score(self) -> float:
        """Expected number of accepted tokens: the sum of the path probabilities prod(probs[:i+1])."""
        total, path = 0.0, 1.0
        for p in self.probs.tolist():
            path *= p
            total += path
        return total

    @property
    def confidence(self) -> float:
        """0..1 confidence in the first token: first_count / (n_occurrences + 1), its empirical probability with one
        pseudo-observation of "something else", so a continuation seen once scores 0.5 and 9 times of 9 scores 0.9."""
        return self.first_count / (self.n_occurrences + 1) if len(self.tokens) else 0.0


def empty_continuation(source: str) -> Continuation:
    return Continuation(np.zeros(0, np.int32), np.zeros(0, np.float64), 0, 0, 0, source)


class Corpus:
    """An immutable set of documents with its suffix array (see the module docstring for the arrays).

    Build one with `Corpus.build(docs)`; `with_documents` and `evicted` return new corpora. Lookups build the
    big-endian byte string of `tokens` (4T bytes) lazily, so a store of 300k tokens costs ~4 MB in memory (12 bytes
    per token). A suffix array that is not sorted (a hand-made file) gives poor drafts, never an exception.
    A learnt corpus (`specdec_cli.stores.corpus`) is read with `width` 3: its `tokens` a `PackedTokens` and its
    byte string the 3-byte map itself; `with_documents` and `evicted` are for in-memory (width 4) corpora only.
    """

    __slots__ = ("tokens", "offsets", "added", "sa", "_buf", "_sav", "width")

    def __init__(
        self, tokens: np.ndarray | PackedTokens, offsets: np.ndarray, added: np.ndarray, sa: np.ndarray, width: int = 4
    ) -> None:
        self.tokens = tokens  # int32 [T] (or a PackedTokens read as int32)
        self.width = width  # bytes a token in the lookups' byte string (`_buf`): 4, or 3 (`PackedTokens`)
        self.offsets = offsets  # int64 [D+1]
        self.added = added  # float64 [D]
        self.sa = sa  # int32 [T]
        self._buf: bytes | None = None
        self._sav: memoryview | None = None

    @classmethod
    def empty(cls) -> Corpus:
        z = np.zeros(0, dtype=np.int32)
        return cls(z, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.float64), z)

    @classmethod
    def build(cls, docs: Sequence[np.ndarray], added: Sequence[float] | None = None) -> Corpus:
        """A corpus of `docs` (each int32 [n_i], token ids >= 0), oldest first; `added` defaults to now."""
        tokens, offsets = _concat(docs)
        when = np.full(len(docs), time.time()) if added is None else np.asarray(added, dtype=np.float64)
        return cls(tokens, offsets, when, suffix_array(tokens))

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        """Document tokens (separators not counted)."""
        return len(self.tokens) - self.n_docs

    @property
    def nbytes(self) -> int:
        """Memory of the arrays and of the lookup views built so far, in bytes."""
        views = len(self._buf) if self._buf is not None else 0
        return self.tokens.nbytes + self.offsets.nbytes + self.added.nbytes + self.sa.nbytes + views

    def document(self, i: int) -> np.ndarray:
        """int32 [n_i]: document i (0 = oldest), a view."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1] - 1]

    def documents(self) -> Iterator[np.ndarray]:
        for i in range(self.n_docs):
            yield self.document(i)

    # -- updates ------------------------------------------------------------------------------------------------

    def with_documents(self, docs: Sequence[np.ndarray], added: Sequence[float]) -> Corpus:
        """A new corpus with `docs` appended (newest last). The suffix array is merged, not rebuilt: the new
        suffixes are sorted and bisected into the old array (O(new · log T) comparisons), unless the new part is
        large (> 1/8 of the old), where one rebuild is cheaper."""
        if not docs:
            return self
        new_tokens, new_offsets = _concat(docs)
        t_old = len(self.tokens)
        tokens = np.concatenate([self.tokens, new_tokens])
        offsets = np.concatenate([self.offsets, t_old + new_offsets[1:]])
        when = np.concatenate([self.added, np.asarray(added, dtype=np.float64)])
        if t_old == 0 or len(new_tokens) * 8 > t_old:
            return Corpus(tokens, offsets, when, suffix_array(tokens))
        buf = _be_bytes(tokens)
        w4 = 4 * WINDOW

        def key(p: int) -> bytes:
            return buf[4 * p : 4 * p + w4]

        # The old order stays valid: appending only changes what follows the old last separator, and no pattern
        # or walk ever looks past a separator.
        new_pos = sorted(range(t_old, len(tokens)), key=key)
        old = self._sa_view()
        points = [bisect_right(old, key(p), key=key) for p in new_pos]
        sa = np.insert(self.sa, points, np.asarray(new_pos, dtype=np.int32))
        out = Corpus(tokens, offsets, when, sa)
        out._buf = buf
        return out

    def evicted(self, max_tokens: int) -> Corpus:
        """A corpus without the oldest documents, holding at most `max_tokens` document tokens."""
        if self.n_tokens <= max_tokens:
            return self
        lens = np.diff(self.offsets) - 1
        from_end = np.cumsum(lens[::-1])[::-1]  # tokens in documents i..D-1
        first = int(np.searchsorted(-from_end, -max_tokens, side="left"))  # first i with from_end[i] <= max
        cut = int(self.offsets[first])
        sa = self.sa[self.sa >= cut] - cut  # dropping a prefix keeps the order of the rest
        return Corpus(self.tokens[cut:].copy(), self.offsets[first:] - cut, self.added[first:].copy(), sa)

    # -- lookups ------------------------------------------------------------------------------------------------

    def _bytes(self) -> bytes:
        if self._buf is None:  # (a packed corpus comes with its bytes: `tokens` is an array here)
            self._buf = _be_bytes(cast(np.ndarray, self.tokens), self.width)
        return self._buf

    def _sa_view(self) -> memoryview:
        """`sa` as a memoryview: `bisect` indexes it in C and gets Python ints (no copy)."""
        if self._sav is None:
            self.sa = np.ascontiguousarray(self.sa, dtype=np.int32)
            self._sav = memoryview(cast(Any, self.sa))  # (numpy's arrays are buffers; its stubs do not say so)
        return self._sav

    def longest_match(
        self, context: np.ndarray, max_depth: int, upper: int | None = None, min_count: int = 1
    ) -> tuple[int, int, int]:
        """The longest suffix of `context` (int32 [n]) that occurs in the corpus at least `min_count` times, at most
        `max_depth` tokens.

        Returns (m, lo, hi): the match length and the range sa[lo:hi] of its occurrences (0, 0, 0 when not even
        the last token occurs so often). A binary search over m (a suffix of a pattern occurs at least as often as
        the pattern), each probe a `bisect` of the suffix array (log2 T comparisons; the count is one more
        comparison, the occurrences being contiguous). `upper`, a known bound on m, saves probes: when the context
        grew by `a` tokens since a lookup that matched m' tokens (with the same `min_count`), m <= m' + a, and
        m = m' + a is probed first (it holds while the output keeps copying a stored document).
        """
        top = min(len(context), max_depth, WINDOW - 1)
        if upper is not None:
            top = min(top, upper)
        w = self.width
        if w < 4 and top > 0:  # an id too wide for the packed tokens occurs nowhere: the match starts after it
            wide = np.flatnonzero(np.asarray(context[len(context) - top :]).view(np.uint32) >= (1 << (8 * w)) - 1)
            top = top - 1 - int(wide[-1]) if len(wide) else top
        if top <= 0 or len(self.tokens) == 0:
            return 0, 0, 0
        buf, sav = self._bytes(), self._sa_view()
        tail = _be_bytes(context[len(context) - top :], w)
        n = len(sav)

        last = max(min_count, 1) - 1

        def find(m: int) -> int:  # the first occurrence of the last m tokens, -1: fewer than min_count of them
            pat, size = tail[w * (top - m) :], w * m
            lo = bisect_left(sav, pat, key=lambda p: buf[w * p : w * p + size])
            at = lo + last
            return lo if at < n and buf[w * sav[at] : w * sav[at] + size] == pat else -1

        best_m, best_lo, lo_m, hi_m = 0, 0, 1, top
        if upper is not None and top > 1:  # try the bound first
            at = find(top)
            if at >= 0:
                best_m, best_lo, lo_m = top, at, top + 1
            else:
                hi_m = top - 1
        while lo_m <= hi_m:
            mid = (lo_m + hi_m) // 2
            at = find(mid)
            if at < 0:
                hi_m = mid - 1
            else:
                best_m, best_lo, lo_m = mid, at, mid + 1
        if best_m == 0:
            return 0, 0, 0
        pat, size = tail[w * (top - best_m) :], w * best_m
        hi = bisect_right(sav, pat, lo=best_lo, key=lambda p: buf[w * p : w * p + size])
        return best_m, best_lo, hi

    def walk(self, lo: int, hi: int, depth: int, max_len: int, min_prob: float) -> Continuation:
        """Follow the most frequent child from the node sa[lo:hi] at `depth` (= the match length).

        Stops after `max_len` tokens, at a document end, or when the best child's count / parent count falls below
        `min_prob`. Ties go to the child seen in the most recent document. Returns a "global" `Continuation`.
        """
        tokens, sa = self.tokens, self.sa
        n_occ, first_count, match_len = hi - lo, 0, depth
        out: list[int] = []
        probs: list[float] = []
        max_len = min(max_len, WINDOW - depth)  # runs are sorted only within the first WINDOW tokens
        while len(out) < max_len and hi > lo:
            if hi - lo == 1:  # one occurrence left: copy up to its document's end, probability 1 each
                p = int(sa[lo]) + depth
                rest = tokens[p : p + max_len - len(out)]
                stop = np.flatnonzero(rest == SEP)
                rest = rest[: stop[0]] if len(stop) else rest
                if len(rest) and not out:
                    first_count = 1
                out.extend(rest.tolist())
                probs.extend([1.0] * len(rest))
                break
            child = self._best_child(lo, hi, depth, min_prob)
            if child is None:
                break
            tok, a, b = child
            if not out:
                first_count = b - a
            out.append(tok)
            probs.append((b - a) / (hi - lo))
            lo, hi, depth = a, b, depth + 1
        tokens_out, probs_out = np.asarray(out, dtype=np.int32), np.asarray(probs, dtype=np.float64)
        return Continuation(tokens_out, probs_out, match_len, n_occ, first_count, "global")

    def _best_child(self, lo: int, hi: int, depth: int, min_prob: float) -> tuple[int, int, int] | None:
        """The most frequent next token after the node sa[lo:hi] (all sharing their first `depth` tokens) and its
        range (token, a, b), or None when no child reaches count / parent count >= min_prob.

        The next tokens of a node are sorted, so the children are runs. Up to `_EXACT` occurrences the runs are
        measured directly. Above, `_SAMPLES` evenly spaced occurrences are read: a run of fraction f gets
        f·S ± 1 samples, so the largest run is among those within 2 samples of the most sampled, and those few
        candidates are measured exactly by bisection, so a step's cost does not grow with a node's occurrences.
        """
        tokens, sa, n = self.tokens, self.sa, hi - lo
        last = len(tokens) - 1  # a separator; the clamp only matters for an unsorted (hand-made) suffix array
        if n <= _SMALL:  # a few occurrences: a Python loop beats a dozen numpy calls
            pos_l = sa[lo:hi].tolist()
            nxt_l = tokens[np.minimum(sa[lo:hi] + depth, last)].tolist()
            best, best_i, best_pos, i = 0, -1, -1, 0
            while i < n:
                j, tok, newest = i, nxt_l[i], pos_l[i]
                while j + 1 < n and nxt_l[j + 1] == tok:
                    j += 1
                    newest = max(newest, pos_l[j])
                if tok != SEP and (j + 1 - i, newest) > (best, best_pos):
                    best, best_i, best_pos = j + 1 - i, i, newest
                i = j + 1
            if best == 0 or best < min_prob * n:
                return None
            return nxt_l[best_i], lo + best_i, lo + best_i + best
        if n <= _EXACT:
            pos = sa[lo:hi]  # [n] occurrences of the path
            nxt = tokens[np.minimum(pos + depth, last)]  # [n] their next tokens, sorted: the children are runs
            starts = np.flatnonzero(nxt[1:] != nxt[:-1]) + 1
            starts = np.concatenate((np.zeros(1, dtype=starts.dtype), starts))
            counts = np.diff(starts, append=n)
            counts[nxt[starts] == SEP] = 0  # documents ending here are not a continuation
            best = int(counts.max())
            if best == 0 or best < min_prob * n:
                return None
            ties = np.flatnonzero(counts == best)
            i = int(ties[0])
            if len(ties) > 1:  # most recent document wins (documents are appended: larger position = newer)
                i = int(ties[np.argmax(np.maximum.reduceat(pos, starts)[ties])])
            a = lo + int(starts[i])
            return int(nxt[starts[i]]), a, a + best
        idx = lo + (np.arange(_SAMPLES, dtype=np.int64) * n) // _SAMPLES
        vals, hits = np.unique(tokens[np.minimum(sa[idx].astype(np.int64) + depth, last)], return_counts=True)
        hits[vals == SEP] = 0
        top = int(hits.max())
        if top == 0 or (top + 1) < min_prob * _SAMPLES:  # every child's fraction is < (top + 1) / S < min_prob
            return None
        near = (hits >= top - 2) & (vals != SEP)
        cands = vals[near][np.argsort(-hits[near], kind="stable")[:8]]  # at most 8, the most sampled first
        buf, sav, w = self._bytes(), self._sa_view(), self.width
        path = buf[w * sav[lo] : w * sav[lo] + w * depth]
        size = w * (depth + 1)

        def key(p: int) -> bytes:
            return buf[w * p : w * p + size]

        runs = []
        for tok in cands.tolist():
            pat = path + tok.to_bytes(w, "big")
            a = bisect_left(sav, pat, lo, hi, key=key)
            runs.append((tok, a, bisect_right(sav, pat, a, hi, key=key)))
        best = max(b - a for _, a, b in runs)
        if best == 0 or best < min_prob * n:
            return None
        tied = [r for r in runs if r[2] - r[1] == best]
        if len(tied) > 1:  # most recent document wins
            return max(tied, key=lambda r: int(sa[r[1] : r[2]].max()))
        return tied[0]


def _concat(docs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> (tokens int32 [T] with a separator after each, offsets int64 [D+1])."""
    lens = np.array([len(d) + 1 for d in docs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.full(int(offsets[-1]), SEP, dtype=np.int32)
    for d, start in zip(docs, offsets[:-1], strict=True):
        tokens[start : start + len(d)] = d
    return tokens, offsets
