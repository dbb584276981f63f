"""One place that turns options into a ready generation, and drives it.

`make_engine` builds the drafter and the K controller a `SpecOptions` names and the `SpeculativeEngine` around the
session's target; `generate` consumes the engine's records into a `Generation`, handing each `Step` to a callback
(the renderer, a time-to-first-token clock, a server's stream); `plain_compare` is the plain-decoding run that
`run --compare` measures against. Every command (run, check, chat, tune, bench) goes through these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from specdec_cli.audit import NEAR_TIE_THRESHOLD, Divergence, FirstMismatchProbe, compare_divergence
from specdec_cli.controller import KController
from specdec_cli.drafters.base import Drafter
from specdec_cli.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.options import parse_k_option
from specdec_cli.records import Step
from specdec_cli.stats import RunStats, summarize

if TYPE_CHECKING:
    from specdec_cli.session import Session, SpecOptions

_BUILD = object()  # make_engine's default: build the drafter `spec.method` names


def make_engine(session: Session, spec: SpecOptions, *, fresh: bool = False, saved_k: int | None = None,
                drafter: Drafter | None | object = _BUILD, controller: KController | None = None) -> SpeculativeEngine:
    """The engine for `spec` on the session's target: its drafter (`Session.make_drafter`, None for method none)
    and, with a drafter, its K controller (`Session.make_controller`: `--k N`, the K `specdec tune --save` chose
    when `saved_k` is given, else the session's learning `--k auto`, or a new one that learns from nothing when
    `fresh`), and the session's prompt cache (`Session.prompt_cache`; not for a `fresh` engine: benchmarks of a
    cold start).

    Args:
        drafter: use this drafter instead of building one (a sweep reuses one drafter across its runs); None =
            plain decoding.
        controller: use this K controller instead of the session's (`run --compare` replays the shown run from a
            copy of the controller it started with).

    Raises:
        UsageError: a bad --k (checked also for method none), a method that needs a draft model none is loaded.
    """
    parse_k_option(spec.k)
    if drafter is _BUILD:
        drafter = session.make_drafter(spec)
    if controller is None and drafter is not None:
        controller = session.make_controller(spec, saved_k=saved_k, fresh=fresh)
    return SpeculativeEngine(session.target, drafter, controller,
                             prompt_cache=None if fresh else session.prompt_cache)


def saved_k(session: Session, spec: SpecOptions, console) -> int | None:
    """The fixed K `specdec tune --save` chose for this pair, method and machine (None: auto), announced on
    `console` (stderr) when there is one."""
    from rich.text import Text

    from specdec_cli.tuned import lookup, tuned_path

    k = lookup(session.target_path, session.draft_path, spec.method, getattr(session.target, "n_threads", None))
    if k is not None:
        console.print(Text(f"K = {k} from specdec tune ({tuned_path()}); --k auto adapts it instead.",
                           style="spec.label"))
    return k


@dataclass
class Generation:
    """What one generation produced: its records' summary, text and tokens."""

    text: str
    tokens: list[int]
    stats: RunStats
    steps: list[Step]
    interrupted: bool = False


def generate(engine: SpeculativeEngine, prompt: np.ndarray, config: GenerationConfig,
             on_step: Callable[[Step], None] | None = None) -> Generation:
    """Drive the engine over `prompt` (int32 [n]), calling `on_step` with each `Step` as it arrives.

    Ctrl-C ends the generation with what was produced kept (`Generation.interrupted`, finish reason
    "interrupted"); the engine's cache then holds only committed tokens. Decode time (`RunStats.decode_ms`) is the
    wall time from the end of the prefill to the last record.
    """
    records = []
    steps: list[Step] = []
    interrupted = False
    gen = engine.generate(prompt, config)
    t0 = None
    try:
        for rec in gen:
            records.append(rec)
            if isinstance(rec, Step):
                steps.append(rec)
                if on_step is not None:
                    on_step(rec)
            elif t0 is None:
                t0 = time.perf_counter()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        gen.close()  # runs the engine's finally: the KV cache keeps only committed tokens
    loop_ms = (time.perf_counter() - t0) * 1e3 if t0 is not None else 0.0
    if not interrupted and t0 is not None:
        engine.save_prompt()  # for a later run that starts with the same tokens (not timed)
    stats = summarize(records, decode_ms=loop_ms if steps else 0.0,
                      finish_reason="interrupted" if interrupted else None)
    text = "".join(s.text for s in steps)
    tokens = [t for s in steps for t in s.emitted]
    return Generation(text=text, tokens=tokens, stats=stats, steps=steps, interrupted=interrupted)


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
    if predicted and spec.method in ("auto", "predict") and "predict" not in stats.by_source:
        out.append("the prediction was never drafted from: the reply did not follow it, or another source (the "
                   "prompt, past outputs) offered the same text first.")
    return tuple(out)
