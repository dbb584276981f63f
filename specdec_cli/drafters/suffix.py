"""The learning drafter: SuffixDecoding (`--method suffix`).

Oliaro, Jia, Campos, Qiao. "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
arXiv 2411.04975, 2024; the ArcticInference suffix tree (Snowflake) is the reference implementation.

Each step, for two structures:

* local: the current prompt + output, indexed incrementally as the context grows (`LocalIndex`);
* global: past outputs of this tokenizer, persisted across runs (`specdec_cli.stores.suffix_store.SuffixStore`);

find the longest suffix of the context (at most `max_depth` tokens) that occurs in the structure, then walk the
most frequent continuation: take the child with the largest count while count / parent count >= `min_token_prob`,
for at most min(k, ceil(factor × match length)) tokens. The draft with the longer match wins (a past output that
matches the last 60 tokens beats the prompt's original text matching the last 20: the reply is repeating itself,
not its input); equal matches go to the higher score (expected accepted tokens: the sum of the path
probabilities), then to the local one. Each output is stored after the last `lead_in` tokens of its prompt and
with the end-of-generation token that ended it, so the opening and the end of a reply are learnt too. Drafts are
deterministic (`dists=None`: verification treats q as one-hot) and cost a small fraction of a target pass per step,
even from a large store (`benchmarks/bench_suffix.py` times it).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.core.draft import EMPTY, Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.drafters.edits import CopyEdits
from specdec_cli.stores.suffix_index import WINDOW, Continuation, empty_continuation
from specdec_cli.stores.suffix_store import SuffixStore

if TYPE_CHECKING:
    from specdec_cli.core.sampling import SamplingParams

_CHECK = 64  # tokens compared to detect a context that does not extend the indexed one
REALIGN_MATCH = 8  # the evidence of a realigned copy's guess right after an edit (`CopyEdits.draft`)
EDIT_ANCHOR = 4  # a unique local match this long into the prompt aligns the learnt edits' copy pointer


class LocalIndex:
    """Longest-suffix-match index over one growing token sequence (the prompt + output so far).

    Keeps the sequence (int32, amortised doubling) and, per unigram and bigram, the list of end positions where
    it occurs. Extending by n tokens costs O(n) dict appends; nothing is rescanned. A lookup takes the most recent
    `max_candidates` earlier occurrences of the last bigram (else of the last token) and measures how far each
    matches backwards, vectorised over [candidates, max_depth].
    """

    def __init__(self, max_candidates: int = 512) -> None:
        self.max_candidates = max_candidates
        self.clear()

    def clear(self) -> None:
        self.buf = np.zeros(256, dtype=np.int32)
        self.n = 0
        self.uni: dict[int, list[int]] = {}  # token -> positions i with buf[i] == token
        self.bi: dict[int, list[int]] = {}  # (a << 32 | b) -> positions i with buf[i-1:i+1] == (a, b)

    @property
    def tokens(self) -> np.ndarray:
        """int32 [n]: the indexed sequence (a view)."""
        return self.buf[: self.n]

    def sync(self, context: np.ndarray) -> bool:
        """Index `context` (int32 [n]): append what is new, or start over when it does not extend what is indexed
        (checked on the last 64 indexed tokens). Returns False when it started over."""
        n = self.n
        lo = max(0, n - _CHECK)
        extended = True
        if len(context) < n or not np.array_equal(context[lo:n], self.buf[lo:n]):
            self.clear()
            n, extended = 0, False
        if len(context) > n:
            self.extend(context[n:])
        return extended

    def extend(self, new: np.ndarray) -> None:
        """Append int32 [m] tokens and index them: O(m)."""
        m, n = len(new), self.n
        if n + m > len(self.buf):
            grown = np.zeros(max(2 * len(self.buf), n + m), dtype=np.int32)
            grown[:n] = self.buf[:n]
            self.buf = grown
        self.buf[n : n + m] = new
        uni, bi = self.uni, self.bi
        prev = int(self.buf[n - 1]) if n else -1
        for i, t in enumerate(self.buf[n : n + m].tolist(), start=n):
            if (lst := uni.get(t)) is None:
                uni[t] = [i]
            else:
                lst.append(i)
            if prev >= 0:
                key = (prev << 32) | t
                if (lst := bi.get(key)) is None:
                    bi[key] = [i]
                else:
                    lst.append(i)
            prev = t
        self.n = n + m

    def longest_match(self, max_depth: int) -> tuple[int, np.ndarray]:
        """The longest suffix of the sequence (<= max_depth tokens) that also ends at an earlier position.

        Returns (m, ends): the match length and int64 [c] the end positions of its earlier occurrences, ascending
        (m = 0 and an empty array when the last token never occurred before).
        """
        n, buf = self.n, self.buf
        none = (0, np.zeros(0, dtype=np.int64))
        if n < 2 or max_depth < 1:
            return none
        last = int(buf[n - 1])
        ends = self.bi.get((int(buf[n - 2]) << 32) | last) if n >= 3 and max_depth >= 2 else None
        if ends is None or len(ends) < 2:
            ends = self.uni[last]
            if len(ends) < 2:
                return none
        c = np.asarray(ends[-self.max_candidates - 1 : -1], dtype=np.int64)  # [c] earlier ends (the last is n-1)
        depth = min(max_depth, n - 1)
        lengths = np.zeros(len(c), dtype=np.int64)  # [c] match length of each candidate
        alive = np.arange(len(c))  # candidates that matched every position compared so far
        start, width = 0, 8
        while len(alive) and start < depth:  # compare 8 positions back, then the rest for those still matching
            end = min(depth, start + width)
            back = np.arange(start, end)
            idx = c[alive, None] - back  # [alive, width] positions compared with buf[n-1-back]
            eq = (buf[np.maximum(idx, 0)] == buf[n - 1 - back]) & (idx >= 0)
            full = eq.all(axis=1)
            lengths[alive] = np.where(full, end, start + eq.argmin(axis=1))
            alive, start, width = alive[full], end, depth
        m = int(lengths.max())
        return m, c[lengths == m]

    def walk(
        self, ends: np.ndarray, match_len: int, max_len: int, min_prob: float, second: bool = False
    ) -> Continuation:
        """Follow the most frequent continuation after the occurrences ending at `ends` (int64 [c], ascending).

        Same rule as the global walk: stop after `max_len` tokens, when every occurrence has run into the end of the
        sequence, or when count / parent count < `min_prob`. Ties go to the most recent occurrence.

        second: instead, the runner-up: the same path up to the first position where the occurrences part ways,
        then the second most frequent token there (the most recent among equals), then the most frequent again; an
        empty continuation where they never part. A second candidate for the same pass (`KController.branch`).
        """
        n, buf = self.n, self.buf
        nxt = ends + 1  # [c] positions of the next token of each occurrence of the path
        n_occ, first_count = len(nxt), 0
        out: list[int] = []
        probs: list[float] = []
        while len(out) < max_len:
            live = nxt[nxt < n]  # occurrences that run into the end of the sequence stop here
            if len(live) == 0:
                break
            if len(nxt) == 1:  # one occurrence: copy, probability 1 each
                if second:
                    return empty_continuation("local")
                p = int(live[0])
                rest = buf[p : min(n, p + max_len - len(out))].tolist()
                first_count = first_count or 1
                out.extend(rest)
                probs.extend([1.0] * len(rest))
                break
            vals = buf[live]  # [live] next tokens, oldest occurrence first
            if len(live) <= 24:  # few occurrences: count in Python
                seq = vals.tolist()
                counts: dict[int, int] = {}
                for t in seq:
                    counts[t] = counts.get(t, 0) + 1
                best = max(counts.values())
                tok = next(t for t in reversed(seq) if counts[t] == best)  # most recent of the most frequent
                if second and len(counts) > 1:  # the first parting: the runner-up, then the usual walk
                    best = max(c for t, c in counts.items() if t != tok)
                    tok = next(t for t in reversed(seq) if t != tok and counts[t] == best)
                    second = False
            else:
                uniq, inv, cnt = np.unique(vals, return_inverse=True, return_counts=True)
                best = int(cnt.max())
                tok = int(vals[np.flatnonzero(cnt[inv] == best)[-1]])  # most recent among the most frequent
                if second and len(uniq) > 1:  # the first parting: the runner-up, then the usual walk
                    cnt = np.where(uniq == tok, 0, cnt)
                    best = int(cnt.max())
                    tok = int(vals[np.flatnonzero(cnt[inv] == best)[-1]])
                    second = False
            if best / len(nxt) < min_prob:
                break
            if not out:
                first_count = best
            out.append(tok)
            probs.append(best / len(nxt))
            nxt = live[vals == tok] + 1
        if second:  # never parted
            return empty_continuation("local")
        tokens_out, probs_out = np.asarray(out, dtype=np.int32), np.asarray(probs, dtype=np.float64)
        return Continuation(tokens_out, probs_out, match_len, n_occ, first_count, "local")


class SuffixDrafter(DrafterBase):
    """SuffixDecoding drafter (`--method suffix`): longest suffix match over this generation and past outputs.

    Args:
        store: the global store of past outputs (None = local matching only). Loaded lazily on the first propose.
        max_depth: longest context suffix matched, in tokens (1..127).
        factor: draft length cap per matched token: a draft has at most min(k, ceil(factor × match length)) tokens.
            4 by default: under `--k auto` the controller trims every draft by the acceptance measured for its match
            length, so the cap only needs to stop a very short match from proposing a long guess.
        min_token_prob: stop the walk when the best child's empirical probability (count / parent count) is below.
        store_prompt: also add the prompt to the store in `finish` (default: outputs only, as in the paper).
        lead_in: each output is stored after the last `lead_in` tokens of its prompt (the chat template's assistant
            header, "<|im_start|>assistant\n"), so the opening of a reply is learnt too, not only what follows it.
        max_candidates: most recent earlier occurrences examined by the local lookup.
        preload: start reading the store file in a background thread now (`SuffixStore.preload`).

    `propose` is cheap beside a target pass (`benchmarks/bench_suffix.py`). `Draft.score` is the
    `Continuation.confidence` of the chosen draft (0..1, first_count / (occurrences + 1)), comparable with a draft
    model's first-token probability. `last` holds the chosen `Continuation` of the latest propose (for stats).
    """

    name = "suffix"

    def __init__(
        self,
        store: SuffixStore | None = None,
        *,
        max_depth: int = 64,
        factor: float = 4.0,
        min_token_prob: float = 0.1,
        store_prompt: bool = False,
        lead_in: int = 8,
        max_candidates: int = 512,
        preload: bool = True,
    ) -> None:
        if not 1 <= max_depth < WINDOW:
            raise ValueError(f"max_depth must be in 1..{WINDOW - 1}, got {max_depth}")
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in 0..1, got {min_token_prob}")
        self.store = store
        self.max_depth = max_depth
        self.factor = factor
        self.min_token_prob = min_token_prob
        self.store_prompt = store_prompt
        self.lead_in = max(0, int(lead_in))
        self.local = LocalIndex(max_candidates)
        self.last: Continuation | None = None
        self._hint: tuple[object, int, int] | None = None  # (corpus, context length, global match length)
        self.edits = CopyEdits()  # the reply's copy of the prompt and the edits it repeats (`more` lookups only)
        if store is not None and preload:
            store.preload()  # read the file while the models load; the first propose waits for it

    def fork(self) -> SuffixDrafter:
        """The same store (what any sequence learns, every sequence drafts from), a prompt index and edits of its
        own."""
        return SuffixDrafter(
            self.store,
            max_depth=self.max_depth,
            factor=self.factor,
            min_token_prob=self.min_token_prob,
            store_prompt=self.store_prompt,
            lead_in=self.lead_in,
            max_candidates=self.local.max_candidates,
            preload=False,
        )

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """Start a generation: index the prompt (int32 [n]) afresh and collect the store, so the engine counts both
        as drafter prefill time instead of slowing the first step."""
        self.local.clear()
        self.last = None
        self._hint = None
        self.local.sync(context)
        self.edits.begin(context)
        if self.store is not None:
            _ = self.store.corpus  # the property loads it

    def _max_len(self, k: int, match_len: int) -> int:
        return min(k, math.ceil(self.factor * match_len))

    def continuations(self, context: np.ndarray, k: int, *, more: bool = False) -> tuple[Continuation, ...]:
        """The local (this prompt and output) and the global (the store of past outputs) continuation after
        `context` (int32 [n]), each up to k tokens (empty when nothing matched). With `more`, two further local
        candidates for the same step: the runner-up where the prompt's occurrences of the context part ways
        (`LocalIndex.walk(second=True)`), and the realigned copy (`CopyEdits.draft`: the reply's copy of the prompt
        followed past its edits, the learnt ones applied ahead). Returns 2 or 4 continuations."""
        extended = self.local.sync(context)
        if more:
            if extended:
                self.edits.update(context)
            else:
                self.edits.begin(context)
        local = glob = alt = realigned = empty_continuation("local")
        m, ends = self.local.longest_match(self.max_depth)
        if m:
            local = self.local.walk(ends, m, self._max_len(k, m), self.min_token_prob)
            if more:
                alt = self.local.walk(ends, m, self._max_len(k, m), self.min_token_prob, second=True)
        if more:
            if m >= EDIT_ANCHOR and len(ends) == 1:
                self.edits.anchor(int(ends[0]) + 1)
            local, alt = self._edited(local), self._edited(alt)
            copy = self.edits.draft(k)  # past every edit so far, the learnt ones applied ahead
            if len(copy) and not np.array_equal(copy, local.tokens[: len(copy)]):
                # its evidence: the run since the copy re-synced, or, re-syncing, a guess's
                run = REALIGN_MATCH if self.edits.src is None else max(1, min(self.edits.run, self.max_depth))
                realigned = Continuation(copy, np.ones(len(copy)), run, 1, 1, "local")
        if self.store is not None:
            corpus = self.store.corpus
            upper = None  # m <= previous m + tokens added, while the store and the generation are the same
            if extended and self._hint is not None and self._hint[0] is corpus and self._hint[1] <= len(context):
                upper = self._hint[2] + len(context) - self._hint[1]
            m, lo, hi = corpus.longest_match(context, self.max_depth, upper)
            self._hint = (corpus, len(context), m)
            if m:
                glob = corpus.walk(lo, hi, m, self._max_len(k, m), self.min_token_prob)
        return (local, glob, alt, realigned) if more else (local, glob)

    def _edited(self, c: Continuation) -> Continuation:
        """`c` with the learnt replacements applied (`CopyEdits.apply`): a renamed word drafted as renamed."""
        tokens = self.edits.apply(c.tokens)
        return c if tokens is c.tokens else replace(c, tokens=tokens, probs=c.probs[: len(tokens)])

    def draft(self, c: Continuation, source: Source) -> Draft:
        """A continuation as a deterministic draft (with its evidence) labelled `source`."""
        if not len(c.tokens):
            return Draft(tokens=EMPTY, dists=None, score=0.0, source=source)
        return Draft(
            tokens=c.tokens, dists=None, score=c.confidence, source=source, match_len=c.match_len, probs=c.probs
        )

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Draft up to k tokens after `context` (int32 [n]); deterministic, `sampling` and `rng` are unused."""
        best, glob = self.continuations(context, k)
        if (glob.match_len, glob.score) > (best.match_len, best.score):
            best = glob
        self.last = best
        return self.draft(best, Source.store if best is glob else Source.prompt)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        """Add the output, after the last `lead_in` prompt tokens (and the whole prompt when `store_prompt`), to
        the global store; written at `close`. `output` ends with the end-of-generation token when there was one."""
        if self.store is None:
            return
        if self.store_prompt:
            self.store.add(prompt)
        lead = prompt[len(prompt) - min(self.lead_in, len(prompt)) :]  # the assistant header: replies' openings
        self.store.add(np.concatenate((lead, output)).astype(np.int32))

    def save(self) -> None:
        """Save the store (a failure is a `SuffixStoreWarning`, never an exception)."""
        if self.store is not None:
            self.store.save()

    def close(self) -> None:
        """Save the store (a failure is a `SuffixStoreWarning`, never an exception)."""
        self.save()
