"""`specdec tune`: measure decoding speed by K on this machine, for one model pair and method, and save the best.

What runs, in which order, and how the best setting is chosen: `specdec_cli.measure.tune`. This command opens the
session, draws the progress bar, prints the report (`tune_report`) and what was saved, and writes --json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text

from specdec_cli.cli.commands.tune_report import header, report
from specdec_cli.cli.console import RichReporter, err_console, make_console, sweep_task, write_json
from specdec_cli.cli.curve_view import check_plot_path, write_curve_plot
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.errors import UsageError
from specdec_cli.measure.sweep import check_prompts, schedule
from specdec_cli.measure.tune import (
    ConfigSummary,
    TuneConfig,
    TuneOptions,
    choose_best,
    configs_for,
    draft_cost,
    json_doc,
    run,
    save_best,
    summarize,
    verify_curve,
)
from specdec_cli.prompts import PromptCase
from specdec_cli.session import open_session
from specdec_cli.spec import Method, ModelOptions, SpecOptions


def execute(
    prompts: list[PromptCase],
    *,
    models: ModelOptions,
    spec: SpecOptions,
    config: GenerationConfig,
    options: TuneOptions,
) -> int:
    """Measure every configuration on `prompts`, print the report, write --json, --save. Returns the exit code
    (130 when interrupted: the runs so far are reported and written, nothing is saved)."""
    if spec.method == Method.none:
        raise UsageError("--method none has no K to tune.", "Use --method draft, ngram or suffix.")
    check_prompts(prompts, "tune on")
    if options.plot:
        check_plot_path(options.plot)
    err = err_console()
    out = err if options.json_path == "-" else make_console()
    configs = configs_for(options.ks)
    with open_session(models, method=spec.method, reporter=RichReporter(err)) as session:
        measured = session.verify_curve()  # measured now (a progress bar) when this machine has none
        with sweep_task(err, "warm-up", len(schedule(len(configs), len(prompts), options.repeats))) as task:
            tune = run(session, prompts, spec=spec, config=config, configs=configs, repeats=options.repeats, task=task)
        measured = session.verify_curve()  # measured again when the passes the tune timed disagreed with it
        names = [p.name for p in prompts]
        summaries = summarize(tune.measurements, configs, names)
        best = choose_best(summaries) if not tune.interrupted else None
        curve = verify_curve(tune.measurements)
        d_ms = draft_cost([m for m in tune.measurements if m.config != "none"])
        out.print(
            report(
                summaries,
                names,
                best,
                curve,
                d_ms,
                header=header(session, spec, prompts, options, config),
                partial=f"{len(tune.measurements)} of {tune.planned} runs" if tune.interrupted else None,
                measured=measured,
            ),
            soft_wrap=False,
        )
        if options.plot and measured is not None:
            write_curve_plot(
                options.plot,
                [(session.target_path.name, measured)],
                f"{tune.machine.get('cpu')}, {tune.machine.get('threads')} threads",
            )
        saved = _save(session, spec, config, options, summaries, best, tune.machine, names, err)
        if options.json_path:
            write_json(
                options.json_path,
                json_doc(session, spec, config, options, prompts, configs, tune, summaries, best, curve, d_ms, saved),
            )
    return 130 if tune.interrupted else 0


def _save(
    session,
    spec: SpecOptions,
    config: GenerationConfig,
    options: TuneOptions,
    summaries: list[ConfigSummary],
    best: TuneConfig | None,
    mach: dict[str, Any],
    names: list[str],
    err,
) -> Path | None:
    """--save: write the best setting to tuned.json (`measure.tune.save_best`) and say so; without --save, say how."""
    if not options.save:
        if best is not None:
            err.print(
                Text("Add --save to make `specdec run` use this setting when --k is not given.", style="spec.label")
            )
        return None
    if best is None:
        err.print(Text("Not saved: the tune did not finish; run it again to save a setting.", style="spec.warn"))
        return None
    saved = save_best(session, spec, config, options, summaries, best, mach, names)
    err.print(
        Text.assemble(
            ("saved ", "spec.label"),
            f"{best.title} for {session.target_path.name}"
            + (f" + {session.draft_path.name}" if session.draft_path else "")
            + f", --method {spec.method}, {mach['threads']} threads → {saved}",
        )
    )
    err.print(Text("`specdec run` uses it when --k is not given.", style="spec.label"))
    return saved
