"""The engine factory: the one place that turns a loaded `Session` and a `SpecOptions` into a ready generation.

`Assembler(session)` owns what a generation is assembled from besides the models: the drafters (one per method,
shared by every engine made for it, so the suffix store learns across a chat's replies or a server's requests and
saves once) and the K controllers (`--k auto` keeps learning across generations and, through `stores.learnt`,
across runs). `Assembler.engine(spec)` builds the `SpeculativeEngine`; `specdec_cli.driver` drives it. Every front
end (run, check, chat, tune, bench, serve) builds its engines here. Nothing here prints: the front ends say what
they want to say (the tuned K, `notes`).

    with open_session(models, method=spec.method) as session, Assembler(session) as assembler:
        engine = assembler.engine(spec, saved_k=tuned_k(session, spec))
        result = driver.generate(engine, session.prompt_tokens(text), config)
    # the assembler closes first: drafters save what they learnt, learnt.json is written; then the models are freed
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from specdec_cli.core.controller import AdaptiveK, KController
from specdec_cli.core.draft import Drafter
from specdec_cli.core.engine import SpeculativeEngine
from specdec_cli.core.records import Source
from specdec_cli.core.stats import RunStats
from specdec_cli.core.verify_curve import DRIFT, PASSES_OFF, CurveWatch, VerifyCurve
from specdec_cli.errors import UsageError
from specdec_cli.spec import NEEDS_DRAFT_MODEL, USES_DRAFT_MODEL, USES_PREDICTION, Method, SpecOptions

if TYPE_CHECKING:
    from specdec_cli.session import Session

_BUILD = object()  # engine()'s default: build the drafter `spec.method` names


class Assembler:
    """Engines for one session: its drafters and K controllers, built on first use and kept.

    Close it (or use it as a context manager) before the session: `close` closes the drafters (a learning drafter
    saves what it learnt) and saves what `--k auto` learnt (a failure only warns). It never closes the session.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self._drafters: dict[
            tuple, Drafter | None
        ] = {}  # (method, ngram_min, ngram_max, corpus) -> shared by its engines
        self._controllers: dict[tuple, AdaptiveK] = {}  # (method, k_max) -> the AdaptiveK that keeps learning
        self._watch: CurveWatch | None = None  # the passes timed here against the verify curve (`watch`)

    # -- engines ------------------------------------------------------------------------------------------------
    def engine(
        self,
        spec: SpecOptions,
        *,
        fresh: bool = False,
        saved_k: int | None = None,
        drafter: Drafter | None | object = _BUILD,
        controller: KController | None = None,
    ) -> SpeculativeEngine:
        """The engine for `spec` on the session's target: its drafter (this assembler's, `drafter(spec)`; None for
        method none) and, with a drafter, its K controller (`make_controller`: `--k N`, the K `specdec tune --save`
        chose when `saved_k` is given, else the learning `--k auto`, or a new one that learns from nothing when
        `fresh`), and the session's prompt cache (`Session.prompt_cache`; not for a `fresh` engine: benchmarks of a
        cold start).

        Args:
            drafter: use this drafter, owned by the caller, instead of the assembler's (a sweep wraps one that does
                not learn); None = plain decoding.
            controller: use this K controller instead of the assembler's (`run --compare` replays the shown run
                from a copy of the controller it started with).

        Raises:
            UsageError: a method that needs a draft model none is loaded.
        """
        if drafter is _BUILD:
            drafter = self.drafter(spec)
        drafter = cast("Drafter | None", drafter)  # (no longer the sentinel)
        if controller is None and drafter is not None:
            controller = self.make_controller(spec, saved_k=saved_k, fresh=fresh)
        curve = self.session.verify_curve(measure=drafter is not None)
        engine = SpeculativeEngine(
            self.session.target,
            drafter,
            controller,
            prompt_cache=None if fresh else self.session.prompt_cache,
            curve=curve,
            clock=getattr(self.session, "clock", time.perf_counter),
        )
        engine.watch = self.watch(curve)  # `driver.Drive` shows it every pass (plain decoding's too)
        return engine

    def watch(self, curve: VerifyCurve | None) -> CurveWatch | None:
        """The `CurveWatch` of this session's verify curve, shared by every engine made here (None: no curve).
        `save_learnt` marks the curve stale when it says the passes drifted; `specdec tune` asks it too."""
        if curve is None:
            return None
        if self._watch is None or self._watch.curve != curve:  # (a kept curve is read afresh for plain decoding)
            self._watch = CurveWatch(curve)
        return self._watch

    def curve_drifted(self) -> bool:
        """The passes timed by this assembler's engines (`watch`), or the b = 1 passes a `--k auto` controller timed
        (`CostModel.drifted`), disagree with the measured verify curve."""
        return (self._watch is not None and self._watch.drifted()) or any(
            ctrl.model.drifted() for ctrl in self._controllers.values()
        )

    def drift_why(self) -> str:
        """How the passes timed here disagreed with the curve, one phrase beginning with `PASSES_OFF` ("" when they
        did not)."""
        if self._watch is not None and self._watch.drifted():
            return self._watch.why()
        if any(ctrl.model.drifted() for ctrl in self._controllers.values()):
            return f"{PASSES_OFF}: --k auto's one-token passes cost more than {DRIFT:.0%} away from it"
        return ""

    # -- drafters -----------------------------------------------------------------------------------------------
    def drafter(self, spec: SpecOptions) -> Drafter | None:
        """The assembler's drafter for `spec` (None for method none): built once (`make_drafter`), shared by every
        engine made for this method (a chat's /k, a server's requests), closed by `close`, so a learning drafter
        (the suffix store) learns across them and saves once. Raises what `make_drafter` raises."""
        key = (spec.method, spec.ngram_min, spec.ngram_max, spec.corpus)
        if key not in self._drafters:
            self._drafters[key] = self.make_drafter(spec)
        return self._drafters[key]

    def make_drafter(self, spec: SpecOptions) -> Drafter | None:
        """A new drafter for `spec.method` (None for none), owned by the caller (`drafter` gives the assembler's).
        Raises UsageError when the method needs a missing model."""
        method, session = spec.method, self.session
        if method is Method.none:
            return None
        if method is Method.ngram:
            from specdec_cli.drafters.ngram import NgramDrafter

            return NgramDrafter(spec.ngram_min, spec.ngram_max)
        if method in NEEDS_DRAFT_MODEL and session.draft is None:
            raise UsageError(f"--method {method} needs a draft model, and none is loaded.", "Pass --draft NAME.")
        from specdec_cli.drafters.auto import AutoDrafter
        from specdec_cli.drafters.model import ModelDrafter

        if method is Method.draft:
            assert session.draft is not None  # (checked above: draft needs a draft model)
            return ModelDrafter(session.draft)
        if method is Method.mtp:
            from specdec_cli.drafters.mtp import MtpDrafter

            head = session.mtp_head()
            if head is None:
                raise UsageError(
                    f"--method mtp needs a target with an MTP block, and {session.target_path.name} has none.",
                    "Use a model with one (e.g. Qwen3.5), or --method auto.",
                )
            return MtpDrafter(head)
        if method is Method.predict:
            return AutoDrafter(predictor=self._predictor, name="predict")
        if method in (Method.suffix, Method.auto):
            from specdec_cli.config import data_dir
            from specdec_cli.drafters.suffix import SuffixDrafter
            from specdec_cli.stores.suffix_store import SuffixStore, store_path

            fingerprint = session.vocab_fingerprint()
            suffix = SuffixDrafter(SuffixStore(store_path(data_dir(), fingerprint), fingerprint=fingerprint))
            if method is Method.suffix:
                return suffix
            model: Drafter | None = (
                ModelDrafter(session.draft) if session.draft is not None and session.auto_draft else None
            )
            if model is None and (head := session.mtp_head()) is not None:  # the target's own MTP block
                from specdec_cli.drafters.mtp import MtpDrafter

                model = MtpDrafter(head)
            return AutoDrafter(suffix, model, predictor=self._predictor, corpus=self._corpus(spec, fingerprint))
        raise AssertionError(f"unhandled method {method}")  # every Method is handled above

    def _corpus(self, spec: SpecOptions, fingerprint: str) -> Drafter | None:
        """`--method auto`'s corpus source (`drafters.corpus`): every corpus `specdec learn` made for the target's
        tokenizer (`--corpus auto`, including those learnt later: `specdec serve --learn`), the one named, or None
        (`--corpus off`). Raises UsageError for a name that has no corpus."""
        if spec.corpus == "off":
            return None
        from specdec_cli.config import data_dir
        from specdec_cli.drafters.corpus import CorpusDrafter
        from specdec_cli.stores.corpus import CorpusSet, list_corpora

        name = None if spec.corpus == "auto" else spec.corpus
        if name is not None and name not in {d.name for d in list_corpora(data_dir(), fingerprint)}:
            raise UsageError(
                f"No corpus named {name!r} for this model's tokenizer.",
                "See them with specdec learn --list, or learn one: specdec learn PATH --name NAME.",
            )
        return CorpusDrafter(CorpusSet(data_dir(), fingerprint, name))

    def _predictor(self, prediction: np.ndarray) -> Drafter:
        """The drafter of one generation's predicted output (int32 [m] target tokens)."""
        from specdec_cli.drafters.predict import PredictionDrafter

        target = self.session.target
        return PredictionDrafter(
            prediction,
            piece=target.piece,
            tokenize=lambda text: target.tokenize(text, add_special=False, parse_special=False),
        )

    # -- K controllers ------------------------------------------------------------------------------------------
    def make_controller(self, spec: SpecOptions, *, saved_k: int | None = None, fresh: bool = False) -> KController:
        """FixedK for a number, AdaptiveK for "auto" (or the K saved by `specdec tune --save`).

        `--k auto` keeps learning across the generations of an assembler: the same `AdaptiveK` (costs, acceptance
        by match length) serves every generation with this method and k_max, so the second reply of a chat or a
        repeated workload starts where the first left off; and across runs, through `specdec_cli.stores.learnt`: a
        new one starts from what the last run with these models, method and machine learnt, and `close` saves it.
        `fresh=True` gives a new one that learns from nothing and is not saved (benchmarks of a cold start).
        """
        from specdec_cli.core.controller import FixedK
        from specdec_cli.core.cost_model import CostPrior

        curve = self.session.verify_curve()  # this machine's measured v(b): K is chosen on its cheap sizes
        # the draft model's cost per token where `open_session` timed it (auto on a GPU): its K follows it at once
        draft_ms = getattr(self.session, "draft_ms", None)
        prior = (
            CostPrior(draft_ms_per_token=draft_ms) if draft_ms is not None and spec.method in USES_DRAFT_MODEL else None
        )
        if spec.fixed_k is not None:
            return FixedK(spec.fixed_k, curve)
        if saved_k is not None:
            return FixedK(saved_k, curve)
        if fresh:
            return AdaptiveK(k_max=spec.k_max, curve=curve, prior=prior)
        key = (spec.method, spec.k_max)
        if key not in self._controllers:
            from specdec_cli.stores import learnt

            ctrl = AdaptiveK(k_max=spec.k_max, curve=curve, prior=prior)
            learnt.restore(ctrl, self._learnt_key(*key))
            self._controllers[key] = ctrl
        return self._controllers[key]

    def _learnt_key(self, method: Method, k_max: int) -> str | None:
        from specdec_cli.stores import learnt

        s = self.session
        draft = s.draft_path if method in USES_DRAFT_MODEL else None
        return learnt.entry_key(s.target_path, draft, method, s.options.threads, k_max, s.placement())

    def save_learnt(self) -> None:
        """Save what each `--k auto` controller learnt (`specdec_cli.stores.learnt`; a failure warns), and mark the
        verify curve stale, with the reason (`drift_why`), when the passes timed here drifted from its prediction at
        their depth (`curve_drifted`): the next session measures it again. Not a provisional curve, nor one timed at
        one depth (both measured again anyway), nor one measured because passes had drifted from the curve before it
        (`PASSES_OFF`): a machine whose passes never meet a fresh curve gets one measurement for it, not one per
        run."""
        from dataclasses import replace

        from specdec_cli.stores import learnt

        keyed, details = {}, {}
        for (method, k_max), ctrl in self._controllers.items():
            key = self._learnt_key(method, k_max) if ctrl.model.steps > 0 else None
            if key is not None:
                keyed[key] = ctrl
                details[key] = {"target": Path(self.session.target_path).name, "method": method, "k_max": k_max}
        curves = {}
        curve = self.session.verify_curve(measure=False) if self._controllers or self._watch is not None else None
        if (
            curve is not None
            and curve.depth
            and not curve.provisional
            and not curve.stale
            and PASSES_OFF not in curve.measured_for
            and self.curve_drifted()
        ):
            key = self.session.curve_key()
            if key is not None:
                curves[key] = {
                    "curve": replace(curve, stale=True, stale_why=self.drift_why()).to_dict(),
                    "target": Path(self.session.target_path).name,
                }
        learnt.save(keyed, details, curves=curves)

    def save(self) -> None:
        """Save what the drafters and `--k auto` learnt so far, and go on (`specdec serve` saves as it serves, so a
        crash loses at most what was learnt since the last save); a failure only warns."""
        for drafter in self._drafters.values():
            if drafter is not None:
                drafter.save()
        self.save_learnt()

    # -- closing ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the drafters (learning drafters save what they learnt), then save what `--k auto` learnt (a failure
        only warns). The session stays open."""
        for drafter in self._drafters.values():
            if drafter is not None:
                drafter.close()
        self._drafters.clear()
        self.save_learnt()

    def __enter__(self) -> Assembler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tuned_k(session: Session, spec: SpecOptions) -> int | None:
    """The tuned-K rule, the one place it is written: when `spec` leaves K open (`SpecOptions.wants_tuned_k`: no
    --k given, a method that drafts), the fixed K `specdec tune --save` chose for this pair, method and machine
    (`stores.tuned.lookup`), for `Assembler.engine(spec, saved_k=...)`; None: K is `spec.k` (also for a saved
    "auto"). Prints nothing: the front end says so."""
    if not spec.wants_tuned_k:
        return None
    from specdec_cli.stores.tuned import lookup

    return lookup(session.target_path, session.draft_path, spec.method, session.target.n_threads, session.placement())


def notes(session: Session, spec: SpecOptions, stats: RunStats, *, predicted: bool) -> tuple[str, ...]:
    """One line each, for the front end to print under the statistics: why `auto` drafts without a draft model, and
    a prediction that was never drafted from (`predicted`: the user gave one)."""
    out = []
    if spec.method is Method.auto and session.draft is None and session.draft_plan.reason:
        out.append(f"no draft model: {session.draft_plan.reason}.")
    if predicted and spec.method in USES_PREDICTION and Source.predict not in stats.by_source:
        out.append(
            "the prediction was never drafted from: the reply did not follow it, or another source (the "
            "prompt, past outputs) offered the same text first."
        )
    rollback = getattr(session.target, "rollback", "kv")
    if spec.method is not Method.none and rollback == "none":
        out.append(
            f"plain decoding: llama.cpp cannot copy the recurrent state of this {session.target.kind} model, "
            "so a rejected draft could not be rolled back."
        )
    return tuple(out)
