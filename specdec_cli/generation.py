"""One place that turns options into a ready generation.

`make_engine` builds the drafter and the K controller a `SpecOptions` names and the `SpeculativeEngine` around the
session's target; `specdec_cli.driver` drives it. `plain_compare` is the plain-decoding run that `run --compare`
measures against. Every command (run, check, chat, tune, bench, serve) builds its engines here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.audit import NEAR_TIE_THRESHOLD, Divergence, FirstMismatchProbe, compare_divergence
from specdec_cli.drafters.base import Drafter
from specdec_cli.driver import Generation, generate
from specdec_cli.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.records import Source
from specdec_cli.stats import RunStats

if TYPE_CHECKING:
    from specdec_cli.session import Session, SpecOptions

_BUILD = object()  # make_engine's default: build the drafter `spec.method` names


def make_engine(session: Session, spec: SpecOptions, *, fresh: bool = False, saved_k: int | None = None,
                drafter: Drafter | None | object = _BUILD) -> SpeculativeEngine:
    """The engine for `spec` on the session's target: its drafter (the session's, `Session.drafter`, which the
    session closes; None for method none)
    and, with a drafter, its K controller (`Session.make_controller`: `--k N`, the K `specdec tune --save` chose
    when `saved_k` is given, else the session's learning `--k auto`, or a new one that learns from nothing when
    `fresh`), and the session's prompt cache (`Session.prompt_cache`; not for a `fresh` engine: benchmarks of a
    cold start).

    Args:
        drafter: use this drafter, owned by the caller, instead of the session's (a sweep wraps one that does not
            learn); None = plain decoding.

    Raises:
        UsageError: a method that needs a draft model none is loaded.
    """
    if drafter is _BUILD:
        drafter = session.drafter(spec)
    controller = session.make_controller(spec, saved_k=saved_k, fresh=fresh) if drafter is not None else None
    return SpeculativeEngine(session.target, drafter, controller,
                             prompt_cache=None if fresh else session.prompt_cache)


def saved_k(session: Session, spec: SpecOptions, console) -> int | None:
    """The fixed K `specdec tune --save` chose for this pair, method and machine (None: auto), announced on
    `console` (stderr) when there is one."""
    from rich.text import Text

    from specdec_cli.tuned import lookup, tuned_path

    k = lookup(session.target_path, session.draft_path, spec.method, session.target.n_threads)
    if k is not None:
        console.print(Text(f"K = {k} from specdec tune ({tuned_path()}); --k auto adapts it instead.",
                           style="spec.label"))
    return k


def plain_compare(session: Session, prompt: np.ndarray, config: GenerationConfig, spec_tokens: list[int],
                  threshold: float = NEAR_TIE_THRESHOLD) -> tuple[Generation, Divergence | None]:
    """Plain decoding of `prompt` from an empty cache, and (greedy) its first divergence from `spec_tokens`.

    The divergence's margin comes from the plain run's own batch-1 logits row at that position, kept by an
    `audit.FirstMismatchProbe` around the target (one argmax per plain token; the speculative run is not touched).
    For sampling runs the divergence is None: their outputs differ by design.

    Returns:
        (the plain generation, the `audit.Divergence` or None when identical or sampling).
    """
    from specdec_cli.session import SpecOptions

    target = session.target
    greedy = config.sampling.greedy
    probe = FirstMismatchProbe(target, len(prompt), spec_tokens) if greedy else None
    target.truncate(0)  # same cold prefill as the speculative run
    watched = replace(session, target=probe) if probe is not None else session  # the same models, seen through it
    plain = generate(make_engine(watched, SpecOptions(method="none")), prompt, config)
    if not greedy or plain.interrupted:
        return plain, None
    return plain, compare_divergence(spec_tokens, plain.tokens, probe, target, threshold)


def notes(session: Session, spec: SpecOptions, stats: RunStats, *, predicted: bool) -> tuple[str, ...]:
    """One line each, printed under the statistics: why `auto` drafts without a draft model, and a prediction
    that was never drafted from (`predicted`: the user gave one)."""
    out = []
    if spec.method == "auto" and session.draft is None and session.draft_plan.reason:
        out.append(f"no draft model: {session.draft_plan.reason}.")
    if predicted and spec.method in ("auto", "predict") and Source.predict not in stats.by_source:
        out.append("the prediction was never drafted from: the reply did not follow it, or another source (the "
                   "prompt, past outputs) offered the same text first.")
    return tuple(out)
