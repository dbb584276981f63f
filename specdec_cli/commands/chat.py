"""`specdec chat`: a multi-turn conversation, each reply generated with speculative decoding and streamed in colour.

Five parts, each usable alone:
    input       `LineReader`: one message per read. A trailing backslash continues the line, a \"\"\" block spans
                lines; readline history (arrow keys) when stdin is a terminal; Ctrl-D, or Ctrl-C at an empty prompt,
                ends the chat.
    history     `Conversation`: the turns, rendered with the model's own chat template (`Session.chat_tokens`).
                `fit` drops the oldest turns (never the system prompt) until the prompt plus --max-tokens fits.
    commands    `chat_commands.COMMANDS`: the slash-command table (/help /reset /stats /k /method /save /quit).
    generation  `Chat.turn`: one reply through `driver.generate`, the same engine loop as `specdec run`.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from specdec_cli.backend import common_prefix
from specdec_cli.commands.chat_commands import dispatch, is_command
from specdec_cli.commands.chat_view import ChatView
from specdec_cli.engine import GenerationConfig
from specdec_cli.errors import ContextOverflowError, SpecdecError
from specdec_cli.driver import Generation, generate
from specdec_cli.generation import make_engine, saved_k as tuned_k
from specdec_cli.records import Step
from specdec_cli.options import Method
from specdec_cli.render import err_console, wants_color
from specdec_cli.session import NEEDS_DRAFT_MODEL, ModelOptions, Session, SpecOptions, open_session
from specdec_cli.stats import RunStats, summarize

__all__ = ["Chat", "ChatView", "Conversation", "LineReader", "Turn", "dispatch", "execute", "loop"]

HISTORY_FILE = "chat_history"
MIN_REPLY = 32  # a message is refused when it leaves less room than this (or --max-tokens, if smaller) for a reply
REFILL = 0.75  # when turns must go, drop them until the prompt takes at most this share of what the reply leaves


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
# History


@dataclass(frozen=True)
class Turn:
    """One exchange. `stats` are the reply's statistics (from the engine's records); `draft_cache` is the draft
    model's prefill as (tokens evaluated, tokens reused from its cache), None when no draft model ran."""

    user: str
    assistant: str
    interrupted: bool = False
    stats: RunStats | None = None
    method: str = ""
    k: str = ""
    draft_cache: tuple[int, int] | None = None


@dataclass(frozen=True)
class Fit:
    """A prompt that fits: int32 [n] tokens, the first turn still in the context, the reply budget (tokens)."""

    prompt: np.ndarray
    start: int
    budget: int


class Conversation:
    """The turns of one conversation and the window of them that the model sees.

    `turns[start:]` are in the context; older turns were dropped to make room and stay only in the transcript.
    """

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.turns: list[Turn] = []
        self.start = 0

    def messages(self, user: str | None = None, *, start: int | None = None) -> list[dict[str, str]]:
        """The chat messages from turn `start` (default: the window), plus a pending user message."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[self.start if start is None else start :]:
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant}]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def fit(self, chat_tokens: Callable[[list[dict[str, str]]], list[int]], user: str, *, n_ctx: int,
            max_tokens: int) -> Fit:
        """The prompt for `user`'s message, dropping the oldest turns when it plus `max_tokens` overflows `n_ctx`.

        The system prompt is never dropped. Dropping changes the start of the prompt, so the whole window is evaluated
        again; to pay that once every few turns rather than on every turn, turns are dropped until the prompt takes
        at most REFILL of the `n_ctx - max_tokens` tokens the reply leaves. When the message alone leaves less than
        `max_tokens`, the reply budget shrinks to what is left. Raises ContextOverflowError when that is under
        min(max_tokens, MIN_REPLY).
        """
        start = self.start
        limit = n_ctx - max_tokens  # the most the prompt may take
        while True:
            prompt = np.asarray(chat_tokens(self.messages(user, start=start)), dtype=np.int32)
            if len(prompt) <= limit or start == len(self.turns):
                break
            start += 1
            limit = int(REFILL * (n_ctx - max_tokens))  # once dropping, leave room for the next few turns
        room = n_ctx - len(prompt)
        if room < min(max_tokens, MIN_REPLY):
            what = "the system prompt and your message take" if self.system else "your message takes"
            raise ContextOverflowError(
                f"This message does not fit: {what} {len(prompt)} of the {n_ctx} context tokens, "
                "leaving no room for a reply.",
                "Send a shorter message, or restart with a larger --ctx.",
            )
        return Fit(prompt=prompt, start=start, budget=min(max_tokens, room))

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)

    def reset(self) -> None:
        self.turns.clear()
        self.start = 0


@dataclass
class Totals:
    """Session totals over every reply (also interrupted ones), from the same records the stream showed."""

    turns: int = 0
    steps: list[Step] = field(default_factory=list)
    decode_ms: float = 0.0
    n_prompt: int = 0
    n_reused: int = 0  # prompt tokens that came from the target's cache
    prefill_ms: float = 0.0

    def add(self, gen: Generation) -> None:
        s = gen.stats
        self.turns += 1
        self.steps += gen.steps
        self.decode_ms += s.decode_ms
        self.n_prompt += s.n_prompt
        self.n_reused += s.n_cached
        self.prefill_ms += s.prefill_ms

    def summary(self) -> RunStats:
        return summarize(self.steps, decode_ms=self.decode_ms)


# ================================================================================================================
# Generation


class Chat:
    """The chat's state: the session, the speculation settings, the conversation and the totals.

    Raises (from `turn`, `set_spec`): SpecdecError subclasses; the loop prints them and carries on.
    """

    def __init__(self, session: Session, *, spec: SpecOptions, config: GenerationConfig, view: ChatView,
                 system: str | None = None, saved_k: int | None = None) -> None:
        self.session = session
        self.config = config
        self.view = view
        self.conversation = Conversation(system)
        self.totals = Totals()
        self.spec = spec
        self.engine = make_engine(session, spec, saved_k=saved_k)
        self.prediction: str | None = None  # /predict FILE: the predicted output of the next reply only

    @property
    def drafter(self):
        """The drafter replies are generated with (None: plain decoding)."""
        return self.engine.drafter

    def set_spec(self, spec: SpecOptions) -> None:
        """Switch drafter and/or K (the controller `Session.make_controller` gives for it); the conversation and
        caches are kept. Raises UsageError for a bad K before anything changes."""
        rebuild = (spec.method, spec.ngram_min, spec.ngram_max) != (self.spec.method, self.spec.ngram_min,
                                                                   self.spec.ngram_max)
        engine = make_engine(self.session, spec) if rebuild else make_engine(self.session, spec, drafter=self.drafter)
        if rebuild:
            self.engine.close()  # learning drafters save what they learned
        self.engine, self.spec = engine, spec

    def turn(self, text: str) -> Turn | None:
        """Answer one message: fit the history, stream the reply, record it. None when interrupted before any text."""
        target = self.session.target
        fit = self.conversation.fit(self.session.chat_tokens, text, n_ctx=target.n_ctx,
                                    max_tokens=self.config.max_tokens)
        if fit.start > self.conversation.start:
            self.view.dropped(fit.start - self.conversation.start, len(fit.prompt), target.n_ctx,
                              self.config.max_tokens)
            self.conversation.start = fit.start
        if fit.budget < self.config.max_tokens:
            self.view.note(f"The reply is limited to {fit.budget} tokens: that is what the {target.n_ctx}-token "
                           "context has left after your message.")
        draft_cache = self._draft_cache(fit.prompt)
        prediction, self.prediction = self.prediction, None
        config = replace(self.config, max_tokens=fit.budget, sampling=self._sampling(),
                         prediction=self.session.prediction_tokens(prediction))
        renderer = self.view.stream()
        try:
            gen = generate(self.engine, fit.prompt, config, renderer.step)
        except BaseException:
            renderer.end()
            raise
        self.view.end_stream(renderer, gen.text)
        self.totals.add(gen)
        if gen.interrupted and not gen.text:
            self.view.note("Interrupted before any text; the message was not added to the conversation.")
            return None
        turn = Turn(user=text, assistant=gen.text, interrupted=gen.interrupted, stats=gen.stats,
                    method=self.spec.method, k=self.spec.k, draft_cache=draft_cache)
        self.conversation.add(turn)
        self.view.footer(turn)
        return turn

    def _draft_cache(self, prompt: np.ndarray) -> tuple[int, int] | None:
        """(evaluated, reused) for the draft model's prefill of `prompt`: `ModelDrafter.begin` keeps the longest
        common prefix of its cache and prompt[:-1] and evaluates the rest."""
        draft = self.session.draft
        if draft is None or self.spec.method not in NEEDS_DRAFT_MODEL:
            return None
        reused = common_prefix(draft.tokens, prompt[:-1])
        return len(prompt) - 1 - reused, reused

    def _sampling(self):
        """Per-turn seed: --seed + turn number, so a scripted chat is reproducible but turns do not share draws."""
        s = self.config.sampling
        return s if s.seed is None else replace(s, seed=s.seed + self.totals.turns)

    def close(self) -> None:
        self.engine.close()


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


def execute(*, models: ModelOptions, spec: SpecOptions, config: GenerationConfig, system: str | None,
            plain: bool = False, clean: bool = False, use_saved_k: bool = False) -> int:
    """Run a chat on stdin/stdout. Returns 0 (also after Ctrl-C/Ctrl-D at the prompt).

    use_saved_k: --k was not given: use the K `specdec tune --save` chose for these models, method and machine.

    Raises (before the first prompt): ModelError, IncompatiblePairError, ConfigError, UsageError (bad --k/--method).
    """
    from specdec_cli.config import config_dir

    interactive = _isatty(sys.stdin)
    err = err_console()
    view = ChatView(out=sys.stdout, err=err, interactive=interactive, styled=wants_color(sys.stdout, plain),
                    show_rejected=not clean)
    with open_session(models, method=spec.method, console=err) as session:
        saved_k = tuned_k(session, spec, err) if use_saved_k and spec.method != Method.none else None
        chat = Chat(session, spec=spec, config=config, view=view, system=system, saved_k=saved_k)
        reader = LineReader(sys.stdin, interactive=interactive,
                            history=config_dir() / HISTORY_FILE if interactive else None)
        view.banner(session, spec, config)
        try:
            loop(chat, reader)
        finally:
            chat.close()
            reader.close()
        view.goodbye(chat.totals)
    return 0


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
