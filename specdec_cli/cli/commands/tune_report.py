"""`specdec tune`'s report: the results table, the speedup chart and the verify-cost curve, as Rich renderables."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from specdec_cli.cli import tables
from specdec_cli.cli.curve_view import curve_caption, curve_table
from specdec_cli.cli.tables import ENERGY_HEADER, Bar, energy_cell, speed_cell, speed_style
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.measure.tune import AUTO_MARGIN, ConfigSummary, TuneConfig, TuneOptions
from specdec_cli.prompts import PromptCase
from specdec_cli.spec import SpecOptions


def header(
    session, spec: SpecOptions, prompts: list[PromptCase], options: TuneOptions, config: GenerationConfig
) -> str:
    """The report's first line: the model pair, the method, prompts × repeats and the token budget."""
    pair = session.target_path.name + (f" + {session.draft_path.name}" if session.draft_path else "")
    from specdec_cli.session import kernels_line

    return (
        f"specdec tune: {pair}, --method {spec.method}, {len(prompts)} prompt{'s' * (len(prompts) != 1)} × "
        f"{options.repeats} repeat{'s' * (options.repeats != 1)}, {config.max_tokens} max tokens\n"
        + kernels_line(session.kernels())
    )


def report(
    summaries: list[ConfigSummary],
    prompts: list[str],
    best: TuneConfig | None,
    curve: list[tuple[int, float, int]],
    draft_ms: float | None,
    *,
    header: str = "",
    partial: str | None = None,
    measured: VerifyCurve | None = None,
) -> Group:
    """The results table, the speedup chart, the verify-cost curve (the machine's measured one with its cheap sizes
    starred and the tune's own median per size beside it, when there is one: `measured`) and the verdict, as one
    Rich renderable."""
    parts: list[Any] = [Text(header, style="bold")] if header else []
    parts += [
        results_table(summaries, prompts, best),
        Text(
            "per prompt: tok/s (median of repeats) and speedup over plain decoding on that prompt; "
            "overall: geometric mean of the speedups; tok/pass, ms/pass: per target pass; cheap sizes: the "
            "share of passes whose b no larger pass undercuts on the measured curve; J/token: decoding's "
            "joules per output token from this host's counters (docs/energy.md)",
            style="spec.label",
        ),
    ]
    note = next((s.energy_note for s in summaries if s.j_per_token is None and s.energy_note), None)
    if note:
        parts.append(Text(f"J/token n/a: {note}", style="spec.label"))
    auto = next((s for s in summaries if s.config.label == "auto" and s.k_histogram), None)
    if auto is not None:
        hist = "  ".join(f"K={k}:{n}" for k, n in sorted(auto.k_histogram.items()))
        parts.append(Text(f"auto chose K = {auto.mean_k:.1f} on average (steps by K: {hist})", style="spec.label"))
    parts += [Text(""), speedup_chart(summaries, best), Text("")]
    if measured is not None:
        parts += [
            Text(
                "the verify curve measured on this machine: ms of one target pass over b tokens (run: the "
                "tune's own median)",
                style="bold",
            ),
            curve_table(measured, {b: ms for b, ms, _ in curve}),
            curve_caption(measured),
        ]
    else:
        parts += [
            Text("target forward pass by batch size (median over the tune's steps)", style="bold"),
            cost_table(curve),
        ]
    parts.append(
        Text(
            "drafting: "
            + (
                f"{draft_ms:.2f} ms per drafted token (median over steps)"
                if draft_ms is not None
                else "nothing was drafted"
            ),
            style="spec.label",
        )
    )
    if partial:
        parts.append(Text(f"Interrupted after {partial}: the numbers above cover only those.", style="spec.warn"))
    elif best is not None:
        win = next(s for s in summaries if s.config == best)
        line = Text.assemble(
            ("best ", "spec.label"),
            (best.title, "bold"),
            f": {win.speedup_geomean:.2f}× plain decoding (geometric mean over prompts)",
        )
        top = max((s for s in summaries if s.speedup_geomean is not None), key=lambda s: s.speedup_geomean or 0.0)
        if best.label == "auto" and top.config != best:
            line.append(
                f"; {top.config.title} measured {top.speedup_geomean:.2f}×, within "
                f"{AUTO_MARGIN:.0%}, and auto also adapts to other prompts",
                style="spec.label",
            )
        parts.append(line)
    return Group(*parts)


def results_table(summaries: list[ConfigSummary], prompts: list[str], best: TuneConfig | None) -> Table:
    """One row per configuration: per prompt tok/s and speedup, then the pooled figures."""
    table = tables.results_table()
    table.add_column("config", no_wrap=True)
    for p in prompts:
        table.add_column(p, justify="right", overflow="fold", min_width=12)
    table.add_column("overall", justify="right", no_wrap=True)
    table.add_column("accept", justify="right", no_wrap=True)
    table.add_column("mean\nacc. len", justify="right", no_wrap=True)
    table.add_column("tok/\npass", justify="right", no_wrap=True)
    table.add_column("ms/\npass", justify="right", no_wrap=True)
    table.add_column("cheap\nsizes", justify="right", no_wrap=True)
    table.add_column(ENERGY_HEADER, justify="right", no_wrap=True)
    for s in summaries:
        plain = s.config.label == "none"
        spec = s.n_drafted > 0  # acceptance means nothing without drafts
        cells: list[Any] = [Text(s.config.title, style="bold" if s.config == best else "")]
        cells += [speed_cell(s.tokens_per_s.get(p), None if plain else s.speedup.get(p)) for p in prompts]
        g = s.speedup_geomean
        cells.append(Text("–") if g is None else Text(f"{g:.2f}×", style="spec.label" if plain else speed_style(g)))
        cells.append(f"{s.acceptance_rate:.0%}" if spec else ("" if plain else "–"))
        cells.append(f"{s.mean_accepted_length:.2f}" if spec else ("" if plain else "–"))
        cells += [
            f"{s.tokens_per_pass:.2f}",
            f"{s.ms_per_pass:.0f}",
            f"{s.cheap_share:.0%}" if s.cheap_share is not None else "–",
            energy_cell(s.j_per_token),
        ]
        table.add_row(*cells)
    return table


def speedup_chart(summaries: list[ConfigSummary], best: TuneConfig | None, width: int = 40) -> Table:
    """Horizontal bars of the overall speedup by configuration; a dim │ marks 1× (plain decoding)."""
    bars = [
        Bar(s.config.title, s.speedup_geomean, plain=s.config.label == "none", best=s.config == best)
        for s in summaries
        if s.speedup_geomean is not None
    ]
    return tables.speedup_chart("speedup over plain decoding", [("", bars)], width)


def cost_table(curve: list[tuple[int, float, int]]) -> Table:
    """The measured verify-cost curve: (batch size, median ms, passes) as ms, ms per token and ratio to batch 1."""
    t = tables.results_table()
    t.add_column("batch", justify="right")
    t.add_column("ms", justify="right")
    t.add_column("ms / token", justify="right")
    t.add_column("× batch 1", justify="right")
    t.add_column("passes", justify="right")
    v1 = curve[0][1] if curve and curve[0][0] == 1 else None
    for b, ms, n in curve:
        t.add_row(str(b), f"{ms:.1f}", f"{ms / b:.1f}", f"{ms / v1:.2f}" if v1 else "", str(n))
    return t
