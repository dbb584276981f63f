"""MTP drafter: the target's own multi-token-prediction block proposes K tokens (`--method mtp`, and `auto`'s model
source where the target has one and no draft model is loaded).

The block runs on the target's hidden state, so it needs no second model and no catch-up prefill of its own: its
cache follows the target's calls (`models.llama.LlamaMtp`). Like a draft model it costs a forward pass per token
(of one layer, not the whole model), and it returns the distribution q_i it drew each token from, so rejection
sampling keeps the target's distribution exactly (Leviathan et al. 2023); under a seed it draws with the target's
keyed noise (`core.sampling.sample_at`), so its draws agree with the target's where q_i is close to p_i. After
llama.cpp's `draft-mtp` (common/speculative.cpp, `common_speculative_impl_draft_mtp`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from specdec_cli.core.draft import Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.core.sampling import Dist, SamplingParams, argmax_rows, process, sample, sample_at


class MtpHead(Protocol):
    """What the drafter needs of an MTP block (`models.llama.LlamaMtp`; `tests/fakes.py` has a fake)."""

    def draft(self, last: int, pos: int, k: int, choose: Callable[[np.ndarray, int], int]) -> list[int]:
        """Up to k tokens after `last` (the newest committed token, at position `pos`); `choose(logits, i)` picks
        token i from the block's float32 [n_vocab] logits, or returns -1 to stop."""
        ...


class MtpDrafter(DrafterBase):
    """Drafts with the target's MTP block. Greedy: the block's argmax; sampling: d_i ~ q_i, each q_i returned.

    Args:
        head: the MTP block (`LlamaMtp`), owned by the session.
    """

    name = "mtp"
    has_model = True

    def __init__(self, head: MtpHead) -> None:
        self.head = head

    def fork(self) -> DrafterBase:
        """The block's cache follows one sequence: another sequence drafts nothing (plain decoding)."""
        return DrafterBase()

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens after `context` (int32 [n], n >= 1); q_i as `Dist`s when sampling, None when greedy."""
        dists: list[Dist] = []
        score = [1.0]

        def choose(logits: np.ndarray, i: int) -> int:
            if sampling.greedy:
                return int(argmax_rows(logits[None])[0])
            q = process(logits, sampling)  # q_i over its candidates
            # d_i ~ q_i, kept unconditionally; seeded: with the noise the target's draw at that position uses
            tok = sample(q, rng) if sampling.seed is None else sample_at(q, sampling.seed, len(context) + i)
            dists.append(q)
            score[0] *= q.prob_of(tok)
            return tok

        tokens = self.head.draft(int(context[-1]), len(context) - 1, k, choose)
        return Draft(
            tokens=np.asarray(tokens, dtype=np.int32),
            dists=None if sampling.greedy else tuple(dists),
            score=0.0 if sampling.greedy else score[0],
            source=Source.mtp,
        )
