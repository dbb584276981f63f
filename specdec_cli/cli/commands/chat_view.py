"""Everything `specdec chat` shows: the reply stream (stdout), the per-turn footer, messages and statistics (stderr)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specdec_cli.cli.render import StreamRenderer, legend
from specdec_cli.errors import SpecdecError
from specdec_cli.spec import Method

if TYPE_CHECKING:
    from specdec_cli.cli.commands.chat_history import Totals, Turn
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions


def _ms(x: float) -> str:
    return f"{x / 1e3:.2f} s" if x >= 1000 else f"{x:.0f} ms"


FINISH = {"interrupted": "interrupted", "length": "max tokens", "context": "context full", "stop": "stop string"}


def footer_text(turn: Turn) -> str:
    """One line: tokens, tok/s, acceptance, mean accepted length, prefill evaluated vs cached (target and draft)."""
    s = turn.stats
    assert s is not None
    parts = [f"{s.n_generated} tokens", f"{s.tokens_per_s:.1f} tok/s"]
    if s.j_per_token is not None:  # the host's energy counters (docs/energy.md); nothing shown where there are none
        parts.append(f"{s.j_per_token:.3g} J/token")
    if s.n_drafted:
        parts += [f"acceptance {s.acceptance_rate:.0%}", f"mean accepted {s.mean_accepted_length:.2f}"]
    elif turn.method != Method.none:
        parts.append("nothing drafted")
    reused = s.n_cached
    prefill = f"prefill {s.n_prompt - reused} new + {reused} cached in {_ms(s.prefill_ms)}"
    if turn.draft_cache is not None:
        evaluated, cached = turn.draft_cache
        prefill += f" (draft {evaluated + 1} + {cached} in {_ms(s.draft_prefill_ms)})"
    parts.append(prefill)
    if s.finish_reason in FINISH:
        parts.append(FINISH[s.finish_reason])
    return " · ".join(parts)


@dataclass(eq=False, kw_only=True)
class ChatView:
    """Everything the chat shows. The reply goes to `out` (stdout); everything else to `err` (a stderr console).

    Args:
        interactive: stdin is a terminal (a banner, blank lines between turns).
        styled: colour the reply by token kind (a terminal without --plain / NO_COLOR).
        show_rejected: show rejected drafts in their own style (--clean and /rejected off hide them).
    """

    out: TextIO
    err: Console
    interactive: bool
    styled: bool
    show_rejected: bool
    _legend_shown: bool = field(default=False, init=False)
    # replies follow a grammar (--json-object, --json-schema, --grammar): legend entry
    _grammar: bool = field(default=False, init=False)

    # -- the reply --------------------------------------------------------------------------------------------
    def stream(self) -> StreamRenderer:
        return StreamRenderer(self.out, styled=self.styled, show_rejected=self.show_rejected)

    def end_stream(self, renderer: StreamRenderer, text: str) -> None:
        """End the reply with a newline (also in plain mode, so piped replies are separated)."""
        renderer.end()  # styled: a newline unless the stream ended with one
        if not self.styled and not text.endswith("\n"):
            self.out.write("\n")
        self.out.flush()

    def footer(self, turn: Turn) -> None:
        self.err.print(Text(footer_text(turn), style="spec.label"))
        if self.interactive:
            self.err.print()

    # -- messages ---------------------------------------------------------------------------------------------
    def banner(self, session: Session, spec: SpecOptions, config: GenerationConfig) -> None:
        if not self.interactive:
            return
        models = session.target_path.name + (f" + draft {session.draft_path.name}" if session.draft_path else "")
        self.err.print(
            Text.assemble(
                ("specdec chat ", "bold"),
                (
                    f"{models} · method {spec.method} · K {spec.k} · "
                    f"ctx {session.target.n_ctx} · up to {config.max_tokens} tokens per reply",
                    "spec.label",
                ),
            )
        )
        self.err.print(
            Text(
                '/help for commands · end a line with \\ or use """ for several lines · Ctrl-C stops a '
                "reply · Ctrl-D quits",
                style="spec.label",
            )
        )
        self._grammar = config.grammar is not None
        if config.grammar is not None:
            self.err.print(Text(f"every reply follows {config.grammar.name}", style="spec.label"))
        self.show_legend(spec.method)
        self.err.print()

    def show_legend(self, method: str) -> None:
        if self.styled and method != Method.none and not self._legend_shown:
            self.err.print(legend(method, grammar=self._grammar))
            self._legend_shown = True

    def note(self, message: str) -> None:
        self.err.print(Text(message, style="spec.warn" if self.interactive else ""))

    def error(self, e: SpecdecError) -> None:
        self.err.print(Text.assemble(("error: ", "bold red"), str(e)))

    def dropped(self, n: int, n_prompt: int, n_ctx: int, max_tokens: int) -> None:
        self.note(
            f"The conversation is too long for the {n_ctx}-token context: dropped the {n} oldest "
            f"turn{'s' * (n != 1)} (the system prompt is kept) to leave room for a {max_tokens}-token reply; "
            f"the prompt is now {n_prompt} tokens. /save keeps the whole transcript; --ctx raises the limit."
        )

    def help(self, commands: list[tuple[str, str]]) -> None:
        """The slash commands, as (usage, what it does), and how to type messages."""
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for usage, what in commands:
            table.add_row(usage, what)
        self.err.print(table)
        self.err.print(
            Text(
                'Several lines: end a line with \\ to continue it, or wrap the text in """ … """.\n'
                "Start a message with // to send text that begins with a slash.\n"
                "Ctrl-C stops a reply and keeps what was shown; Ctrl-D, or Ctrl-C at an empty prompt, quits.\n"
                "Examples: /k 4   /method ngram   /save chat.md   /save chat.json",
                style="spec.label",
            )
        )

    # -- statistics -------------------------------------------------------------------------------------------
    def stats(self, totals: Totals, method: str) -> None:
        if not totals.turns:
            self.note("No replies yet.")
            return
        s = totals.summary()
        table = Table.grid(padding=(0, 2))
        table.add_column(style="spec.label", justify="right")
        table.add_column()
        table.add_row("", Text("session totals", style="bold"))
        table.add_row(
            "replies",
            f"{totals.turns}: {s.n_generated} tokens in {_ms(s.decode_ms)}, "
            f"{s.tokens_per_s:.1f} tok/s, {s.tokens_per_pass:.2f} tokens per target pass",
        )
        table.add_row(
            "prompts",
            f"{totals.n_prompt} tokens: {totals.n_reused} reused from the cache, "
            f"{totals.n_prompt - totals.n_reused} evaluated in {_ms(totals.prefill_ms)}",
        )
        if s.n_drafted:
            table.add_row(
                "drafted",
                f"{s.n_drafted}, accepted {s.n_accepted}: acceptance rate "
                f"{s.acceptance_rate:.1%}, mean accepted length {s.mean_accepted_length:.2f}",
            )
            if s.k_histogram:
                ks = "  ".join(f"K={k}:{n}" for k, n in sorted(s.k_histogram.items()))
                table.add_row("K chosen", f"mean {s.mean_k:.1f}  ({ks})")
            for i, (proposed, accepted) in enumerate(s.acceptance_by_position[:16]):
                frac = accepted / proposed if proposed else 0.0
                bar = "█" * round(frac * 20) + "·" * (20 - round(frac * 20))
                table.add_row("position 1" if i == 0 else str(i + 1), f"{bar} {frac:6.1%}  ({accepted}/{proposed})")
        else:
            table.add_row("drafted", f"nothing (method {method})")
        self.err.print(table)
        if self.interactive:
            self.err.print()

    def goodbye(self, totals: Totals) -> None:
        if not totals.turns:
            return
        s = totals.summary()
        line = (
            f"session: {totals.turns} repl{'ies' if totals.turns != 1 else 'y'}, {s.n_generated} tokens, "
            f"{s.tokens_per_s:.1f} tok/s"
        )
        if s.n_drafted:
            line += f", acceptance {s.acceptance_rate:.1%}, mean accepted length {s.mean_accepted_length:.2f}"
        self.err.print(Text(line, style="spec.label"))
