"""The sweep harness shared by `specdec tune` and `specdec bench`: many configurations on the same prompts, in one
sitting, in an order that spreads slow drift over all of them, reported as speedups over plain decoding.

Order (`schedule`): for each repeat, for each prompt, a block in which every configuration runs once, each block
starting one configuration later than the block before, so that over n_configs blocks every configuration takes
every position once (thermal throttling or another process waking up biases none of them). Drafters do not learn
during a sweep (`NoLearning`): its prompts repeat, and a store that had learnt the first run's output would flatter
every later run of the same prompt. Speedups over prompts average geometrically (`geomean`: 2x on one prompt and
0.5x on another average to 1x). The tables both reports draw are `specdec_cli.cli.tables`'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec_cli.core.draft import Draft, Drafter, DrafterBase
from specdec_cli.core.sampling import SamplingParams
from specdec_cli.errors import UsageError
from specdec_cli.prompts import PromptCase

# --------------------------------------------------------------------------------------------------------------
# What runs, in which order


@dataclass(frozen=True, slots=True)
class Slot:
    """One run in the schedule: `config` and `prompt` are indices; `cold` = a time-to-first-token/warm-up run."""

    repeat: int
    prompt: int
    config: int
    cold: bool = False


def schedule(n_configs: int, n_prompts: int, repeats: int, *, cold_first: bool = False) -> list[Slot]:
    """The run order: for each repeat, for each prompt, every configuration once, each block starting one position
    later than the block before. `cold_first`: in repeat 0, each block's cold runs (same order) come first."""
    plan: list[Slot] = []
    block = 0
    for r in range(repeats):
        for p in range(n_prompts):
            order = [(block + i) % n_configs for i in range(n_configs)]
            if cold_first and r == 0:
                plan += [Slot(r, p, c, True) for c in order]
            plan += [Slot(r, p, c) for c in order]
            block += 1
    return plan


def check_prompts(prompts: list[PromptCase], what: str) -> None:
    """Raise UsageError when there are no prompts ("No prompts to {what}.") or two share a name."""
    if not prompts:
        raise UsageError(f"No prompts to {what}.", "Give prompt files or directories, or none for the built-in ones.")
    names = [p.name for p in prompts]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"Two prompts are named {dup!r}.", "Give prompt files with different names.")


class NoLearning(DrafterBase):
    """Wraps a drafter so that `finish` teaches it nothing (a sweep's prompts repeat) and `close` saves nothing
    (the sweep closes the inner drafter itself)."""

    def __init__(self, inner: Drafter) -> None:
        self._inner = inner
        self.name = inner.name
        self.has_model = inner.has_model

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        self._inner.begin(context, prediction)

    def lookup(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> list[Draft]:
        return self._inner.lookup(context, k, sampling, rng)

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        return self._inner.propose(context, k, sampling, rng)


# --------------------------------------------------------------------------------------------------------------
# Summaries


def geomean(xs: Sequence[float]) -> float | None:
    """The geometric mean of the positive values of `xs` (None when there are none)."""
    xs = [x for x in xs if x > 0]
    return math.exp(statistics.fmean(map(math.log, xs))) if xs else None


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)
