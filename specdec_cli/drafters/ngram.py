"""Prompt lookup (n-gram) drafter: copy what followed the last time the recent tokens appeared.

Saxena, "Prompt Lookup Decoding" (2023); llama.cpp `common/ngram-cache` / `lookup`. For edits, summaries and
code that quotes its input, the continuation is often already in the prompt, so drafts are long, right and free.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec_cli.drafters.base import EMPTY, Draft
from specdec_cli.sampling import SamplingParams


class NgramDrafter:
    """Finds the longest n-gram (n_max down to n_min) ending the context that occurred earlier in the context
    (prompt + output), preferring the most recent occurrence, and proposes the tokens that followed it.

    Args:
        n_min: shortest n-gram to match (>= 1).
        n_max: longest n-gram to match.
        window: only search the last `window` tokens of the context (0 = all); bounds the cost on long contexts.
    """

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 4, window: int = 0) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max, self.window = n_min, n_max, window

    def reset(self) -> None:
        pass

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens (int32) copied from after the best earlier match; empty when nothing matches."""
        ctx = context[-self.window :] if self.window else context
        n_ctx = len(ctx)
        for n in range(min(self.n_max, n_ctx - 1), self.n_min - 1, -1):
            pattern = ctx[n_ctx - n :]
            # windows: [n_ctx - n, n] over ctx[:-1], so a match is strictly earlier than the context's end
            windows = sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # most recent occurrence
                cont = ctx[start : start + k]
                if len(cont):
                    return Draft(tokens=cont.astype(np.int32, copy=True), score=n / self.n_max, source=self.name)
        return Draft(tokens=EMPTY, source=self.name)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        pass

    def close(self) -> None:
        pass
