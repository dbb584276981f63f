"""Rendering: the coloured token stream and the statistics. Consumes the engine's records; never computes them.

Model text is always printed as `rich.text.Text`, never as markup, so a `[` in the output is just a bracket.
When stdout is not a terminal, or with NO_COLOR / --plain, stdout receives exactly the generated text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.control import strip_control_codes
from rich.table import Table
from rich.text import Text

from specdec_cli.cli.console import make_console
from specdec_cli.core.records import ACCEPTED, REJECTED, Source, Step
from specdec_cli.core.stats import RunStats
from specdec_cli.measure.audit import NEAR_TIE
from specdec_cli.measure.paired import Paired
from specdec_cli.spec import USES_PREDICTION, Method


def pass_placement(stats) -> str:
    """Where the passes fell on the measured verify curve, one line: "92 % of passes at cheap sizes, passes 1.02×
    the curve's prediction at depth 700; a second branch in 12 passes (followed in 5)" (depth: the passes' mean
    context, `RunStats.curve_depth`)."""
    line = (
        f"{stats.cheap_passes / stats.curve_passes:.0%} of passes at cheap sizes, passes "
        f"{stats.verify_ms / stats.curve_ms:.2f}× the curve's prediction at depth {stats.curve_depth}"
        if stats.curve_ms > 0
        else ""
    )
    if stats.branch_passes:
        line += f"; a second branch in {stats.branch_passes} passes (followed in {stats.branch_won})"
    return line


ACCEPTED_BY_SOURCE: dict[str, str] = {
    Source.prompt: "spec.accepted",
    Source.store: "spec.accepted.store",
    Source.predict: "spec.accepted.predict",
    Source.draft: "spec.accepted.draft",
    Source.mtp: "spec.accepted.mtp",
    Source.corpus: "spec.accepted.corpus",
    Source.grammar: "spec.accepted.grammar",
}


def segment_style(kind: str, source: str) -> str:
    """The theme style of a stream segment: its kind, and for accepted draft tokens the source they came from."""
    if kind == ACCEPTED:
        return ACCEPTED_BY_SOURCE.get(source, "spec.accepted")
    return f"spec.{kind}"


def legend(method: str = "", *, grammar: bool = False) -> Text:
    """The one-line colour legend; for `auto` and `predict`, one entry per source of accepted drafts (and the
    grammar's forced tokens when a grammar constrains the reply)."""
    t = Text("legend: ", style="spec.legend")
    if method and Method(method) in USES_PREDICTION:
        t.append("accepted: ", style="spec.legend")
        for source, style in ACCEPTED_BY_SOURCE.items():
            if source == Source.grammar and not grammar:
                continue  # shown only when a grammar constrains the reply
            if source == Source.corpus and method != Method.auto:
                continue  # the corpus `specdec learn` indexed drafts for auto only
            t.append(Source(source).label, style=style)
            t.append(" ", style="spec.legend")
        t.append(" ", style="spec.legend")
    else:
        t.append("accepted draft", style="spec.accepted")
        t.append("  ", style="spec.legend")
    t.append("target token", style="spec.target")
    t.append("  ", style="spec.legend")
    t.append("rejected draft", style="spec.rejected")
    return t


REJECTED_MARKS = {"\n": "↵", "\t": "⇥"}  # a rejected draft's newline and tab, as shown: never the reply's layout
REJECTED_MARKS_ASCII = {"\n": "\\n", "\t": "\\t"}  # the same where the stream's encoding cannot write the marks
REJECTED_SHOWN = 16  # characters of a rejected draft shown; the rest are counted ("…+N")


def rejected_mark(text: str, *, limit: int = REJECTED_SHOWN, ascii_only: bool = False) -> str:
    """A rejected draft as the stream shows it: on one line, its newlines and tabs as visible marks ("↵", "⇥";
    "\\n", "\\t" with `ascii_only`), other control codes dropped, and past `limit` characters cut, with "…+N" saying how
    many more characters the target rejected. The reply's own text is never touched."""
    text = strip_control_codes(text)
    hidden = len(text) - limit if len(text) > limit else 0
    if hidden:
        text = text[:limit]
    marks = REJECTED_MARKS_ASCII if ascii_only else REJECTED_MARKS
    for char, mark in marks.items():
        text = text.replace(char, mark)
    return text + (f"{'...' if ascii_only else '…'}+{hidden}" if hidden else "")


def _writes(out: TextIO, text: str) -> bool:
    """`out`'s encoding can write `text` (a stream without an encoding is taken to write anything)."""
    encoding = getattr(out, "encoding", None)
    if not encoding:
        return True
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


REFRESH_S = 1 / 25  # a styled stream is printed at most 25 times a second (a terminal's useful refresh rate)


class StreamRenderer:
    """Writes each step's text as it arrives.

    Styled, a step is printed at once when the last print was `refresh_s` or more ago (the first step; every step of a
    CPU's passes, 80+ ms each); steps that come faster (a GPU's passes: a few ms each) are gathered and printed
    together, as one `Text`, at most once per `refresh_s`: a Rich print costs about as much as such a pass. A
    gathered step waits at most `refresh_s` plus one pass. `end` prints what is still gathered. Plain (a pipe,
    NO_COLOR, --plain): every step's text is written and flushed as it comes.

    Args:
        out: where the text goes (stdout for `run`).
        styled: colour by kind (accepted draft / target / rejected draft); False writes only the output text.
        show_rejected: show rejected drafts where they were proposed (styled mode only; --clean and /rejected off
            hide them), in their own style, on one line and shortened (`rejected_mark`), so the reply's text keeps
            the model's lines and indentation exactly.
        refresh_s: seconds; the shortest interval between two prints of a styled stream (0: print every step).
        clock: seconds, monotonic (tests pass a virtual one).
    """

    def __init__(
        self,
        out: TextIO,
        *,
        styled: bool,
        show_rejected: bool = True,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.styled = styled
        self.show_rejected = show_rejected and styled
        self.console = make_console(file=out) if styled else None
        self.refresh_s = refresh_s
        self.clock = clock
        self._at_line_start = True
        self._pending: list[list] = []  # [style, [texts]] gathered since the last print, adjacent styles merged
        self._last_print = -math.inf  # clock() of the last print
        self._codes: dict[str, tuple[str, str]] = {}  # style -> the escape codes around its text (`_style_codes`)
        self._ascii_marks = not _writes(out, "".join(REJECTED_MARKS.values()) + "…")

    def step(self, step: Step) -> None:
        pending = self._pending
        for kind, text in step.segments:
            if not text or (kind == REJECTED and not self.show_rejected):
                continue
            if kind == REJECTED:
                text = rejected_mark(text, ascii_only=self._ascii_marks)
            if self.console is not None:
                style = segment_style(kind, step.source)
                if pending and pending[-1][0] == style:
                    pending[-1][1].append(text)
                else:
                    pending.append([style, [text]])
            else:
                self.out.write(text)
            self._at_line_start = text.endswith("\n")
        if self.console is None:
            self.out.flush()
            return
        now = self.clock()
        if now - self._last_print >= self.refresh_s:  # passes this slow are each shown as they come
            self._print(now)

    def _print(self, now: float) -> None:
        """Print the gathered text (never markup): as the escape codes Rich renders for its styles, or, where only
        Rich can say what it would write, as one `Text`."""
        if self._pending:
            pieces = [(style, "".join(parts)) for style, parts in self._pending]
            self._pending = []
            ansi = self._ansi(pieces)
            if ansi is not None:
                self.out.write(ansi)
                self.out.flush()
            else:
                text = Text()
                for style, part in pieces:
                    text.append(part, style=style)
                assert self.console is not None  # (styled output has one)
                self.console.print(text, end="")
        self._last_print = now

    def _ansi(self, pieces: list[tuple[str, str]]) -> str | None:
        """What `console.print(Text, end="")` writes for these (style, text) pieces, byte for byte, without Rich's
        rendering on every print (dear beside a GPU's pass, dearer when a pass flushed the caches): each style's escape
        codes are rendered once, by Rich, and wrapped around each line of its text, control codes stripped as `Text`
        strips them. None for text with a tab (Rich expands tabs) and on a legacy Windows console (no escape codes)."""
        assert self.console is not None  # (styled output has one)
        if self.console.legacy_windows:
            return None
        out = []
        for style, text in pieces:
            if "\t" in text:
                return None
            codes = self._codes.get(style)
            if codes is None:
                codes = self._codes[style] = self._style_codes(style)
            prefix, suffix = codes
            text = strip_control_codes(text)
            out.append("\n".join(prefix + line + suffix if line else "" for line in text.split("\n")))
        return "".join(out)

    def _style_codes(self, style: str) -> tuple[str, str]:
        """(before, after): the escape codes this console writes around text in `style` (a theme name)."""
        mark = "\ue000"  # a private-use character: in no escape code
        assert self.console is not None  # (styled output has one)
        with self.console.capture() as capture:
            self.console.print(Text(mark, style=style), end="")
        before, _, after = capture.get().partition(mark)
        return before, after

    def end(self) -> None:
        """Print what is gathered, then finish the stream with a newline when the text did not end with one
        (terminal only)."""
        if self.console is not None:
            self._print(self.clock())
        if not self._at_line_start and self.styled:
            self.out.write("\n")
        self.out.flush()


def _ms(x: float) -> str:
    return f"{x / 1e3:.2f} s" if x >= 1000 else f"{x:.0f} ms"


def joules(x: float) -> str:
    """ "12.3 J", "0.845 J", "1.23 kJ": three significant digits."""
    return f"{x / 1e3:.3g} kJ" if abs(x) >= 1e4 else f"{x:.3g} J"


def energy_rows(stats: RunStats) -> list[tuple[str, Text]]:
    """The statistics' energy rows: joules, mean watts and J per output token (prefill apart), what was counted and
    left out; or "n/a" and why, with no number."""
    e = stats.energy
    if e is None:
        return [("energy", Text(f"n/a: {stats.energy_note or 'not measured'}", style="spec.warn"))]
    rows = [
        (
            "energy",
            Text(
                f"{joules(e.joules)} in {_ms(e.seconds * 1e3)}, {e.watts:.1f} W mean: prefill "
                f"{joules(e.prefill_j)}, decoding {joules(e.decode_j)} ({e.decode_watts:.1f} W)"
            ),
        ),
        (
            "J / token",
            Text.assemble((f"{e.per_token(stats.n_generated) or 0:.3g} J", "bold"), " per output token (decoding)"),
        ),
    ]
    if e.idle_w is not None and stats.n_generated:
        net = (e.decode_j - e.idle_w * e.decode_s) / stats.n_generated
        rows.append(("net of idle", Text(f"{net:.3g} J per output token (idle {e.idle_w:.1f} W measured before)")))
    counted = " + ".join(e.counted) + "".join(f"; leaves out {x}" for x in e.left_out)
    rows.append(("counted", Text(counted, style="spec.label")))
    return rows


def _bar(frac: float, width: int = 20) -> str:
    full = int(round(frac * width))
    return "█" * full + "·" * (width - full)


def _label(source: str) -> str:
    """A source's name for people ("prompt lookup"); an unknown one as it is."""
    return Source(source).label if source in Source._value2member_map_ else source


def stats_table(stats: RunStats, *, method: str, title: str | None = None) -> Table:
    """The end-of-run statistics as a two-column table."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="spec.label", justify="right")
    table.add_column()
    if title:
        table.add_row("", Text(title, style="bold"))
    pre_rate = stats.n_prefill_evaluated / (stats.prefill_ms / 1e3) if stats.prefill_ms > 0 else 0.0
    reused = stats.n_cached
    if stats.n_restored:  # "prefill 1790 tokens: 1784 restored from the prompt cache in 0.4 s, 6 evaluated"
        table.add_row(
            "prompt",
            f"prefill {stats.n_prompt} tokens: {stats.n_restored} restored from the prompt cache "
            f"in {_ms(stats.restore_ms)}, {stats.n_prefill_evaluated} evaluated "
            f"(prefill {_ms(stats.prefill_ms)} in all)",
        )
    else:
        table.add_row(
            "prompt",
            f"{stats.n_prompt} tokens, prefill {_ms(stats.prefill_ms)}"
            + (f" ({pre_rate:.0f} tok/s)" if pre_rate else "")
            + (f", {reused} reused from cache" if reused else ""),
        )
    table.add_row(
        "generated",
        Text.assemble(
            f"{stats.n_generated} tokens in {_ms(stats.decode_ms)}: ",
            (f"{stats.tokens_per_s:.1f} tok/s", "bold"),
            f"  ({stats.finish_reason or 'unfinished'})",
        ),
    )
    for what, cell in energy_rows(stats):
        table.add_row(what, cell)
    table.add_row(
        "target passes",
        f"{stats.n_target_passes}  ({stats.tokens_per_pass:.2f} tokens per pass, "
        f"{stats.ms_per_pass:.1f} ms per pass, {stats.mean_batch:.1f} tokens in it)",
    )
    if stats.curve_passes:
        table.add_row("verify curve", pass_placement(stats))
    if method != Method.none:
        table.add_row(
            "drafted",
            f"{stats.n_drafted} by {method}, accepted {stats.n_accepted}: acceptance rate {stats.acceptance_rate:.1%}",
        )
        table.add_row("accepted length", f"mean {stats.mean_accepted_length:.2f} draft tokens per speculative step")
        if stats.by_source and (len(stats.by_source) > 1 or method == Method.auto):
            table.add_row(
                "sources",
                "  ".join(
                    f"{_label(src)} {c['accepted']}/{c['drafted']}"
                    for src, c in sorted(stats.by_source.items(), key=lambda kv: -kv[1]["accepted"])
                )
                + "  (accepted/drafted)",
            )
        if Source.predict in stats.by_source:
            table.add_row(
                "prediction",
                f"{stats.accepted_prediction_tokens} tokens accepted, {stats.rejected_prediction_tokens} rejected",
            )
        table.add_row("time", f"drafting {_ms(stats.draft_ms)}, verifying {_ms(stats.verify_ms)}")
        if stats.k_histogram:
            ks = "  ".join(f"K={k}:{n}" for k, n in sorted(stats.k_histogram.items()))
            table.add_row("K chosen", f"mean {stats.mean_k:.1f}  ({ks})")
        for i, (proposed, accepted) in enumerate(stats.acceptance_by_position[:16]):
            if not proposed:
                break
            frac = accepted / proposed if proposed else 0.0
            table.add_row(
                f"position {i + 1}" if i == 0 else f"{i + 1}", f"{_bar(frac)} {frac:6.1%}  ({accepted}/{proposed})"
            )
    return table


def print_stats(
    console: Console, stats: RunStats, *, method: str, title: str | None = None, notes: tuple[str, ...] = ()
) -> None:
    """The statistics table, then `notes` (one line each: why no draft model is used, an unused prediction)."""
    console.print(stats_table(stats, method=method, title=title))
    for note in notes:
        console.print(Text(f"note: {note}", style="spec.label"))


def print_compare(
    console: Console,
    paired: Paired,
    *,
    shared: int,
    n_spec: int,
    n_plain: int,
    divergence=None,
    control: bool = False,
    energy: Paired | None = None,
    energy_note: str | None = None,
) -> None:
    """The speedup against plain decoding measured in the same process (`paired`: a = speculative, b = plain, rates
    in tok/s): the median over the pairs and its spread; then how much of the output agrees.

    `divergence`: an `audit.Divergence` (greedy: where the outputs first differ, the plain run's margin there and
    the verdict), or a note to print as is, or None. `control`: both sides are plain decoding (`--method none`),
    so the ratio is the noise floor of this sitting. `energy`: the same pairs in J per output token
    (`comparison.energy_pairs`), or None with `energy_note` saying why.
    """
    speedup = paired.median
    n = len(paired.pairs)
    style = "spec.label" if control else ("spec.good" if speedup >= 1.0 else "spec.bad")
    spread = f" (median of {n} pairs, {paired.low:.2f}–{paired.high:.2f}×)" if n > 1 else " (1 pair)"
    console.print(
        Text.assemble(
            ("compare ", "spec.label"),
            f"plain decoding {paired.b_median:.1f} tok/s, {'plain again' if control else 'speculative'} "
            f"{paired.a_median:.1f} tok/s → ",
            (f"{speedup:.2f}× speedup", style),
            spread,
        )
    )
    if control:
        console.print(
            Text(
                "        --method none against plain decoding: both sides are plain, so this ratio is "
                "this machine's noise right now",
                style="spec.label",
            )
        )
    if energy is not None:
        ratio = energy.median
        e_style = "spec.label" if control else ("spec.good" if ratio <= 1.0 else "spec.bad")
        e_spread = f" (median of {n} pairs, {energy.low:.2f}–{energy.high:.2f}×)" if n > 1 else " (1 pair)"
        console.print(
            Text.assemble(
                ("energy  ", "spec.label"),
                f"plain decoding {energy.b_median:.3g} J/token, {'plain again' if control else 'speculative'} "
                f"{energy.a_median:.3g} J/token → ",
                (f"{ratio:.2f}× the energy per token", e_style),
                e_spread,
            )
        )
    else:
        console.print(Text(f"energy  n/a: {energy_note or 'not measured'}", style="spec.warn"))
    same = shared == n_spec == n_plain
    agree = Text.assemble(
        ("        ", "spec.label"),
        (f"outputs identical ({shared} tokens)", "spec.good")
        if same
        else f"outputs share their first {shared} tokens (speculative {n_spec}, plain {n_plain})",
    )
    console.print(agree)
    if isinstance(divergence, str):
        console.print(Text(f"        {divergence}", style="spec.warn"))
    elif divergence is not None:
        verdict_style = "spec.warn" if divergence.verdict == NEAR_TIE else "spec.bad"
        margin = "unknown" if divergence.margin is None else f"{divergence.margin:.3f} logits"
        console.print(
            Text.assemble(
                ("        ", "spec.label"),
                f"token {divergence.position}: speculative {divergence.spec_text}, plain {divergence.plain_text}; "
                f"plain run's margin {margin} (near-tie below {float(divergence.threshold)}): ",
                (divergence.verdict, verdict_style),
            )
        )


def announce_tuned_k(console: Console, k: int | None) -> None:
    """Say that K comes from `specdec tune --save` (`assemble.tuned_k`'s K; nothing for None)."""
    if k is None:
        return
    from specdec_cli.stores.tuned import tuned_path

    console.print(Text(f"K = {k} from specdec tune ({tuned_path()}); --k auto adapts it instead.", style="spec.label"))
