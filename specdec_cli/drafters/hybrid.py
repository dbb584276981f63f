"""Hybrid drafter: the suffix tree's draft when its match is strong, otherwise the draft model's.

Suffix drafts cost microseconds; a draft model costs a forward pass per token. So the suffix drafter is asked first,
and the draft model only when the suffix match is weak (SuffixDecoding, Oliaro et al. 2024, §4 uses the same
idea of falling back to a model-based speculator). The draft model catches up on the skipped tokens lazily, in
one batch, the next time it is used (see `ModelDrafter.propose`).
"""

from __future__ import annotations

import numpy as np

from specdec_cli.drafters.base import Draft, Drafter
from specdec_cli.sampling import SamplingParams


class HybridDrafter:
    """Args:
        suffix: a deterministic lookup drafter (`SuffixDrafter`); its `Draft.score` estimates the first token's
            acceptance probability (0..1).
        model: a `ModelDrafter`.
        min_score: take the suffix draft when its score is at least this and it proposes at least `min_len` tokens.
    """

    name = "hybrid"

    def __init__(self, suffix: Drafter, model: Drafter, *, min_score: float = 0.5, min_len: int = 2) -> None:
        self.suffix, self.model = suffix, model
        self.min_score, self.min_len = min_score, min_len

    def reset(self) -> None:
        self.suffix.reset()
        self.model.reset()

    def prefill(self, context: np.ndarray) -> None:
        for d in (self.suffix, self.model):
            prefill = getattr(d, "prefill", None)
            if prefill is not None:
                prefill(context)

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        draft = self.suffix.propose(context, k, sampling, rng)
        if len(draft) >= min(self.min_len, k) and draft.score >= self.min_score:
            return draft
        return self.model.propose(context, k, sampling, rng)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        self.suffix.finish(prompt, output)
        self.model.finish(prompt, output)

    def close(self) -> None:
        self.suffix.close()
        self.model.close()
