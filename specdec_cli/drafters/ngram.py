"""Prompt lookup (n-gram) drafter: copy what followed the last time the recent tokens appeared.

Saxena, "Prompt Lookup Decoding" (2023); llama.cpp `common/ngram-cache` / `lookup`. For edits, summaries and
code that quotes its input, the continuation is often already in the prompt, so drafts are long, right and free.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec_cli.core.draft import EMPTY, Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.core.sampling import SamplingParams

MATCH_DEPTH = 64  # how far back a match is measured (the evidence is capped here)
MAX_CANDIDATES = 256  # most recent occurrences of the n-gram compared


def _match_lengths(ctx: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """For occurrences ending at `ends` (int64 [c]) of the context's last n tokens: how many tokens each matches
    the context's end, counting back (n..MATCH_DEPTH). int64 [c]."""
    depth = min(MATCH_DEPTH, len(ctx) - 1)
    if depth <= n:
        return np.full(len(ends), n, dtype=np.int64)
    back = np.arange(n, depth)  # [depth - n] offsets beyond the n-gram
    idx = ends[:, None] - back  # [c, depth - n]
    eq = (ctx[np.maximum(idx, 0)] == ctx[len(ctx) - 1 - back]) & (idx >= 0)
    return np.where(eq.all(axis=1), depth, n + eq.argmin(axis=1)).astype(np.int64)


class NgramDrafter(DrafterBase):
    """Finds the longest n-gram (n_max down to n_min) ending the context that occurred earlier in the context
    (prompt + output) and proposes the tokens that followed it. Among the occurrences of that n-gram it takes the one
    whose match with the context extends furthest back (up to `MATCH_DEPTH` tokens), then the most recent: inside
    an edit that repeats similar lines this picks the line actually being copied.

    `Draft.match_len` is that backward match length (>= n): the evidence `--k auto` trims the draft by (a long
    match means a copy run, whose next tokens are nearly always right).

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
                ends = hits[-MAX_CANDIDATES:] + (n - 1)  # [c] last index of each occurrence, ascending
                lengths = _match_lengths(ctx, ends, n)  # [c]
                best = int(np.flatnonzero(lengths == lengths.max())[-1])  # longest, then most recent
                start = int(ends[best]) + 1
                cont = ctx[start : start + k]
                if len(cont):
                    return Draft(
                        tokens=cont.astype(np.int32, copy=True),
                        score=n / self.n_max,
                        source=Source.prompt,
                        match_len=int(lengths[best]),
                    )
        return Draft(tokens=EMPTY, source=Source.prompt)
