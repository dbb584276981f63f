"""The drafter interface: propose up to K tokens that the target will verify in one batched pass.

Drafters know nothing about the target. They see the committed context (prompt + output so far) and return a
`Draft`. Model drafters return the distribution q_i they sampled each token from; deterministic drafters (prompt
lookup, suffix tree) return `dists=None`, which verification treats as q = one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specdec_cli.core.records import Source

if TYPE_CHECKING:
    from specdec_cli.core.sampling import Dist, SamplingParams

EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposal.

    Attributes:
        tokens: int32 [k'] proposed tokens, k' <= the K asked for (a drafter may cut a draft short).
        dists: for model drafters, q_i (a processed `Dist`) for each proposed token; None for deterministic drafters.
        score: the drafter's own confidence in the draft (0..1, e.g. the product of draft-model probabilities or the
            match-based estimate of a lookup drafter).
        source: where it came from (the controller's per-source estimates, the stats, the stream's colours): prompt
            lookup, the suffix store of past outputs, a prediction, a draft model; `Source.none` for an empty draft.
        match_len: lookup drafters' evidence: how many tokens of the context (counting back from its end) match the
            text the draft was copied after (0 = no such evidence, e.g. a draft model). Under `--k auto` the
            controller trims the draft by the acceptance it has measured for matches of this length.
        probs: float64 [k'] for lookup drafters that count continuations (the suffix drafter): each token's empirical
            probability given the path before it (count / parent count), e.g. 0.5 where two past outputs that match
            the context part ways; None when the drafter has no such estimate. `trim` discounts the positions after
            a branch by it.
    """

    tokens: np.ndarray = field(default_factory=lambda: EMPTY)
    dists: tuple[Dist, ...] | None = None
    score: float = 0.0
    source: Source = Source.none
    match_len: int = 0
    probs: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    """Proposes draft tokens: every hook the engine calls. Implementations subclass `DrafterBase`, which gives each
    hook its no-op default: `ModelDrafter`, `NgramDrafter`, `SuffixDrafter`, `PredictionDrafter`, `AutoDrafter`.

    Two kinds of draft: free lookup drafts (prompt lookup, the suffix store, a prediction: cheap beside a target pass,
    whatever their length), which the engine collects every step that drafts through `lookup`, and a draft model's
    (`has_model`: a forward pass per token), which it asks for through `propose` only when the controller chose it.

    The engine calls, per generation: `begin(prompt, prediction)` once; per step that drafts, `lookup` and, when the
    controller picks the draft model, `propose`; `finish` once when the generation completes (not when it is
    interrupted); `close` when the drafter is no longer used.
    """

    name: str
    has_model: bool  # True when `propose` runs a draft model

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """A generation starts from `context`, int32 [n] (the prompt, n >= 1), and, when the user gave one, the
        predicted output, int32 [m] (predicted outputs: drafted from, never evaluated): forget per-generation state
        and do any prefill now (a draft model evaluates context[:-1]), so the engine counts it as drafter prefill
        time."""
        ...

    def lookup(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> list[Draft]:
        """The free lookup drafts for the next step, each up to `k` tokens and non-empty, each with its evidence
        (`Draft.match_len`); [] when there are none (and always for a draft model)."""
        ...

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Propose up to `k` tokens to follow `context` (int32 [n], context[-1] the newest committed token).

        `k` >= 1. Greedy sampling (temperature 0) must give deterministic drafts. Must not modify `context`.
        """
        ...

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        """Called once per completed generation with int32 [n_prompt] and int32 [n_out]; learning drafters store it.

        `output` ends with the end-of-generation token when the generation ended with one, so a learning drafter
        also learns where outputs end (and can draft the end, instead of text past it)."""
        ...

    def save(self) -> None:
        """Learning drafters save what they learnt so far and go on (a long-running server saves as it goes);
        a failure only warns."""
        ...

    def close(self) -> None:
        """Release what the drafter holds; learning drafters save what they learnt."""
        ...

    def fork(self) -> Drafter:
        """A drafter for another sequence generating at the same time (`server.lanes`): its own per-generation state,
        sharing what persists (the suffix store, the corpora), so what one sequence learns the others draft from. A
        draft model is not shared (its KV cache is one sequence's): a fork drafts without it."""
        ...


class DrafterBase(Drafter):
    """The no-op default of every `Drafter` hook: a drafter that proposes nothing, learns nothing, holds nothing.
    Subclasses override what they need."""

    name = "drafter"
    has_model = False

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        pass

    def lookup(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> list[Draft]:
        """A lookup drafter's own draft (`propose`) when it found one; [] for a drafter that runs a model."""
        if self.has_model:
            return []
        draft = self.propose(context, k, sampling, rng)
        return [draft] if len(draft) else []

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        return Draft()

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        pass

    def save(self) -> None:
        pass

    def close(self) -> None:
        pass

    def fork(self) -> Drafter:
        """A drafter without per-generation state forks as itself."""
        return self


def cut(draft: Draft, k: int) -> Draft:
    """The first k tokens of a draft (and their q and probabilities): a drafter returned more than asked, or the
    controller trimmed it."""
    return Draft(
        tokens=draft.tokens[:k],
        dists=draft.dists[:k] if draft.dists is not None else None,
        score=draft.score,
        source=draft.source,
        match_len=draft.match_len,
        probs=draft.probs[:k] if draft.probs is not None else None,
    )
