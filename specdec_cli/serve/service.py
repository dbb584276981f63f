"""The server's only contact with the engine: one loaded `Session`, one engine kept for the server's life.

`GenerationService` tokenizes (chat template or raw text) and drives one request's generation through
`specdec_cli.driver` (like every command): the driver times it, keeps its `RunStats` from the same records the client
was sent (so the usage and the statistics cannot disagree with the stream) and saves a finished prompt to the prompt
cache. Everything else in `specdec_cli.serve` sees only token ids, text, records and `RequestStats`.

One engine (one drafter, one K controller) serves every request, so the suffix store and `--k auto` learn across
requests; the target's KV cache is never cleared between requests: `backend.sync` at the start of each generation
keeps the longest common prefix with the previous one (chat clients resend the whole conversation).

Not thread-safe: llama.cpp's context is not. Call it from one thread (`specdec_cli.serve.worker.Worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from specdec_cli.driver import Drive, stream
from specdec_cli.engine import GenerationConfig
from specdec_cli.generation import make_engine
from specdec_cli.session import Session, SpecOptions
from specdec_cli.stats import RunStats


class GenerationService:
    """One loaded model pair and one speculative engine, for every request of a server's life.

    Args:
        session: the loaded models (`open_session`); the service owns it and closes it.
        spec: drafter and K. The drafter and `--k auto` controller are built once here and keep learning.
        saved_k: the fixed K `specdec tune --save` chose (None: `spec.k`).
        model_id: the name `/v1/models` reports (default: the target file's stem).

    Raises (construction): UsageError for a bad method or K (`Session.make_drafter`, `make_controller`).
    """

    def __init__(self, session: Session, spec: SpecOptions, *, saved_k: int | None = None,
                 model_id: str | None = None) -> None:
        self.session = session
        self.spec = spec
        self.model_id = model_id or session.target_path.stem
        self._engine = make_engine(session, spec, saved_k=saved_k)
        self._closed = False

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def n_ctx(self) -> int:
        """The target's context window (tokens)."""
        return self.session.target.n_ctx

    # -- prompts ------------------------------------------------------------------------------------------------
    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` ({"role", "content"}) through the target's own chat template, with the assistant
        generation prompt appended."""
        return self.session.chat_tokens(messages)

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

    def close(self) -> None:
        """Save what was learnt and free the models (`Session.close`: the drafter's store, `--k auto`'s controller,
        then the models). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.session.close()


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
