"""`specdec bench`'s report: the terminal tables and chart, the Markdown table (--markdown), the --plot image.

Pure functions of the --json document and its `BenchSummary`s (`specdec_cli.measure.bench`), so
`specdec bench --from-json` re-renders a saved run without measuring anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from rich.console import Group, JustifyMethod
from rich.table import Table
from rich.text import Text

from specdec_cli.cli import tables
from specdec_cli.cli.tables import ENERGY_HEADER, Bar, energy_cell, speed_cell, speed_style
from specdec_cli.errors import UsageError
from specdec_cli.measure.bench import BenchSummary

PLOT_FORMATS = (".png", ".svg")


def _classes(doc: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(p["kind"] for p in doc["prompts"]))


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _fmt_ttft(ms: float | None) -> str:
    return "–" if ms is None else (f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.0f} ms")


def _fmt_agree(s: BenchSummary) -> str:
    same, n, least = s.agree
    if s.config.baseline or n == 0:
        return ""
    return f"{same}/{n}" + (f" ≥{least}" if least is not None else "")


def header(doc: dict[str, Any]) -> str:
    from specdec_cli.models.machine import one_line
    from specdec_cli.session import kernels_line

    st = doc["settings"]
    pair = Path(doc["target"]).name + (f" + {Path(doc['draft']).name}" if doc.get("draft") else "")
    n = len(doc["prompts"])
    return (
        f"specdec bench: {pair}; {n} prompt{'s' * (n != 1)} × {st['repeats']} repeat{'s' * (st['repeats'] != 1)}"
        f", {st['max_tokens']} tokens, K {st['k']}, greedy, --ctx {st['ctx']}\n{one_line(doc['machine'])}"
        + (f"\n{kernels_line(doc['kernels'])}" if doc.get("kernels") else "")
    )


def report(doc: dict[str, Any], summaries: list[BenchSummary]) -> Group:
    """The results table, the per-prompt table, the chart by class and the notes, as one renderable."""
    parts: list[Any] = [
        Text(header(doc), style="bold"),
        results_table(summaries),
        Text(
            "tok/s: decode only, median over prompts (± half the spread between repeats). speedup: "
            "over none in the same block, geometric mean over prompts. TTFT: cold cache, median over "
            "prompts. peak RSS: of the process running it. = none: runs whose greedy output is "
            "none's (≥ n: fewest leading tokens shared by the others). A/A: none again, timed like "
            "the others: its speedup (and the min–max of its paired ratios) is the noise of this "
            "sitting; a speedup inside that band means nothing. J/token: decoding's joules per output "
            "token from this host's counters, timed runs pooled (docs/energy.md)." + _energy_note(summaries),
            style="spec.label",
        ),
        Text(""),
        prompt_table(summaries, doc),
        Text(""),
        speedup_chart(summaries, _classes(doc)),
    ]
    notes = []
    if doc.get("peer"):
        pd = doc["peer"]
        notes.append(
            f"peer-N: llama-cpp-python {pd['version']}, {pd['calls'][0].replace('=10)', '=N)')}, "
            f"driven through Llama.generate with its other defaults (flash attention off, so its greedy "
            f"output can differ from ours at near-ties). logits_all=True is what makes it work: without it, "
            f"it fails with a numpy broadcast error once the context passes 512 tokens. It costs an "
            f"n_ctx × n_vocab float32 buffer, {doc['settings']['ctx']} × {pd['n_vocab']} × 4 B = "
            f"{_fmt_bytes(pd['scores_buffer_bytes'])} allocated (resident as positions are evaluated), and "
            f"the output layer runs for every evaluated position, the prompt included."
        )
    if doc.get("suffix_store_tokens") is not None:
        notes.append(
            f"suffix/auto read your suffix store as it is ({doc['suffix_store_tokens']:,} tokens) and do "
            f"not learn during the bench."
        )
    for n in notes:
        parts.append(Text(n, style="spec.label"))
    return Group(*parts)


def _energy_note(summaries: list[BenchSummary]) -> str:
    """ " J/token n/a: why." for the first configuration of ours without a figure ("" where every one has one)."""
    note = next((s.energy_note for s in summaries if s.j_per_token is None and s.energy_note), None)
    return f" J/token n/a: {note}" if note else ""


def results_table(summaries: list[BenchSummary]) -> Table:
    t = tables.results_table()
    for name, just in (
        ("config", "left"),
        ("tok/s", "right"),
        ("speedup", "right"),
        ("accept", "right"),
        ("mean\nacc. len", "right"),
        ("tok/\npass", "right"),
        ("ms/\npass", "right"),
        ("cheap\nsizes", "right"),
        (ENERGY_HEADER, "right"),
        ("TTFT", "right"),
        ("peak RSS", "right"),
        ("= none", "right"),
    ):
        t.add_column(name, justify=cast(JustifyMethod, just), no_wrap=True)
    for s in summaries:
        tps = Text("–" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}")
        if s.tps_spread is not None:
            tps.append(f" ±{s.tps_spread / 2:.0%}", style="spec.label")
        if s.config.baseline or s.speedup is None:
            speed = Text("1.00×" if s.config.baseline and s.speedup else "–", style="spec.label")
        elif s.config.control:  # the noise floor: its median, and the range of every paired ratio
            speed = Text(f"{s.speedup:.2f}×", style="spec.label")
            if s.pair_range is not None:
                speed.append(f" {s.pair_range[0]:.2f}–{s.pair_range[1]:.2f}", style="spec.label")
        else:
            speed = Text(f"{s.speedup:.2f}×", style=speed_style(s.speedup))
        acc = "" if s.config.plain else ("n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.0%}")
        mal = "" if s.config.plain else ("n/a" if s.mean_accepted_length is None else f"{s.mean_accepted_length:.2f}")
        passes = (
            "–" if s.tokens_per_pass is None else f"{s.tokens_per_pass:.2f}",
            "–" if s.ms_per_pass is None else f"{s.ms_per_pass:.0f}",
            "–" if s.cheap_share is None else f"{s.cheap_share:.0%}",
        )
        t.add_row(
            s.config.label,
            tps,
            speed,
            acc,
            mal,
            *passes,
            energy_cell(s.j_per_token),
            _fmt_ttft(s.ttft_ms),
            _fmt_bytes(s.peak_rss_kib * 1024 if s.peak_rss_kib else None),
            _fmt_agree(s),
        )
    return t


def prompt_table(summaries: list[BenchSummary], doc: dict[str, Any]) -> Table:
    """tok/s and speedup per prompt (columns: prompt, its class and length)."""
    t = tables.results_table(title="per prompt: tok/s, speedup", title_justify="left", title_style="bold")
    t.add_column("config", no_wrap=True)
    for p in doc["prompts"]:
        t.add_column(
            f"{p['name']}\n{p['kind']}, {p['n_tokens'] if p['n_tokens'] is not None else '?'} tok",
            justify="right",
            overflow="fold",
            min_width=12,
        )
    for s in summaries:
        cells: list[Any] = [s.config.label]
        for p in doc["prompts"]:
            sp = s.speedup_by_prompt.get(p["name"]) if not s.config.baseline else None
            cells.append(speed_cell(s.tps_by_prompt.get(p["name"]), sp))
        t.add_row(*cells)
    return t


def speedup_chart(summaries: list[BenchSummary], classes: list[str], width: int = 36) -> Table:
    """Bars of the speedup over none, grouped by prompt class (then all prompts); a dim │ marks 1×."""
    shown = [s for s in summaries if not s.config.baseline and s.speedup is not None]
    groups = [
        (
            c,
            [
                Bar(s.config.label, v, plain=s.config.control)
                for s in shown
                if (v := s.speedup_by_class.get(c)) is not None
            ],
        )
        for c in classes
    ]
    if len(classes) > 1:
        groups.append(
            (
                "all prompts",
                [Bar(s.config.label, s.speedup, plain=s.config.control) for s in shown if s.speedup is not None],
            )
        )  # (all of them: `shown` has a speedup)
    return tables.speedup_chart("speedup over none, by prompt class", groups if shown else [], width)


def markdown_table(doc: dict[str, Any], summaries: list[BenchSummary]) -> str:
    """The results as a GitHub Markdown table, with a comment naming the run it came from."""
    from specdec_cli.models.machine import one_line

    classes = _classes(doc)
    st = doc["settings"]
    lines = [
        f"<!-- specdec bench, {doc.get('started_at', '')}: {Path(doc['target']).name}"
        + (f" + {Path(doc['draft']).name}" if doc.get("draft") else "")
        + f"; {len(doc['prompts'])} prompts × {st['repeats']} repeat{'s' * (st['repeats'] != 1)}, "
        + f"{st['max_tokens']} tokens, K {st['k']}; "
        + f"{one_line(doc['machine'])} -->",
        "| configuration | decode tok/s | speedup | "
        + " | ".join(classes)
        + " | acceptance | mean accepted length | TTFT | peak RSS | greedy = none |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in classes) + " | ---: | ---: | ---: | ---: | ---: |",
    ]

    def x(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}×"

    for s in summaries:
        none = s.config.baseline
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{s.config.label}`" if s.config.family == "ours" and not s.config.control else s.config.title,
                    "–" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}",
                    "1.00×" if none else x(s.speedup),
                    *("" if none else x(s.speedup_by_class.get(c)) for c in classes),
                    "" if s.config.plain else ("n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.0%}"),
                    ""
                    if s.config.plain
                    else ("n/a" if s.mean_accepted_length is None else f"{s.mean_accepted_length:.2f}"),
                    _fmt_ttft(s.ttft_ms),
                    _fmt_bytes(s.peak_rss_kib * 1024 if s.peak_rss_kib else None),
                    "" if none else _fmt_agree(s),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def write_plot(path: str, doc: dict[str, Any], summaries: list[BenchSummary]) -> None:
    """Grouped bars of the speedup over none by prompt class (and over all prompts), as PNG or SVG (matplotlib)."""
    import numpy as np

    Figure = _matplotlib_figure()
    classes = _classes(doc)
    labels = classes + (["all prompts"] if len(classes) > 1 else [])
    shown = [s for s in summaries if not s.config.baseline and s.speedup is not None]
    fig = Figure(figsize=(max(6.0, 1.1 * len(labels) * max(1, len(shown)) / 2.5), 4.2), dpi=120)
    ax = fig.subplots()
    x = np.arange(len(labels))
    w = 0.8 / max(1, len(shown))
    for i, s in enumerate(shown):
        vals = [s.speedup_by_class.get(c, np.nan) for c in classes] + ([s.speedup] if len(classes) > 1 else [])
        ax.bar(x + (i - (len(shown) - 1) / 2) * w, vals, w, label=s.config.title)
    ax.axhline(1.0, color="0.3", linewidth=1, linestyle="--")
    ax.set_xticks(x, labels)
    ax.set_ylabel("speedup over none (×)")
    pair = Path(doc["target"]).name + (f" + {Path(doc['draft']).name}" if doc.get("draft") else "")
    ax.set_title(
        f"{pair}\n{doc['machine'].get('cpu')}, {doc['settings']['threads']} threads, "
        f"{doc['settings']['max_tokens']} tokens, greedy",
        fontsize=9,
    )
    if shown:  # below the axes, so it never hides a bar or the 1× line
        ax.legend(fontsize=8, ncols=min(3, len(shown)), loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    fig.tight_layout()
    try:
        fig.savefig(path, format=Path(path).suffix.lower()[1:])
    except OSError as e:
        raise UsageError(f"Cannot write --plot {path}: {e.strerror or e}.", "Give a writable path.") from None


def check_plot_path(path: str) -> None:
    """Fail before measuring: --plot needs a .png or .svg name and matplotlib (the `plot` extra)."""
    if Path(path).suffix.lower() not in PLOT_FORMATS:
        raise UsageError(f"--plot {path}: unknown image format.", "Give a file name ending in .png or .svg.")
    _matplotlib_figure()


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed.", "pip install 'specdec-cli[plot]'"
        ) from None
    return Figure
