"""The corpus as a draft source (`--method auto`): what `specdec learn` indexed, drafted from REST-style.

REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding"): find the longest suffix of the context that
occurs in the datastore (a suffix array over the corpus's tokens, binary search), then follow its continuations,
weighed by how often each follows there: the most frequent child while count / parent count >= `min_token_prob`.
The corpus index (`specdec_cli.stores.corpus`) is read through the suffix store's `Corpus` over memory maps, so
the lookup and the walk are the suffix store's (`Corpus.longest_match`, `Corpus.walk`), cheap beside a target pass.

A match of a token or two in a corpus of millions is noise (every `(` is followed by something): drafts need a
match of at least `min_match` tokens. And a longer match found once is one file's words, which the model rarely
repeats (a continuation seen once or twice is right far less often than one seen several times): so the match is the
longest suffix found at least `min_count` times, and the draft is what at least `min_follow` of its occurrences go on
with (an idiom, not one file's arguments), unless the match is `copy_match` tokens long (the output is copying a file).
The controller learns the source's acceptance by match length like any other (`Source.corpus`), and verifies a draft
only where it pays. Drafts are copied from the corpus: they never look at the target's logits, so the output is the
target's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.core.draft import EMPTY, Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.stores.suffix_index import WINDOW, Continuation, Corpus, empty_continuation

if TYPE_CHECKING:
    from specdec_cli.core.sampling import SamplingParams
    from specdec_cli.stores.corpus import CorpusSet


class CorpusDrafter(DrafterBase):
    """Drafts from the learnt corpora of the target's tokenizer (`CorpusSet`: every one, or the one named).

    Args:
        corpora: the corpora to read; `begin` maps those written since the last generation.
        max_depth: longest context suffix matched, in tokens.
        min_match: shortest match that drafts.
        factor: a draft has at most min(k, ceil(factor × match length)) tokens.
        min_token_prob: the walk stops where the most frequent continuation is rarer than this.
        min_count: a match shorter than `copy_match` counts when it occurs this often (else a shorter suffix that does).
        min_follow: the draft stops where fewer occurrences than this go on.
        copy_match: a match this long is a copy of its file, drafted on whatever its count.
    """

    name = Source.corpus

    def __init__(
        self,
        corpora: CorpusSet,
        *,
        max_depth: int = 64,
        min_match: int = 3,
        factor: float = 4.0,
        min_token_prob: float = 0.1,
        min_count: int = 3,
        min_follow: int = 2,
        copy_match: int = 16,
    ) -> None:
        if not 1 <= max_depth < WINDOW:
            raise ValueError(f"max_depth must be in 1..{WINDOW - 1}, got {max_depth}")
        if not 1 <= min_follow <= min_count:
            raise ValueError(f"need 1 <= min_follow <= min_count, got {min_follow} and {min_count}")
        self.corpora = corpora
        self.max_depth, self.min_match, self.factor, self.min_token_prob = max_depth, min_match, factor, min_token_prob
        self.min_count, self.min_follow, self.copy_match = min_count, min_follow, copy_match
        self._hints: dict[int, tuple[int, int]] = {}  # id(corpus) -> (context length, match length) at the last step

    def fork(self) -> CorpusDrafter:
        """The same corpora, hints of its own."""
        other = copy.copy(self)
        other._hints = {}
        return other

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """A generation starts: map the corpora learnt since the last one (a stat per corpus)."""
        self.corpora.refresh()
        self._hints = {}

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """The continuation of `context`'s suffix (int32 [n]) in the corpora, up to k tokens (`_lookup`; across
        corpora the stronger kind wins, then the longer match, then the higher expected accepted length); empty
        below `min_match`."""
        best, best_key = None, None
        for mapped in self.corpora.mapped:
            cont, kind = self._lookup(mapped.corpus, context, k)
            key = (kind, cont.match_len, cont.score)
            if len(cont.tokens) and (best_key is None or key > best_key):
                best, best_key = cont, key
        if best is None:
            return Draft(tokens=EMPTY, source=Source.corpus)
        return Draft(
            tokens=best.tokens, score=best.confidence, source=Source.corpus, match_len=best.match_len, probs=best.probs
        )

    def _lookup(self, c: Corpus, context: np.ndarray, k: int) -> tuple[Continuation, int]:
        """One corpus's continuation and its kind (2: a copy, 1: supported, 0: weak).

        The longest match decides. At `copy_match` tokens or more the output is copying a file: go on copying it
        (probability 1 a token while one occurrence is left). Shorter, it is evidence only where it occurs at least
        `min_count` times (a match found once is a poor predictor, one found several times a good one): else the longest
        suffix of the context that occurs that often is matched instead. Either way the draft stops where fewer than
        `min_follow` occurrences go on (`_supported`). When no suffix of `min_match` tokens occurs that often, the
        longest match's continuation is drafted as weak evidence, each probability shrunk to count / (count + 1) (one
        occurrence: 1/2), for the controller to price."""
        n = len(context)
        hint = self._hints.get(id(c))
        # m <= previous m + tokens added since (a suffix match extends by at most one token per token)
        upper = hint[1] + n - hint[0] if hint is not None and hint[0] <= n else None
        m, lo, hi = c.longest_match(context, self.max_depth, upper)
        self._hints[id(c)] = (n, m)
        if m < self.min_match:
            return empty_continuation("global"), 0
        if m >= self.copy_match:
            return c.walk(lo, hi, m, min(k, math.ceil(self.factor * m)), self.min_token_prob), 2
        if hi - lo >= self.min_count:
            return self._supported(c.walk(lo, hi, m, min(k, math.ceil(self.factor * m)), self.min_token_prob)), 1
        m2, lo2, hi2 = c.longest_match(context, m - 1, None, self.min_count)  # the longest suffix found often enough
        if m2 >= self.min_match:
            return self._supported(c.walk(lo2, hi2, m2, min(k, math.ceil(self.factor * m2)), self.min_token_prob)), 1
        weak = c.walk(lo, hi, m, min(k, math.ceil(self.factor * m)), self.min_token_prob)
        counts = weak.n_occurrences * np.cumprod(weak.probs)  # [k'] occurrences that follow each path
        return replace(weak, probs=weak.probs * counts / (counts + 1.0)), 0

    def _supported(self, cont: Continuation) -> Continuation:
        """The continuation's tokens that at least `min_follow` occurrences of the match agree on (a path's count is
        n_occurrences x the product of its probabilities): where one file alone goes on, the draft stops."""
        counts = cont.n_occurrences * np.cumprod(cont.probs)  # [k'] occurrences that follow each path
        keep = int(np.count_nonzero(counts >= self.min_follow - 1e-6))  # a prefix: counts never grow
        return cont if keep == len(cont.tokens) else replace(cont, tokens=cont.tokens[:keep], probs=cont.probs[:keep])
