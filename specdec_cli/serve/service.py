"""The server's only contact with the engine: one loaded `Session`, one engine kept for the server's life.

`GenerationService` tokenizes (chat template or raw text), streams the engine's records for one request, and
summarizes them per request (`Tally` → `RequestStats`, from the same records the client was sent, so the usage and
the statistics cannot disagree with the stream). Everything else in `specdec_cli.serve` sees only token ids, text
and `RequestStats`.

One engine (one drafter, one K controller) serves every request, so the suffix store and `--k auto` learn across
requests; the target's KV cache is never cleared between requests: `backend.sync` at the start of each generation
keeps the longest common prefix with the previous one (chat clients resend the whole conversation).

Not thread-safe: llama.cpp's context is not. Call it from one thread (`specdec_cli.serve.worker.Worker`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np

from specdec_cli.engine import GenerationConfig
from specdec_cli.errors import ContextOverflowError, ToolsUnsupportedError, UsageError
from specdec_cli.generation import make_engine
from specdec_cli.records import Finish, Prefill, Record, Step, TokenLogprob
from specdec_cli.serve.errors import ApiError
from specdec_cli.serve.tools import OPEN, Tags, detect_tags
from specdec_cli.session import Session, SpecOptions
from specdec_cli.stats import RunStats, summarize

PREDICT_SOURCE = "predict"  # Step.source of drafts taken from the request's `prediction` (OpenAI predicted outputs)


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
               prediction_text: str | None = None) -> Iterator[Record]:
        """The engine's records for one request: one `Prefill`, then one `Step` per target pass.

        Closing the returned generator early (client gone, shutdown) runs the engine's `finally`, which leaves the
        target's KV cache holding only committed tokens, ready for the next request's prefix reuse.

        Args:
            prompt_tokens: int [n] prompt (chat-templated or raw).
            prediction_text: the request's predicted output (OpenAI `prediction.content`): drafted from by
                `--method auto` and `predict` (its drafts carry `Step.source == "predict"`, which `RequestStats`
                counts), never evaluated.

        Raises:
            ContextOverflowError: the prompt does not fit in the context window (raised here, before generating).
            UsageError: empty prompt. BackendError (from the generator): llama.cpp failed.
        """
        n = len(prompt_tokens)
        if n == 0:
            raise UsageError("The prompt is empty (0 tokens).", "Send some text.")
        if n >= self.n_ctx:
            raise ContextOverflowError(
                f"This model's context window is {self.n_ctx} tokens, and the prompt is {n} tokens.",
                "Shorten the prompt (or the conversation), or restart specdec serve with a larger --ctx.")
        prompt = np.asarray(prompt_tokens, dtype=np.int32)
        config = replace(config, prediction=self.session.prediction_tokens(prediction_text))
        return self._engine.generate(prompt, config)

    def pieces(self, logprobs: Sequence[TokenLogprob]) -> tuple[PieceLogprob, ...]:
        """The step's `Step.logprobs` with each token's bytes (`Backend.piece`), for the response JSON."""
        piece = self.session.target.piece
        return tuple(PieceLogprob(piece(lp.token), lp.logprob, tuple((piece(t), p) for t, p in lp.top))
                     for lp in logprobs)

    def close(self) -> None:
        """Save what was learnt and free the models: the drafter's store (`drafter.close`), then `--k auto`'s
        controller (`session.close` saves it) and the models. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._engine.drafter is not None:
                self._engine.drafter.close()
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
        run: the engine's `RunStats` (prompt/cached/generated tokens, drafted, accepted, tok/s, ...).
        finish_reason: the engine's ("eog", "stop", "length", "context"), or None when the request was cancelled.
        sources: per drafter source ("suffix", "draft", "ngram", "predict", ...): {"steps", "drafted", "accepted"}.
        accepted_prediction_tokens / rejected_prediction_tokens: draft tokens taken from the request's prediction
            (steps whose source is "predict") that verification accepted / rejected (0 without a prediction).
        cached_prompt_tokens: prompt tokens the KV cache already held (kept from the previous request).
        wall_ms: wall time from the start of the prefill to the last record (ms).
    """

    run: RunStats
    finish_reason: str | None
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    cached_prompt_tokens: int = 0
    wall_ms: float = 0.0


class Tally:
    """Consumes one generation's records as they stream: `add` returns each record's output text; `stats` sums up.

    The only place the server reads engine records.
    """

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.finish_reason: str | None = None
        self._t0: float | None = None
        self._t_prefill: float | None = None
        self._t_last: float | None = None

    def start(self) -> None:
        """Mark the start of the request's generation (before the prefill)."""
        self._t0 = time.perf_counter()

    def add(self, record: Record) -> str:
        """Record `record`; return the output text it adds ("" for the prefill)."""
        self.records.append(record)
        now = time.perf_counter()
        self._t_last = now
        if isinstance(record, Prefill):
            self._t_prefill = now
            return ""
        if isinstance(record, Finish):
            self.finish_reason = record.finish_reason
            return ""
        if isinstance(record, Step):
            return record.text
        return ""

    def stats(self) -> RequestStats:
        """The request's `RequestStats` so far (a cancelled request: finish_reason None)."""
        steps = [r for r in self.records if isinstance(r, Step)]
        decode_ms = (self._t_last - self._t_prefill) * 1e3 if steps and self._t_prefill is not None else 0.0
        run = summarize(self.records, decode_ms=decode_ms, finish_reason=self.finish_reason)
        drafted: Counter[str] = Counter()
        accepted: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for s in steps:
            if s.drafted:
                count[s.source] += 1
                drafted[s.source] += len(s.drafted)
                accepted[s.source] += s.n_accepted
        sources = {src: {"steps": count[src], "drafted": drafted[src], "accepted": accepted[src]}
                   for src in sorted(count)}
        wall_ms = (self._t_last - self._t0) * 1e3 if self._t0 is not None and self._t_last is not None else 0.0
        return RequestStats(
            run=run,
            finish_reason=self.finish_reason,
            sources=sources,
            accepted_prediction_tokens=accepted[PREDICT_SOURCE],
            rejected_prediction_tokens=drafted[PREDICT_SOURCE] - accepted[PREDICT_SOURCE],
            # the prefill brings the cache to prompt[:-1]; the last prompt token is evaluated with the first step
            cached_prompt_tokens=max(run.n_prompt - 1 - run.n_prefill_evaluated, 0),
            wall_ms=wall_ms,
        )
