"""`specdec run`: one prompt, streamed, then statistics (and optionally a plain-decoding comparison)."""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from rich.text import Text

from specdec_cli.assemble import Assembler, notes, tuned_k
from specdec_cli.cli.console import RichReporter, err_console, status, wants_color, write_json
from specdec_cli.cli.inputs import check_output_path
from specdec_cli.cli.render import StreamRenderer, announce_tuned_k, legend, print_compare, print_stats
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import Result, generate
from specdec_cli.errors import CheckFailedError, UsageError
from specdec_cli.measure.audit import DIVERGENCE, Divergence
from specdec_cli.measure.comparison import against_plain
from specdec_cli.models.energy import unavailable_dict
from specdec_cli.session import Session, open_session
from specdec_cli.spec import Method, ModelOptions, SpecOptions


@dataclass(frozen=True)
class OutputOptions:
    plain: bool = False
    clean: bool = False
    json_path: str | None = None
    compare: int = 0  # pairs of `--compare N` (speculative against plain decoding, interleaved); 0 = no comparison
    strict: bool = False  # with compare: a greedy divergence that is not a near-tie raises CheckFailedError (exit 7)
    idle_baseline: bool = False  # measure a second of idle power first; energy is then also given net of it


def execute(
    prompt_text: str,
    *,
    models: ModelOptions,
    spec: SpecOptions,
    config: GenerationConfig,
    output: OutputOptions,
    raw: bool,
    system: str | None,
    prediction: str | None = None,
) -> int:
    """Run one prompt. Returns the exit code (130 when interrupted).

    prediction: the text of `--predict FILE` (predicted outputs), drafted from by auto and predict.

    When `spec` leaves K open (no --k), the K saved by `specdec tune --save` for these models, method and machine
    is used when there is one (`assemble.tuned_k`); otherwise `spec.k`.
    """
    if output.strict and not config.sampling.greedy:
        raise UsageError(
            "--strict checks greedy output token by token and explains a divergence by greedy margins; "
            "with --temperature above 0 only a --seed makes the outputs agree token by token, and its "
            "near-ties are not explained.",
            "Drop --strict, or use --temperature 0.",
        )
    if spec.method is Method.predict and prediction is None:
        raise UsageError(
            "--method predict drafts from a predicted output, and none was given.",
            "Add --predict FILE (the text you expect back), or use --method auto.",
        )
    check_output_path(output.json_path)  # a --json path that cannot be written fails now, not after the generation
    err = err_console()
    json_to_stdout = output.json_path == "-"
    # The text goes to stdout, unless stdout is reserved for JSON (then it is shown on stderr if that is a terminal).
    out_stream = sys.stderr if json_to_stdout else sys.stdout
    styled = wants_color(out_stream, output.plain)
    show_stream = not json_to_stdout or styled

    with (
        open_session(models, method=spec.method, reporter=RichReporter(err)) as session,
        Assembler(session) as assembler,
    ):
        prompt = session.prompt_tokens(prompt_text, raw=raw, system=system)
        config = replace(config, prediction=session.prediction_tokens(prediction))
        saved_k = tuned_k(session, spec)
        announce_tuned_k(err, saved_k)
        engine = assembler.engine(spec, saved_k=saved_k)
        renderer = StreamRenderer(out_stream, styled=styled, show_rejected=not output.clean) if show_stream else None
        if styled and spec.method != Method.none:
            err.print(legend(spec.method, grammar=config.grammar is not None))
        # --compare replays this run: a drafter in the state this one starts in (built now, before this run's reply
        # is learnt; owned here, not the assembler's) and a copy of the controller this one starts with
        replay = (assembler.make_drafter(spec), copy.deepcopy(engine.controller)) if output.compare else None
        idle_w = _idle_baseline(err) if output.idle_baseline else None
        try:
            result = generate(engine, prompt, config, renderer.step if renderer is not None else None)
        finally:
            if renderer is not None:
                renderer.end()  # also before an error's message: the text gathered for the screen is shown
        if idle_w is not None and result.stats.energy is not None:
            result = replace(result, stats=replace(result.stats, energy=result.stats.energy.net_of(idle_w)))

        print_stats(
            err,
            result.stats,
            method=spec.method,
            notes=notes(session, spec, result.stats, predicted=prediction is not None),
        )
        compare = None
        if replay is not None:
            try:
                if not result.interrupted:
                    compare = _compare(session, spec, prompt, config, result, output.compare, replay, err)
            except KeyboardInterrupt:
                err.print(Text("--compare interrupted: no speedup to report.", style="spec.warn"))
                result = replace(result, interrupted=True)
            finally:
                if replay[0] is not None:
                    replay[0].close()  # it learnt nothing: nothing is saved
        if output.json_path:
            k_source = "tuned" if saved_k is not None else ("option" if spec.k_given else "default")
            _write_json(
                output.json_path,
                session,
                spec,
                config,
                result,
                compare,
                k=str(saved_k) if saved_k is not None else spec.k,
                k_source=k_source,
            )
    if output.strict and compare is not None and compare["verdict"] == DIVERGENCE:
        d = compare["divergence"]
        margin = "unknown" if d["margin"] is None else f"{d['margin']:.3f} logits >= {float(d['threshold'])}"
        raise CheckFailedError(
            f"The speculative output left plain decoding at token {d['position']} ({d['spec_text']} instead of "
            f"{d['plain_text']}), and that is not a numerical near-tie (margin {margin}).",
            "Run specdec check with the same options to see every position.",
        )
    return 130 if result.interrupted else 0


def _idle_baseline(err) -> float | None:
    """`--idle-baseline`: the mean power (W) of a second of doing nothing, from the same counters (None without
    any: the run's figures say why)."""
    from specdec_cli.models.energy import IDLE_SECONDS, default_meter, idle_watts

    meter = default_meter()
    if not meter.available:
        return None
    with status(err, f"--idle-baseline: {IDLE_SECONDS:.0f} s of idle power"):
        return idle_watts(meter)


def _compare_energy(c) -> dict:
    """--json's compare.energy: each side's decoding joules and J per output token (medians over the pairs, and per
    pair), their ratio's median, min and max; or why there is none, with no number."""
    e = c.energy
    if e is None:
        return unavailable_dict(c.energy_note)
    joules = lambda rs: [round(g.stats.energy.decode_j, 4) for g in rs]  # noqa: E731
    return {
        "available": True,
        "speculative_j_per_token": e.a_median,
        "plain_j_per_token": e.b_median,
        "ratio": e.median,
        "ratio_min": e.low,
        "ratio_max": e.high,  # speculative / plain, per pair
        "speculative_decode_joules": joules(e.a_results),
        "plain_decode_joules": joules(e.b_results),
        "each_pair": e.to_dict("speculative_j_per_token", "plain_j_per_token")["each"],
    }


def _compare(
    session: Session,
    spec: SpecOptions,
    prompt: np.ndarray,
    config: GenerationConfig,
    shown: Result,
    pairs: int,
    replay,
    err,
) -> dict:
    """Plain decoding of the same prompt in this process, in `pairs` interleaved pairs with a replay of the shown
    run (`comparison.against_plain`): the median speedup and its spread, and the agreement check."""
    drafter, controller = replay
    with status(err, f"--compare: {pairs} pair{'s' * (pairs != 1)} of speculative and plain decoding, interleaved"):
        c = against_plain(session, spec, prompt, config, shown.tokens, pairs, drafter=drafter, controller=controller)
    plain = c.plain
    note: Divergence | str | None
    if config.sampling.greedy:
        note = c.divergence
    elif config.sampling.seed is None:
        note = (
            "sampling: the two runs drew different random numbers; speculative sampling is lossless in "
            "distribution, not token by token (with --seed, token by token)"
        )
    else:  # seeded: each position's draw is keyed, so the outputs part only where the batch shape moved a logit
        same = c.shared == len(shown.tokens) == len(plain.tokens)
        note = (
            None
            if same
            else (
                "sampling with --seed: the outputs part where llama.cpp's logits, which depend on "
                "the batch shape, moved the seed's draw (a near-tie)"
            )
        )
    print_compare(
        err,
        c.paired,
        shared=c.shared,
        n_spec=len(shown.tokens),
        n_plain=len(plain.tokens),
        divergence=note,
        control=spec.method == Method.none,
        energy=c.energy,
        energy_note=c.energy_note,
    )
    return {
        "pairs": len(c.paired.pairs),
        "speculative_tokens_per_s": c.paired.a_median,  # medians over the pairs
        "plain_tokens_per_s": c.paired.b_median,
        "speedup": c.speedup,  # the median over the pairs of the per-pair ratio
        "speedup_min": c.paired.low,
        "speedup_max": c.paired.high,
        "each_pair": c.paired.to_dict("speculative_tokens_per_s", "plain_tokens_per_s")["each"],
        "shared_prefix_tokens": c.shared,
        "n_speculative": len(shown.tokens),
        "n_plain": len(plain.tokens),
        "identical": shown.tokens == plain.tokens,
        # greedy only: where the outputs first differ, judged by the plain (batch-1) run's own logit margin there
        "divergence": c.divergence.to_dict() if c.divergence is not None else None,
        "verdict": (c.divergence.verdict if c.divergence is not None else "identical")
        if config.sampling.greedy
        else None,
        "plain_text": plain.text,
        "plain_stats": plain.stats.to_dict(),
        "energy": _compare_energy(c),
    }


def _write_json(
    path: str,
    session: Session,
    spec: SpecOptions,
    config: GenerationConfig,
    result: Result,
    compare: dict | None,
    *,
    k: str,
    k_source: str,
) -> None:
    from specdec_cli.models.llama import system_info

    doc: dict[str, Any] = {
        "text": result.text,
        "tokens": result.tokens,
        "finish_reason": result.stats.finish_reason,
        "interrupted": result.interrupted,
        "stats": result.stats.to_dict(),
        "config": {
            "target": str(session.target_path),
            "draft": str(session.draft_path) if session.draft_path else None,
            "method": spec.method,
            "corpus": spec.corpus,  # --corpus: auto (every corpus learnt for this tokenizer), off, or a name
            "k": k,
            "k_source": k_source,  # "option" (--k), "tuned" (specdec tune --save) or "default" (auto)
            "max_tokens": config.max_tokens,
            "stop": list(config.stop),
            "sampling": asdict(config.sampling),
            "ctx": session.target.n_ctx,
            "threads": session.target.n_threads,
            "prediction_tokens": len(config.prediction) if config.prediction is not None else None,
            "grammar": config.grammar.name if config.grammar is not None else None,
            "logprobs": config.logprobs,
            "draft_model": session.draft_plan.reason or None,  # why a draft model is (not) used
        },
        # OpenAI's names for predicted outputs (stats.by_source has every source's drafted/accepted)
        "usage": {
            "completion_tokens": len(result.tokens),
            "completion_tokens_details": {
                "accepted_prediction_tokens": result.stats.accepted_prediction_tokens,
                "rejected_prediction_tokens": result.stats.rejected_prediction_tokens,
            },
        },
        "system_info": system_info(),
        "steps": [
            {
                "k": s.k,
                "drafted": list(s.drafted),
                "n_accepted": s.n_accepted,
                "target_token": s.target_token,
                "emitted": list(s.emitted),
                "draft_ms": round(s.draft_ms, 3),
                "verify_ms": round(s.verify_ms, 3),
                "source": s.source,
            }
            for s in result.steps
        ],
        "compare": compare,
    }
    if config.logprobs is not None:  # one entry per emitted token, from the verify rows (OpenAI's shape)
        piece = session.target.piece
        text_of = lambda t: piece(t).decode("utf-8", "replace")  # noqa: E731
        doc["logprobs"] = [
            {
                "token": lp.token,
                "text": text_of(lp.token),
                "logprob": lp.logprob,
                "top_logprobs": [{"token": t, "text": text_of(t), "logprob": v} for t, v in lp.top],
            }
            for s in result.steps
            for lp in s.logprobs
        ]
    write_json(path, doc)
