"""The measured verify curve for people: a Rich table with the cheap sizes marked, and a matplotlib plot (the `plot`
extra). `specdec doctor` and `specdec tune` show it; `verify_curve.VerifyCurve` is the data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from specdec_cli.cli import tables

if TYPE_CHECKING:
    from specdec_cli.core.verify_curve import VerifyCurve

CHEAP_MARK = "*"
PLOT_FORMATS = (".png", ".svg")


def curve_table(curve: VerifyCurve, timed: dict[int, float] | None = None, *, blocks: int = 4) -> Table:
    """v(b) for every measured b, in `blocks` side-by-side column groups (b, ms, ms per token), a ★ on the cheap
    sizes (no larger pass costs less). `timed`: ms per pass the run itself measured by b (tune), shown beside."""
    t = tables.results_table()
    rows = -(-curve.b_max // blocks)
    for i in range(blocks):
        if i:
            t.add_column("│", no_wrap=True)  # its own column, so the rule stays straight whatever b's width
        t.add_column("b", justify="right", no_wrap=True)
        t.add_column("ms", justify="right", no_wrap=True)
        t.add_column("ms/tok", justify="right", no_wrap=True)
        if timed is not None:
            t.add_column("run", justify="right", no_wrap=True)
    for r in range(rows):
        cells: list[Text | str] = []
        for i in range(blocks):
            b = i * rows + r + 1
            if i:
                cells.append("│")
            if b > curve.b_max:
                cells += [""] * (4 if timed is not None else 3)
                continue
            cheap = curve.cheap(b)
            style = "spec.accepted" if cheap else ""
            cells += [
                Text(f"{b}{CHEAP_MARK if cheap else ' '}", style=style),
                Text(f"{curve.at(b):.1f}", style=style),
                f"{curve.at(b) / b:.1f}",
            ]
            if timed is not None:
                cells.append(f"{timed[b]:.1f}" if b in timed else "")
        t.add_row(*cells)
    return t


def curve_caption(curve: VerifyCurve) -> Text:
    """One line under the table: what ★ means, the cheap sizes, how and when it was measured."""
    cheap = ", ".join(str(b) for b in curve.cheap_sizes())
    spread = max(curve.spread, default=0.0)
    sizes = f"{len(curve.sizes)} sizes (the rest interpolated)" if curve.sizes else "every size"
    per_pass, per_row = curve.depth_ms
    deep = (
        f"; at {curve.depth} tokens a pass costs {per_pass:.1f} + {per_row:.2f} b ms more per 1,000 tokens of context"
        if curve.depth
        else "; timed at one depth only"
    )
    if curve.stale:
        state = f"; STALE ({curve.stale_why or 'marked so by an earlier run'}): measured again at the next run"
    elif curve.provisional:
        state = f"; PROVISIONAL ({curve.disturbed}): measured again, once, at the next run"
    elif curve.disturbed:
        state = f"; timed on a busy machine ({curve.disturbed})"
    else:
        state = ""
    return Text(
        f"{CHEAP_MARK} cheap: no larger pass costs less ({cheap}); measured {curve.measured_at or '?'} in "
        f"{curve.seconds:.1f} s{f' ({curve.measured_for})' if curve.measured_for else ''}, {sizes}, "
        f"{curve.repeats} pass(es) each after {curve.context} tokens"
        f"{f', largest spread {spread:.0%}' if curve.repeats > 1 else ''}{deep}{state}",
        style="spec.label",
    )


def check_plot_path(path: str) -> None:
    """Fail before measuring: a plot needs a .png or .svg name and matplotlib (the `plot` extra).
    Raises UsageError."""
    from specdec_cli.cli.commands.bench_report import check_plot_path as check

    check(path)


def write_curve_plot(path: str, curves: list[tuple[str, VerifyCurve]], title: str = "") -> None:
    """ms per pass against b for each (label, curve), cheap sizes marked with dots; ms per token on a second axis.
    Raises UsageError (no matplotlib, a path that cannot be written)."""
    from specdec_cli.cli.commands.bench_report import _matplotlib_figure
    from specdec_cli.errors import UsageError

    Figure = _matplotlib_figure()
    fig = Figure(figsize=(7.5, 4.2), dpi=120)
    ax = fig.subplots()
    for label, curve in curves:
        bs = list(range(1, curve.b_max + 1))
        line = ax.plot(bs, [curve.at(b) for b in bs], linewidth=1.2, label=label)[0]
        cheap = curve.cheap_sizes()
        ax.plot(
            cheap,
            [curve.at(b) for b in cheap],
            "o",
            markersize=3.5,
            color=line.get_color(),
            label=f"{label}: cheap sizes" if len(curves) > 1 else "cheap sizes (no larger pass costs less)",
        )
    ax.set_xlabel("b: tokens in one target pass (the pending token + the draft)")
    ax.set_ylabel("ms per pass")
    ax.set_xlim(0, max(c.b_max for _, c in curves) + 1)
    ax.set_ylim(bottom=0)
    ax.grid(True, linewidth=0.4, alpha=0.5)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(path, format=Path(path).suffix.lower()[1:])
    except OSError as e:
        raise UsageError(f"Cannot write --plot {path}: {e.strerror or e}.", "Give a writable path.") from None
