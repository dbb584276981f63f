"""`run --compare N`: the generation just shown, replayed against plain decoding in N interleaved pairs.

After the shown (streamed) run, `against_plain` warms the target with a short untimed plain generation of the same
prompt, then measures `paired.measure`'s pairs: the speculative side (the same drafter state and K controller the
shown run started from, learning nothing, so every replay is the shown run again and not a run flattered by the
shown run's own output in the suffix store) and the plain side (plain decoding through the same engine), A B, B A,
... The speedup is the median of the per-pair ratios of decode tok/s, with their min and max. Every side, the
warm-up too, reuses the prompt's KV cache the shown run left (the engine keeps the longest common prefix): the
prompt is not evaluated again, prefill is never timed, and all see the prompt with the shown run's numerics.

Energy (where the host has counters, `models.energy`): each side's decoding joules per output token, paired as the
rates are: the median over the pairs of speculative J/token / plain J/token (below 1: speculation spends less energy
per token), with its min and max.

Agreement (greedy): how many leading tokens the shown run's output shares with plain decoding's, and at the first
difference, the plain run's own logit margin there (`audit.FirstMismatchProbe` on the first plain side).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.assemble import Assembler
from specdec_cli.core.controller import KController
from specdec_cli.core.draft import Drafter
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import Result, generate
from specdec_cli.measure.audit import NEAR_TIE_THRESHOLD, Divergence, FirstMismatchProbe, compare_divergence
from specdec_cli.measure.paired import Pair, Paired, measure
from specdec_cli.measure.sweep import NoLearning
from specdec_cli.models.backend import common_prefix
from specdec_cli.spec import Method, SpecOptions

if TYPE_CHECKING:
    from specdec_cli.session import Session

WARMUP_TOKENS = 8  # the untimed plain generation before the pairs


@dataclass(frozen=True)
class Comparison:
    """What `against_plain` measured.

    Attributes:
        paired: a = the speculative side, b = plain decoding; rates in decode tok/s; results are `Result`s.
        plain: the first plain side's generation (its text and stats).
        shared: leading tokens the shown run's output and `plain`'s share.
        divergence: greedy only: where they first differ, with the plain run's margin there; None when identical
            or sampling.
    """

    paired: Paired[Result, Result]
    plain: Result
    shared: int
    divergence: Divergence | None

    @property
    def speedup(self) -> float:
        """The median over the pairs of speculative tok/s / plain tok/s."""
        return self.paired.median

    @property
    def energy(self) -> Paired[Result, Result] | None:
        """The pairs in decoding's J per output token (a = speculative, b = plain; `Paired.median` is the median of
        speculative J/token / plain J/token), or None when a side of any pair has no energy figure."""
        return energy_pairs(self.paired)

    @property
    def energy_note(self) -> str | None:
        """Why `energy` is None: the first side's reason (None when there is a figure)."""
        if self.energy is not None:
            return None
        for g in self.paired.a_results + self.paired.b_results:
            if g.stats.j_per_token is None:
                return g.stats.energy_note or "no output tokens"
            if g.stats.j_per_token <= 0:
                return (
                    "a side's counters did not advance (a run shorter than their update interval: NVML's is "
                    "20-100 ms); use more --max-tokens"
                )
        return "no pairs"


def energy_pairs(paired: Paired[Result, Result]) -> Paired[Result, Result] | None:
    """`paired` (decode tok/s) as the same pairs in J per output token (decoding), in the order they ran; None when
    any side has no figure (no counter, a read error, no tokens, counters that did not advance)."""
    pairs = []
    for p, a, b in zip(paired.pairs, paired.a_results, paired.b_results, strict=False):
        ja, jb = a.stats.j_per_token, b.stats.j_per_token
        if ja is None or jb is None or ja <= 0 or jb <= 0:
            return None
        pairs.append(Pair(ja, jb, p.a_first))
    return Paired(tuple(pairs), paired.a_results, paired.b_results) if pairs else None


def against_plain(
    session: Session,
    spec: SpecOptions,
    prompt: np.ndarray,
    config: GenerationConfig,
    reference: list[int],
    pairs: int,
    *,
    drafter: Drafter | None,
    controller: KController | None,
    threshold: float = NEAR_TIE_THRESHOLD,
) -> Comparison:
    """Warm up, then `pairs` interleaved pairs of the speculative side and plain decoding (`paired.measure`).

    Args:
        prompt: int32 [n] the shown run's prompt tokens. reference: the shown run's output tokens.
        drafter: a drafter in the state the shown run's started in (built before it; wrapped here so that it learns
            nothing); None for `--method none` (then both sides are plain decoding: an A/A control).
        controller: the K controller the shown run started with (a copy is taken for every side).
        threshold: the near-tie threshold in logits for the divergence verdict.

    Raises:
        KeyboardInterrupt: Ctrl-C during a side (the comparison is incomplete and not reported).
    """
    target = session.target
    plain_spec = SpecOptions(method=Method.none)
    greedy = config.sampling.greedy
    probe = FirstMismatchProbe(target, len(prompt), reference) if greedy else None
    # every engine below is fresh, with the caller's drafter or none: these assemblers own nothing to close
    assembler = Assembler(session)
    probed = Assembler(replace(session, target=probe)) if probe is not None else assembler  # seen through the probe
    learning_free = NoLearning(drafter) if drafter is not None else None
    first_plain: list[Result] = []

    def run(engine) -> tuple[float, Result]:
        g = generate(engine, prompt, config)
        if g.interrupted:
            raise KeyboardInterrupt
        return g.stats.tokens_per_s, g

    def warmup() -> None:
        # the prompt's KV cache is the shown run's (the engine keeps the longest common prefix): no prefill again,
        # and every side sees the prompt exactly as the shown run did
        generate(assembler.engine(plain_spec, fresh=True), prompt, replace(config, max_tokens=WARMUP_TOKENS))

    def speculative() -> tuple[float, Result]:
        return run(
            assembler.engine(
                spec,
                fresh=True,
                drafter=learning_free,
                controller=copy.deepcopy(controller) if learning_free is not None else None,
            )
        )

    def plain() -> tuple[float, Result]:
        rate, g = run((assembler if first_plain else probed).engine(plain_spec, fresh=True))
        if not first_plain:
            first_plain.append(g)
        return rate, g

    result = measure(speculative, plain, pairs, warmup=warmup)
    base = first_plain[0]
    shared = common_prefix(np.asarray(reference, np.int32), np.asarray(base.tokens, np.int32))
    divergence = compare_divergence(reference, base.tokens, probe, target, threshold) if greedy else None
    return Comparison(result, base, shared, divergence)
