"""Draft-model drafter: a small GGUF model with the target's vocabulary proposes K tokens autoregressively.

Its own KV cache is kept in step with the committed context lazily: at each `propose` it keeps the longest common
prefix of what it holds and the context, drops the rest (the rejected drafts) and evaluates what is missing
(the accepted drafts it never evaluated, e.g. d_K when all K were accepted, and the target's token) in the same
batch that produces the first draft's logits. This is gpt-fast's "feed the last draft token when all are accepted",
done generally.
"""

from __future__ import annotations

import numpy as np

from specdec_cli.core.draft import Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.core.sampling import Dist, SamplingParams, argmax_rows, process, sample, sample_at
from specdec_cli.models.backend import Backend, common_prefix, sync


class ModelDrafter(DrafterBase):
    """Drafts with a small model. Greedy: argmax; sampling: draws d_i ~ q_i and returns each q_i.

    Args:
        backend: the draft model (vocabulary already checked against the target's).
        min_prob: cut the draft short when the draft model's top probability at the next position falls below this
            (0 = never). A cheap confidence signal: low-confidence positions are rarely accepted. The decision is made
            before sampling, so every proposed token is an exact draw from the q_i that is returned.
    """

    name = "draft"
    has_model = True

    def __init__(self, backend: Backend, *, min_prob: float = 0.0) -> None:
        self.backend = backend
        self.min_prob = min_prob

    def fork(self) -> DrafterBase:
        """The draft model's KV cache holds one sequence: another sequence drafts nothing (plain decoding)."""
        return DrafterBase()

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """Evaluate the prompt, int32 [n], but its last token (a cached common prefix is reused), so the first
        step's draft cost is only drafting."""
        sync(self.backend, context[:-1])

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k tokens after `context` (int32 [n]). Returns q_i as `Dist`s when sampling, None when greedy."""
        b = self.backend
        if len(context) == 0:  # nothing to condition on (the engine never asks: a prompt has >= 1 token)
            return Draft(tokens=np.zeros(0, dtype=np.int32), source=Source.draft)
        # Catch up: keep the common prefix, evaluate the rest of the context in one batch (logits for the last row).
        keep = min(common_prefix(b.tokens, context), len(context) - 1)
        b.truncate(keep)
        keep = len(b.tokens)  # a recurrent draft model that cannot keep `keep` tokens starts again
        logits = b.decode(context[keep:], n_logits=1)[0]  # [V]
        tokens: list[int] = []
        dists: list[Dist] = []
        score = 1.0
        for i in range(k):
            # Cut-off on the distribution's confidence (its top probability), decided BEFORE sampling: a rule that
            # looked at the sampled token would keep tokens from a truncated q, not the q we report (not lossless).
            if sampling.greedy:
                p_top = _top_prob(logits) if self.min_prob > 0.0 else 1.0
                if i > 0 and p_top < self.min_prob:
                    break
                tok = int(argmax_rows(logits[None])[0])  # read in place: np.argmax copies a read-only row
                score *= p_top
            else:
                q = process(logits, sampling)  # q_i over its candidates
                if i > 0 and self.min_prob > 0.0 and float(q.probs.max()) < self.min_prob:
                    break
                # d_i ~ q_i, kept unconditionally; seeded: with the noise the target's draw at that position uses
                tok = sample(q, rng) if sampling.seed is None else sample_at(q, sampling.seed, len(context) + i)
                dists.append(q)
                score *= q.prob_of(tok)
            tokens.append(tok)
            if i + 1 < k:
                logits = b.decode([tok], n_logits=1)[0]
        return Draft(
            tokens=np.asarray(tokens, dtype=np.int32),
            dists=None if sampling.greedy else tuple(dists),
            score=score if (self.min_prob > 0.0 or not sampling.greedy) else 0.0,
            source=Source.draft,
        )

    # close: the session owns the draft model's backend


def _top_prob(logits: np.ndarray) -> float:
    """Softmax probability of the argmax token, from float32 [V] logits (float64 accumulation)."""
    m = float(np.max(logits))
    return 1.0 / float(np.sum(np.exp(logits.astype(np.float64) - m)))
