"""Sampling and verification math: pure numpy, no model.

Greedy verification (temperature 0): accept the longest prefix of the draft on which the target's argmax agrees,
then take the target's own token at the first disagreement (the correction) or after the last draft token (the
bonus token). The output is the target's greedy decode by construction.

Stochastic verification (temperature > 0) is rejection sampling (Leviathan, Kalman, Matias 2023, Algorithm 1;
Chen et al. 2023): see `verify_stochastic`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen from the target's logits.

    Attributes:
        temperature: 0 = greedy (argmax). > 0 samples from softmax(logits / temperature) after truncation.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
        min_p: drop tokens whose probability is below min_p × the top probability (0.0 = off).
        seed: seed of the random stream (None = from OS entropy).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Dist:
    """A processed (truncated, renormalised) distribution over a sparse candidate set.

    Attributes:
        ids: int32 [n] candidate token ids (distinct).
        probs: float64 [n] their probabilities, summing to 1.
    """

    ids: np.ndarray
    probs: np.ndarray

    def prob_of(self, token: int) -> float:
        """Probability of `token` (0.0 when it is not a candidate)."""
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if len(hit) else 0.0


def verify_greedy(draft: np.ndarray, logits: np.ndarray) -> tuple[int, int]:
    """Greedy verification of one draft.

    Args:
        draft: int32 [k] draft tokens d_1..d_k.
        logits: float32 [k+1, V] target logits; row i predicts the token after d_i (row 0: after the last committed
            token).

    Returns:
        (n_accepted, token): how many draft tokens the target's argmax agrees with (a prefix), and the target's own
        token after them: the correction at the first disagreement, or the bonus token when all k were accepted.
    """
    # argmax over every verified row at once: [k+1]
    best = np.argmax(logits, axis=1)
    k = len(draft)
    disagree = np.flatnonzero(best[:k] != draft)
    n = int(disagree[0]) if len(disagree) else k
    return n, int(best[n])
