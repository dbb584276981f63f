"""`--method auto`: every free draft source, and a draft model where one is loaded; the controller chooses.

Each step that drafts, the engine collects the free lookup drafts (`lookup`), one per source that found a match:

* "prompt": prompt lookup over this prompt and output (the suffix drafter's local index: the longest suffix of the
  context that occurred before, and what followed it; Saxena 2023, "prompt lookup decoding");
* "store": the suffix store of past outputs (SuffixDecoding, Oliaro et al. 2024);
* "realign": the reply's copy of the prompt followed past each edit, the edits it repeats applied ahead (a word
  renamed at two places is drafted renamed at the next: `drafters/edits.py`; right after an edit, before the copy
  re-syncs, the copy shifted by the tokens written since, while the reply's edits have been one for one);
* "predict": the predicted output the user gave (OpenAI's predicted outputs), when there is one;
* "corpus": the code and documents `specdec learn` indexed (REST-style: `specdec_cli.drafters.corpus`);
* and, where the prompt's occurrences of the context continue differently, the runner-up continuation ("prompt").

The controller picks one, and may verify another as a second branch of the same pass (`KController.branch`). They cost
little beside a target pass, whatever their length, so every one is looked up each step. The controller
(`AdaptiveK.choose`) values each by the acceptance its source has shown after matches of its length, compares the best
with what the draft model would yield at its best K (when one is loaded) and with a plain step, and picks; only a chosen
draft model runs (`propose`), since it costs a forward pass per token. The choice is never made from the target's
logits, so the output is the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specdec_cli.core.draft import Draft, Drafter, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.drafters.suffix import SuffixDrafter


class AutoDrafter(DrafterBase):
    """Args:
    suffix: the prompt-lookup and suffix-store source (`SuffixDrafter`; its store may be None), or None.
    model: a draft model (`ModelDrafter`), or None: then only free drafts are made.
    predictor: builds the prediction's drafter for one generation from its tokens (int32 [m]), e.g.
        `lambda p: PredictionDrafter(p, piece=target.piece, tokenize=...)`; None = predictions are ignored.
    name: "auto", or "predict" for `--method predict` (the prediction alone).
    corpus: the learnt corpora's source (`CorpusDrafter`), or None (`--corpus off`, or a method without it).
    """

    def __init__(
        self,
        suffix: SuffixDrafter | None = None,
        model: Drafter | None = None,
        *,
        predictor: Callable[[np.ndarray], Drafter] | None = None,
        name: str = "auto",
        corpus: Drafter | None = None,
    ) -> None:
        self.suffix, self.model, self.predictor, self.corpus = suffix, model, predictor, corpus
        self.has_model = model is not None
        self.name = name
        self.prediction: Drafter | None = None  # this generation's prediction drafter

    def fork(self) -> AutoDrafter:
        """Forks of the lookup sources, without the draft model (one sequence's KV cache)."""
        return AutoDrafter(
            self.suffix.fork() if self.suffix is not None else None,
            None,
            predictor=self.predictor,
            name=self.name,
            corpus=self.corpus.fork() if self.corpus is not None else None,
        )

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        if self.suffix is not None:
            self.suffix.begin(context)
        if self.corpus is not None:
            self.corpus.begin(context)
        self.prediction = None
        if prediction is not None and len(prediction) and self.predictor is not None:
            self.prediction = self.predictor(np.asarray(prediction, dtype=np.int32))
            self.prediction.begin(context)
        if self.model is not None:
            self.model.begin(context)

    def lookup(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> list[Draft]:
        """The non-empty drafts of "prompt", "store", the prompt's runner-up continuation (where its occurrences part
        ways), "realign" (the copy continued past the reply's edits: `CopyEdits.draft`), "predict" and "corpus"
        (each <= k tokens, deterministic): the candidates the controller chooses from, and a second branch of the same
        pass."""
        drafts = []
        if self.suffix is not None:
            local, glob, alt, realigned = self.suffix.continuations(context, k, more=True)
            drafts += [
                self.suffix.draft(local, Source.prompt),
                self.suffix.draft(glob, Source.store),
                self.suffix.draft(alt, Source.prompt),
                self.suffix.draft(realigned, Source.realign),
            ]
        if self.prediction is not None:
            drafts.append(self.prediction.propose(context, k, sampling, rng))
        if self.corpus is not None:
            drafts.append(self.corpus.propose(context, k, sampling, rng))
        return [d for d in drafts if len(d)]

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """The draft model's draft (the engine asks only when the controller chose it)."""
        if self.model is None:
            return Draft()
        return self.model.propose(context, k, sampling, rng)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        for d in (self.suffix, self.model):
            if d is not None:
                d.finish(prompt, output)

    def save(self) -> None:
        for d in (self.suffix, self.model):
            if d is not None:
                d.save()

    def close(self) -> None:
        for d in (self.suffix, self.model, self.corpus):
            if d is not None:
                d.close()
