"""`specdec check`: a losslessness audit of greedy speculative decoding on your own models and hardware.

It generates with speculative decoding, then re-scores the output with the target one token at a time from an
empty cache (`audit.teacher_force`: the numerics of plain decoding) and flags every position where the emitted
token is not the target's batch-1 argmax. A flagged position whose margin is below the near-tie threshold is a
numerical near-tie (llama.cpp's logits depend on the batch size); any other is a divergence: exit code 7.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specdec_cli.assemble import Assembler
from specdec_cli.cli.console import RichReporter, err_console, make_console, status, write_json
from specdec_cli.cli.inputs import check_output_path
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import Result, generate
from specdec_cli.errors import CheckFailedError, UsageError
from specdec_cli.measure.audit import DIVERGENCE, NEAR_TIE_THRESHOLD, AuditReport, audit_output
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions


def refuse_sampling(config: GenerationConfig) -> None:
    """Raise UsageError when `config` samples: this check is token-exact, so greedy only."""
    if not config.sampling.greedy:
        raise UsageError(
            f"specdec check is greedy only (got --temperature {config.sampling.temperature:g}): with sampling the "
            "output is random by design, and rejection sampling is checked statistically instead "
            "(chi-square tests against the target distribution; docs/check.md).",
            "Drop --temperature.",
        )


def report_table(report: AuditReport) -> Table:
    """The flagged positions: position, emitted token, batch-1 argmax, margin (logits), verdict."""
    table = Table(title="Tokens that are not the target's batch-1 argmax", title_justify="left", show_edge=False)
    table.add_column("position", justify="right")
    table.add_column("emitted")
    table.add_column("batch-1 argmax")
    table.add_column("margin", justify="right")
    table.add_column("verdict")
    for f in report.flags:
        style = "spec.bad" if f.verdict == DIVERGENCE else "spec.warn"
        table.add_row(
            str(f.position), Text(f.token_text), Text(f.argmax_text), f"{f.margin:.3f}", Text(f.verdict, style=style)
        )
    return table


def summary_line(report: AuditReport) -> Text:
    """checked N positions: near-tie flips, divergences, largest margin, PASS/FAIL."""
    n = report.n_checked
    share = f" ({report.near_ties / n:.1%})" if n else ""
    return Text.assemble(
        ("check ", "spec.label"),
        f"{n} positions re-scored one token at a time: {report.near_ties} near-tie flips{share}, "
        f"{report.divergences} divergences; largest margin {report.largest_margin:.3f} logits "
        f"(near-tie threshold {float(report.threshold)})  ",
        ("PASS", "spec.good") if report.passed else ("FAIL", "spec.bad"),
    )


def print_report(console: Console, report: AuditReport) -> None:
    if report.flags:
        console.print(report_table(report))
    else:
        console.print(Text("Every emitted token is the target's batch-1 argmax.", style="spec.good"))
    console.print(summary_line(report))


def execute(
    prompt_text: str,
    *,
    models: ModelOptions,
    spec: SpecOptions,
    config: GenerationConfig,
    json_path: str | None,
    raw: bool,
    system: str | None,
    threshold: float = NEAR_TIE_THRESHOLD,
) -> int:
    """Run `specdec check`. Returns 0 (pass) or 130 (interrupted); raises CheckFailedError (exit 7) on a divergence."""
    refuse_sampling(config)
    check_output_path(json_path)  # a bad --json path fails before the generation, not after
    err = err_console()
    out = err if json_path == "-" else make_console()
    with (
        open_session(models, method=spec.method, reporter=RichReporter(err)) as session,
        Assembler(session) as assembler,
    ):
        prompt = session.prompt_tokens(prompt_text, raw=raw, system=system)
        engine = assembler.engine(spec)
        with status(err, f"Generating with --method {spec.method}"):
            result = generate(engine, prompt, config)
        if result.interrupted:
            return 130
        with status(err, f"Re-scoring {len(result.tokens)} tokens one at a time"):
            report = audit_output(
                session.target,
                prompt,
                result.tokens,
                ended_with_eog=result.stats.finish_reason == "eog",
                threshold=threshold,
                grammar=config.grammar,
            )
        print_report(out, report)
        if json_path:
            _write_json(json_path, session, spec, config, result, report)
    if not report.passed:
        first = next(f for f in report.flags if f.verdict == DIVERGENCE)
        raise CheckFailedError(
            f"{report.divergences} emitted token(s) are not the target's batch-1 argmax by more than "
            f"{float(threshold)} logits (first at position {first.position}: {first.token_text} "
            f"where the target prefers "
            f"{first.argmax_text} by {first.margin:.3f}).",
            "That is not a numerical near-tie: please report it with the --json output.",
        )
    return 0


def _write_json(
    path: str, session, spec: SpecOptions, config: GenerationConfig, result: Result, report: AuditReport
) -> None:
    from specdec_cli.models.llama import system_info

    doc = {
        "check": report.to_dict(),
        "numerics": "margins are from the target evaluated one token at a time from an empty cache, as plain "
        "decoding does (teacher forcing along the speculative output)",
        "text": result.text,
        "tokens": result.tokens,
        "finish_reason": result.stats.finish_reason,
        "stats": result.stats.to_dict(),
        "config": {
            "target": str(session.target_path),
            "draft": str(session.draft_path) if session.draft_path else None,
            "method": spec.method,
            "k": spec.k,
            "max_tokens": config.max_tokens,
            "stop": list(config.stop),
            "grammar": config.grammar.name if config.grammar is not None else None,
            "ctx": session.target.n_ctx,
            "threads": session.target.n_threads,
        },
        "system_info": system_info(),
    }
    write_json(path, doc)
