"""`specdec chat`: a multi-turn conversation, each reply generated with speculative decoding and streamed in colour.

Five parts, each usable alone (this module: input, the loop and the command; the others in their own modules):
    input       `LineReader`: one message per read. A trailing backslash continues the line, a \"\"\" block spans
                lines; readline history (arrow keys) when stdin is a terminal; Ctrl-D, or Ctrl-C at an empty prompt,
                ends the chat.
    history     `chat_history.Conversation`: the turns, rendered with the model's own chat template
                (`Session.chat_tokens`). `fit` drops the oldest turns (never the system prompt) until the prompt plus
                --max-tokens fits.
    commands    `chat_commands.COMMANDS`: the slash-command table (/help /reset /stats /k /method /rejected /save
                /quit).
    generation  `chat_session.Chat.turn`: one reply through `driver.generate`, the same engine loop as `specdec run`.
    rendering   `chat_view.ChatView`: the reply stream (stdout), the per-turn footer, messages and statistics (stderr).

KV cache reuse across turns: the engine keeps the longest common prefix of the target's cache and the new prompt
(`backend.sync`) and `ModelDrafter.begin` does the same for the draft model, so turn n + 1 evaluates only what
the template adds after turn n's committed reply (end-of-turn marker, the new message, the assistant header). The
footer shows, per turn, how many prompt tokens were evaluated and how many came from each cache.

Ctrl-C during a reply: `generate` catches it and closes the engine's generator, whose `finally` leaves the target's
cache holding only committed tokens; the text shown so far is kept as the assistant's turn (nothing shown → the turn
is dropped, so roles keep alternating). The draft model's cache is reconciled at the next `begin`.

Design follows simonw/llm's `llm chat` (reply text to stdout, everything else to stderr, multi-line blocks) and Python's
REPL (`>>> `/`... ` prompts, readline history).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from specdec_cli.assemble import tuned_k
from specdec_cli.cli.commands.chat_commands import dispatch, is_command
from specdec_cli.cli.commands.chat_history import Conversation, Turn
from specdec_cli.cli.commands.chat_session import Chat
from specdec_cli.cli.commands.chat_view import ChatView
from specdec_cli.cli.console import RichReporter, err_console, wants_color
from specdec_cli.cli.render import announce_tuned_k
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.errors import SpecdecError
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions

__all__ = ["Chat", "ChatView", "Conversation", "LineReader", "Turn", "dispatch", "execute", "loop"]

HISTORY_FILE = "chat_history"


# ================================================================================================================
# Input


class _Cancelled(Exception):
    """Ctrl-C while typing a message: drop it and show a fresh prompt."""


class LineReader:
    """Reads messages from a terminal (with prompts and readline) or from piped lines (one message per line).

    Args:
        stream: where non-interactive lines come from (sys.stdin).
        interactive: stdin is a terminal: prompts, readline editing and history, Ctrl-C semantics below.
        history: readline history file (created 0o600); None = no history file.

    `read()` returns the next message; "" for a cancelled message (Ctrl-C after typing something); None at the end
    (EOF / Ctrl-D, or Ctrl-C at an empty prompt).
    """

    PROMPT = ">>> "
    MORE = "... "

    def __init__(self, stream: TextIO, *, interactive: bool, history: Path | None = None) -> None:
        self.stream = stream
        self.interactive = interactive
        self.history = history
        self._readline = _setup_readline(history) if interactive else None

    def read(self) -> str | None:
        try:
            first = self._line(self.PROMPT, first=True)
            if first is None:
                return None
            if first.lstrip().startswith('"""'):
                return self._block(first.lstrip()[3:])
            lines = []
            line: str | None = first
            while line is not None and line.endswith("\\"):  # a trailing backslash continues the message
                lines.append(line[:-1])
                line = self._line(self.MORE)
            if line is not None:
                lines.append(line)
            return "\n".join(lines)
        except _Cancelled:
            return ""

    def _block(self, rest: str) -> str:
        """A \"\"\" … \"\"\" block: the text between the quotes, over as many lines as it takes."""
        if rest.rstrip().endswith('"""'):  # """one line"""
            return rest.rstrip()[:-3]
        lines = [rest] if rest else []
        while (line := self._line(self.MORE)) is not None:
            if line.rstrip().endswith('"""'):
                if last := line.rstrip()[:-3]:
                    lines.append(last)
                break
            lines.append(line)
        return "\n".join(lines)

    def _line(self, prompt: str, *, first: bool = False) -> str | None:
        if not self.interactive:
            try:
                line = self.stream.readline()
            except KeyboardInterrupt:
                return None
            return line.rstrip("\r\n") if line else None
        try:
            if not _isatty(sys.stdout):  # replies redirected: keep the prompt out of them
                sys.stderr.write(prompt)
                sys.stderr.flush()
                prompt = ""
            return input(prompt)
        except EOFError:  # Ctrl-D
            sys.stdout.write("\n")
            return None
        except KeyboardInterrupt:
            typed = self._readline.get_line_buffer() if self._readline is not None else ""
            sys.stdout.write("\n")
            if first and not typed:
                return None
            raise _Cancelled from None

    def close(self) -> None:
        """Save the readline history (user-only permissions)."""
        if self._readline is None or self.history is None:
            return
        try:
            _touch_private(self.history)
            self._readline.write_history_file(str(self.history))
            os.chmod(self.history, 0o600)
        except OSError:
            pass  # a read-only config dir must not spoil the exit


def _setup_readline(history: Path | None):
    """Import readline (arrow keys, editing) and load the history file; None where readline is missing."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline
        return None
    readline.set_history_length(1000)
    if history is not None:
        try:
            readline.read_history_file(str(history))
        except OSError:
            pass
    return readline


def _touch_private(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


# ================================================================================================================
# The loop


def loop(chat: Chat, reader: LineReader) -> None:
    """Read messages until the end; a slash command is dispatched, anything else is a turn. Errors are shown, and
    the chat goes on."""
    while True:
        text = reader.read()
        if text is None:
            return
        if not text.strip():
            continue
        try:
            if is_command(text):
                if dispatch(chat, text):
                    return
            else:
                chat.turn(text[1:] if text.lstrip().startswith("//") else text)
        except SpecdecError as e:
            chat.view.error(e)
        except KeyboardInterrupt:  # outside a reply (the reply itself handles its own Ctrl-C)
            chat.view.note("Interrupted.")


def execute(
    *,
    models: ModelOptions,
    spec: SpecOptions,
    config: GenerationConfig,
    system: str | None,
    plain: bool = False,
    clean: bool = False,
) -> int:
    """Run a chat on stdin/stdout. Returns 0 (also after Ctrl-C/Ctrl-D at the prompt).

    Without --k (`spec.k_given` False), the K `specdec tune --save` chose for these models, method and machine.

    Raises (before the first prompt): ModelError, IncompatiblePairError, ConfigError, UsageError (bad --k/--method).
    """
    from specdec_cli.config import config_dir

    interactive = _isatty(sys.stdin)
    err = err_console()
    view = ChatView(
        out=sys.stdout, err=err, interactive=interactive, styled=wants_color(sys.stdout, plain), show_rejected=not clean
    )
    with open_session(models, method=spec.method, reporter=RichReporter(err)) as session:
        saved_k = tuned_k(session, spec)
        announce_tuned_k(err, saved_k)
        chat = Chat(session, spec=spec, config=config, view=view, system=system, saved_k=saved_k)
        try:
            reader = LineReader(
                sys.stdin, interactive=interactive, history=config_dir() / HISTORY_FILE if interactive else None
            )
            view.banner(session, spec, config)
            try:
                loop(chat, reader)
            finally:
                reader.close()
            view.goodbye(chat.totals)
        finally:
            chat.close()  # the drafters and --k auto save what they learnt; then the session frees the models
    return 0


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
