"""`specdec chat`'s history: the turns (`Turn`), the window of them the model sees (`Conversation.fit`) and the
session totals (`Totals`), all from the same records the stream showed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec_cli.core.records import Step
from specdec_cli.core.stats import RunStats, summarize
from specdec_cli.driver import Result
from specdec_cli.errors import ContextOverflowError

MIN_REPLY = 32  # a message is refused when it leaves less room than this (or --max-tokens, if smaller) for a reply
REFILL = 0.75  # when turns must go, drop them until the prompt takes at most this share of what the reply leaves


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

    def fit(
        self, chat_tokens: Callable[[list[dict[str, str]]], list[int]], user: str, *, n_ctx: int, max_tokens: int
    ) -> Fit:
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

    def add(self, gen: Result) -> None:
        s = gen.stats
        self.turns += 1
        self.steps += gen.steps
        self.decode_ms += s.decode_ms
        self.n_prompt += s.n_prompt
        self.n_reused += s.n_cached
        self.prefill_ms += s.prefill_ms

    def summary(self) -> RunStats:
        return summarize(self.steps, decode_ms=self.decode_ms)
