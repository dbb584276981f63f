"""The corpus as a draft source (`--method auto`): what `specdec learn` indexed, drafted from REST-style.

REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding"): find the longest suffix of the context that
occurs in the datastore (a suffix array over the corpus's tokens, binary search), then follow its continuations,
weighed by how often each follows there: the most frequent child while count / parent count >= `min_token_prob`.
The corpus index (`specdec_cli.stores.corpus`) is read through the suffix store's `Corpus` over memory maps, so
the lookup and the walk are the suffix store's (`Corpus.longest_match`, `Corpus.walk`): ~0.1-0.3 ms a step.

A match of a token or two in a corpus of millions is noise (every `(` is followed by something): drafts need a
match of at least `min_match` tokens. The controller learns the source's acceptance by match length like any other
(`Source.corpus`), and verifies a draft only where it pays. Drafts are copied from the corpus: they never look at
the target's logits, so the output is the target's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.core.records import Source
from specdec_cli.core.draft import EMPTY, Draft, DrafterBase
from specdec_cli.stores.suffix_index import WINDOW

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
    """

    name = Source.corpus

    def __init__(self, corpora: CorpusSet, *, max_depth: int = 64, min_match: int = 3, factor: float = 4.0,
                 min_token_prob: float = 0.1) -> None:
        if not 1 <= max_depth < WINDOW:
            raise ValueError(f"max_depth must be in 1..{WINDOW - 1}, got {max_depth}")
        self.corpora = corpora
        self.max_depth, self.min_match, self.factor, self.min_token_prob = max_depth, min_match, factor, min_token_prob
        self._hints: dict[int, tuple[int, int]] = {}  # id(corpus) -> (context length, match length) at the last step

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """A generation starts: map the corpora learnt since the last one (a stat per corpus)."""
        self.corpora.refresh()
        self._hints = {}

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """The continuation after the longest match of `context`'s suffix (int32 [n]) in any corpus, up to k
        tokens (the longer match wins; then the higher expected accepted length); empty below `min_match`."""
        best = None
        n = len(context)
        for mapped in self.corpora.mapped:
            c = mapped.corpus
            hint = self._hints.get(id(c))
            # m <= previous m + tokens added since (a suffix match extends by at most one token per token)
            upper = hint[1] + n - hint[0] if hint is not None and hint[0] <= n else None
            m, lo, hi = c.longest_match(context, self.max_depth, upper)
            self._hints[id(c)] = (n, m)
            if m < self.min_match:
                continue
            cont = c.walk(lo, hi, m, min(k, math.ceil(self.factor * m)), self.min_token_prob)
            if len(cont.tokens) and (best is None or (cont.match_len, cont.score) > (best.match_len, best.score)):
                best = cont
        if best is None:
            return Draft(tokens=EMPTY, source=Source.corpus)
        return Draft(tokens=best.tokens, score=best.confidence, source=Source.corpus, match_len=best.match_len,
                     probs=best.probs)
