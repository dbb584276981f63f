"""`specdec chat`'s state and its one generation path: `Chat.turn` fits the history, streams one reply through
`driver.generate` (the same driver as `specdec run`) and records it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from specdec_cli.assemble import Assembler
from specdec_cli.cli.commands.chat_history import Conversation, Totals, Turn
from specdec_cli.cli.commands.chat_view import ChatView
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import generate
from specdec_cli.models.backend import common_prefix
from specdec_cli.session import Session
from specdec_cli.spec import NEEDS_DRAFT_MODEL, SpecOptions


class Chat:
    """The chat's state: the session, its `Assembler` (the drafters and K controllers every reply shares), the
    speculation settings, the conversation and the totals. `close` closes the assembler (what was learnt is saved);
    the caller closes the session after it.

    Raises (from `turn`, `set_spec`): SpecdecError subclasses; the loop prints them and carries on.
    """

    def __init__(
        self,
        session: Session,
        *,
        spec: SpecOptions,
        config: GenerationConfig,
        view: ChatView,
        system: str | None = None,
        saved_k: int | None = None,
    ) -> None:
        self.session = session
        self.config = config
        self.view = view
        self.conversation = Conversation(system)
        self.totals = Totals()
        self.spec = spec
        self.assembler = Assembler(session)
        self.engine = self.assembler.engine(spec, saved_k=saved_k)
        self.prediction: str | None = None  # /predict FILE: the predicted output of the next reply only

    @property
    def drafter(self):
        """The drafter replies are generated with (the assembler's for this method; None: plain decoding)."""
        return self.assembler.drafter(self.spec)

    def set_spec(self, spec: SpecOptions) -> None:
        """Switch drafter and/or K (the assembler's drafter for the method, the controller
        `Assembler.make_controller` gives for K); the conversation and caches are kept. Raises UsageError before
        anything changes."""
        self.engine, self.spec = self.assembler.engine(spec), spec

    def close(self) -> None:
        """Close the drafters and save what `--k auto` learnt (`Assembler.close`); the session stays open."""
        self.assembler.close()

    def turn(self, text: str) -> Turn | None:
        """Answer one message: fit the history, stream the reply, record it. None when interrupted before any text."""
        target = self.session.target
        fit = self.conversation.fit(
            self.session.chat_tokens, text, n_ctx=target.n_ctx, max_tokens=self.config.max_tokens
        )
        if fit.start > self.conversation.start:
            self.view.dropped(
                fit.start - self.conversation.start, len(fit.prompt), target.n_ctx, self.config.max_tokens
            )
            self.conversation.start = fit.start
        if fit.budget < self.config.max_tokens:
            self.view.note(
                f"The reply is limited to {fit.budget} tokens: that is what the {target.n_ctx}-token "
                "context has left after your message."
            )
        draft_cache = self._draft_cache(fit.prompt)
        prediction, self.prediction = self.prediction, None
        config = replace(
            self.config,
            max_tokens=fit.budget,
            sampling=self._sampling(),
            prediction=self.session.prediction_tokens(prediction),
        )
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
        turn = Turn(
            user=text,
            assistant=gen.text,
            interrupted=gen.interrupted,
            stats=gen.stats,
            method=self.spec.method,
            k=self.spec.k,
            draft_cache=draft_cache,
        )
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
