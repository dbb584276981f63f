"""The Rich tables and charts `specdec tune` and `specdec bench` share: one table style, tok/s cells with their
speedup coloured, J/token cells, and horizontal speedup bars."""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table
from rich.text import Text


def speed_style(speedup: float) -> str:
    """Green from 1× up, red below."""
    return "spec.good" if speedup >= 1.0 else "spec.bad"


def results_table(**kwargs) -> Table:
    """An empty table in the style of every sweep report."""
    return Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, **kwargs)


def speed_cell(tokens_per_s: float | None, speedup: float | None) -> Text:
    """ "12.3 1.45×": tok/s, then the speedup over plain decoding (when given), coloured."""
    cell = Text("–" if tokens_per_s is None else f"{tokens_per_s:.1f}")
    if speedup is not None:
        cell.append(f" {speedup:.2f}×", style=speed_style(speedup))
    return cell


ENERGY_HEADER = "J/\ntoken"  # the energy column's heading (decoding's joules per output token)


def energy_cell(j_per_token: float | None) -> Text:
    """ "0.253": decoding's joules per output token from the host's counters; a dim "n/a" without them (the report's
    note says why): never an estimate."""
    return Text("n/a", style="spec.label") if j_per_token is None else Text(f"{j_per_token:.3g}")


@dataclass(frozen=True, slots=True)
class Bar:
    """One bar of `speedup_chart`: `plain` draws it dim (plain decoding itself), `best` makes its value bold."""

    label: str
    speedup: float
    plain: bool = False
    best: bool = False


def speedup_chart(title: str, groups: list[tuple[str, list[Bar]]], width: int) -> Table:
    """Horizontal bars of speedups over plain decoding, one row per `Bar`, under each group's heading (a group named
    "" has none); the bars share one scale, and a dim │ marks 1×."""
    chart = Table.grid(padding=(0, 1))
    chart.add_column(justify="right", no_wrap=True)
    chart.add_column(no_wrap=True)
    chart.add_column(justify="right", no_wrap=True)
    chart.add_row("", Text(title, style="bold"), "")
    values = [b.speedup for _, bars in groups for b in bars]
    if not values:
        chart.add_row("", Text("(no complete measurement)", style="spec.label"), "")
        return chart
    scale = max([1.0] + values)
    one = max(0, round(width / scale) - 1)
    for heading, bars in groups:
        if heading:
            chart.add_row(Text(heading, style="bold"), "", "")
        for b in bars:
            n = round(width * b.speedup / scale)
            bar = Text("█" * n, style="spec.label" if b.plain else speed_style(b.speedup))
            if n <= one:
                bar.append(" " * (one - n) + "│", style="spec.label")
            bar.append(" " * (width - len(bar)))
            chart.add_row(
                Text(b.label, style="spec.label"), bar, Text(f"{b.speedup:.2f}×", style="bold" if b.best else "")
            )
    return chart
