"""Hybrid drafter: the suffix tree's draft when its match is strong, otherwise the draft model's.

Suffix drafts cost microseconds; a draft model costs a forward pass per token. So the suffix drafter is asked first,
and the draft model only when the suffix match is weak (SuffixDecoding, Oliaro et al. 2024, §4 uses the same
idea of falling back to a model-based speculator). The draft model catches up on the skipped tokens lazily, in
one batch, the next time it is used (see `ModelDrafter.propose`).
"""

from __future__ import annotations

import numpy as np

from specdec_cli.drafters.base import Draft, Drafter, DrafterBase
from specdec_cli.sampling import SamplingParams


class HybridDrafter(DrafterBase):
    """Args:
        suffix: a deterministic lookup drafter (`SuffixDrafter`); its `Draft.score` estimates the first token's
            acceptance probability (0..1).
        model: a `ModelDrafter`.
        min_score: take the suffix draft when its score is at least this and it proposes at least `min_len` tokens.
        model_k_max: the fallback drafts at most this many tokens. Under `--k auto` the controller asks a drafter
            whose drafts carry a match for up to 64 tokens, because lookup drafts cost the same at any length and
            it trims them afterwards; a draft model pays a forward pass per token (64 tokens: ~1.8 s of a 0.5B model
            on 2 CPU cores, measured in `specdec bench`), and its drafts are not trimmed.
    """

    name = "hybrid"

    def __init__(self, suffix: Drafter, model: Drafter, *, min_score: float = 0.5, min_len: int = 2,
                 model_k_max: int = 4) -> None:
        self.suffix, self.model = suffix, model
        self.min_score, self.min_len, self.model_k_max = min_score, min_len, model_k_max

    def begin(self, context: np.ndarray) -> None:
        self.suffix.begin(context)
        self.model.begin(context)

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        draft = self.suffix.propose(context, k, sampling, rng)
        if len(draft) >= min(self.min_len, k) and draft.score >= self.min_score:
            return draft
        return self.model.propose(context, min(k, self.model_k_max), sampling, rng)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        self.suffix.finish(prompt, output)
        self.model.finish(prompt, output)

    def close(self) -> None:
        self.suffix.close()
        self.model.close()
