"""The server's only contact with the engine: one loaded `Session`, one engine kept for the server's life.

`GenerationService` tokenizes (chat template or raw text) and drives one request's generation through
`specdec_cli.driver` (like every command): the driver times it, keeps its `RunStats` from the same records the client
was sent (so the usage and the statistics cannot disagree with the stream) and saves a finished prompt to the prompt
cache. Everything else in `specdec_cli.server` sees only token ids, text, records and `RequestStats`.

One engine (one drafter, one K controller) serves every request, so the suffix store and `--k auto` learn across
requests; the target's KV cache is never cleared between requests: `backend.sync` at the start of each generation
keeps the longest common prefix with the previous one (chat clients resend the whole conversation).

Not thread-safe: llama.cpp's context is not. Call it from one thread (`specdec_cli.server.worker.Worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from specdec_cli.driver import Drive, stream
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.errors import ToolsUnsupportedError
from specdec_cli.assemble import Assembler
from specdec_cli.core.records import TokenLogprob
from specdec_cli.server.errors import ApiError
from specdec_cli.server.tools import OPEN, Tags, detect_tags
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions
from specdec_cli.core.stats import RunStats


class GenerationService:
    """One loaded model pair and one speculative engine, for every request of a server's life.

    Args:
        session: the loaded models (`open_session`); the service owns it and closes it.
        spec: drafter and K. The drafter and `--k auto` controller are built once here and keep learning.
        saved_k: the fixed K `specdec tune --save` chose (None: `spec.k`).
        model_id: the name `/v1/models` reports (default: the target file's stem).

    Raises (construction): UsageError for a bad method or K (`Assembler.make_drafter`, `make_controller`).
    """

    def __init__(self, session: Session, spec: SpecOptions, *, saved_k: int | None = None,
                 model_id: str | None = None) -> None:
        self.session = session
        self.spec = spec
        self.model_id = model_id or session.target_path.stem
        self.assembler = Assembler(session)  # the drafter and `--k auto`'s controller, saved by `close`
        self._engine = self.assembler.engine(spec, saved_k=saved_k)
        self._closed = False
        target = session.target  # looked up here, before the worker thread owns the models
        self.tool_tags: Tags = detect_tags(lambda t: target.tokenize(t, add_special=False, parse_special=True),
                                           target.piece)
        """How the vocabulary writes `<tool_call>` (special tokens or text), for the tools' grammar."""

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def n_ctx(self) -> int:
        """The target's context window (tokens)."""
        return self.session.target.n_ctx

    # -- prompts ------------------------------------------------------------------------------------------------
    def chat_tokens(self, messages: list[dict[str, Any]], tools: Sequence[dict] = (), *,
                    parse_calls: bool = False) -> list[int]:
        """Token ids of `messages` through the target's own chat template, with the assistant generation prompt
        appended; `tools` (OpenAI's tool dicts) go to the template too.

        Args:
            parse_calls: the reply's tool calls will be parsed: the template must ask for the `<tool_call>` format.

        Raises:
            ApiError (400, param "tools"): the template cannot express tools (`ToolsUnsupportedError`), or asks for
                another tool-call format than `<tool_call>`.
            UsageError: the template refused the conversation. ModelError: the template failed.
        """
        try:
            prompt = self.session.chat_prompt(messages, tools=list(tools) or None)
        except ToolsUnsupportedError as e:
            raise ApiError(400, str(e), param="tools") from None
        if tools and parse_calls and OPEN not in prompt:
            raise ApiError(400, f"The chat template of {self.session.target_path.name} does not ask for tool calls "
                           f"in the {OPEN} format, the one specdec serve parses (Qwen2.5's, Hermes'). Use such a "
                           "model, or send no tools.", param="tools")
        return self.session.tokenize_chat(prompt)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of raw text (`/v1/completions`): BOS added as the model wants, special tokens not parsed."""
        return self.session.target.tokenize(text, add_special=True, parse_special=False)

    # -- generation ---------------------------------------------------------------------------------------------
    def stream(self, prompt_tokens: Sequence[int], config: GenerationConfig,
               prediction_text: str | None = None) -> Drive:
        """One request's generation (`driver.Drive`): iterate it for the engine's records, read its stats after.

        Closing it early (client gone, shutdown) leaves the target's KV cache holding only committed tokens, ready
        for the next request's prefix reuse; a request that finished is saved to the prompt cache.

        Args:
            prompt_tokens: int [n] prompt (chat-templated or raw).
            prediction_text: the request's predicted output (OpenAI `prediction.content`): drafted from by
                `--method auto` and `predict` (its drafts carry `Step.source == "predict"`), never evaluated.

        Raises:
            ContextOverflowError: the prompt does not fit in the context window (raised here, before generating).
            UsageError: empty prompt. BackendError (from the iteration): llama.cpp failed.
        """
        config = replace(config, prediction=self.session.prediction_tokens(prediction_text))
        return stream(self._engine, prompt_tokens, config)

    def pieces(self, logprobs: Sequence[TokenLogprob]) -> tuple[PieceLogprob, ...]:
        """The step's `Step.logprobs` with each token's bytes (`Backend.piece`), for the response JSON."""
        piece = self.session.target.piece
        return tuple(PieceLogprob(piece(lp.token), lp.logprob, tuple((piece(t), p) for t, p in lp.top))
                     for lp in logprobs)

    def close(self) -> None:
        """Save what was learnt (`Assembler.close`: the drafter's store, `--k auto`'s controller), then free the
        models (`Session.close`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.assembler.close()
        finally:
            self.session.close()


@dataclass(frozen=True, slots=True)
class PieceLogprob:
    """One emitted token's log-probability with the bytes of it and of its top alternatives (`TokenLogprob` with the
    vocabulary applied, on the worker thread).

    Attributes:
        piece: the token's bytes (may be part of a UTF-8 character).
        logprob: natural log-probability (<= 0).
        top: (bytes, logprob) of the most likely tokens, most likely first.
    """

    piece: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True)
class RequestStats:
    """One request's numbers, from the records it was sent.

    Attributes:
        run: the driver's `RunStats` (prompt/cached/generated tokens, drafted, accepted by source, tok/s, ...).
        wall_ms: wall time from the start of the prefill to the last record (ms).
    """

    run: RunStats
    wall_ms: float = 0.0

    @classmethod
    def of(cls, drive: Drive) -> RequestStats:
        return cls(run=drive.stats, wall_ms=drive.wall_ms)
