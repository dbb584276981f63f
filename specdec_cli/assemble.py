"""One place that turns options into a ready generation.

`make_engine` builds the drafter and the K controller a `SpecOptions` names and the `SpeculativeEngine` around the
session's target; `specdec_cli.driver` drives it (`run --compare` measures against plain decoding in interleaved
pairs: `specdec_cli.measure.comparison`). Every command (run, check, chat, tune, bench, serve) builds its engines here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec_cli.core.controller import KController
from specdec_cli.drafters.base import Drafter
from specdec_cli.core.engine import SpeculativeEngine
from specdec_cli.core.records import Source
from specdec_cli.core.stats import RunStats
from specdec_cli.spec import USES_PREDICTION, Method, SpecOptions

if TYPE_CHECKING:
    from specdec_cli.session import Session

_BUILD = object()  # make_engine's default: build the drafter `spec.method` names


def make_engine(session: Session, spec: SpecOptions, *, fresh: bool = False, saved_k: int | None = None,
                drafter: Drafter | None | object = _BUILD, controller: KController | None = None) -> SpeculativeEngine:
    """The engine for `spec` on the session's target: its drafter (the session's, `Session.drafter`, which the
    session closes; None for method none)
    and, with a drafter, its K controller (`Session.make_controller`: `--k N`, the K `specdec tune --save` chose
    when `saved_k` is given, else the session's learning `--k auto`, or a new one that learns from nothing when
    `fresh`), and the session's prompt cache (`Session.prompt_cache`; not for a `fresh` engine: benchmarks of a
    cold start).

    Args:
        drafter: use this drafter, owned by the caller, instead of the session's (a sweep wraps one that does not
            learn); None = plain decoding.
        controller: use this K controller instead of the session's (`run --compare` replays the shown run from a
            copy of the controller it started with).

    Raises:
        UsageError: a method that needs a draft model none is loaded.
    """
    if drafter is _BUILD:
        drafter = session.drafter(spec)
    if controller is None and drafter is not None:
        controller = session.make_controller(spec, saved_k=saved_k, fresh=fresh)
    return SpeculativeEngine(session.target, drafter, controller,
                             prompt_cache=None if fresh else session.prompt_cache)


def tuned_k(session: Session, spec: SpecOptions) -> int | None:
    """The tuned-K rule, the one place it is written: when `spec` leaves K open (`SpecOptions.wants_tuned_k`: no
    --k given, a method that drafts), the fixed K `specdec tune --save` chose for this pair, method and machine
    (`stores.tuned.lookup`); None: K is `spec.k` (also for a saved "auto"). Prints nothing: the front end says so."""
    if not spec.wants_tuned_k:
        return None
    from specdec_cli.stores.tuned import lookup

    return lookup(session.target_path, session.draft_path, spec.method, session.target.n_threads)


def notes(session: Session, spec: SpecOptions, stats: RunStats, *, predicted: bool) -> tuple[str, ...]:
    """One line each, printed under the statistics: why `auto` drafts without a draft model, and a prediction
    that was never drafted from (`predicted`: the user gave one)."""
    out = []
    if spec.method is Method.auto and session.draft is None and session.draft_plan.reason:
        out.append(f"no draft model: {session.draft_plan.reason}.")
    if predicted and spec.method in USES_PREDICTION and Source.predict not in stats.by_source:
        out.append("the prediction was never drafted from: the reply did not follow it, or another source (the "
                   "prompt, past outputs) offered the same text first.")
    return tuple(out)
