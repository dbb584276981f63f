"""The server's only contact with the engine: one loaded `Session`, one engine kept for the server's life.

`GenerationService` turns the internal `request.Request` (whatever API it came in through) into prompt tokens (the
chat template with the tools, raw text, token ids) and the engine's `GenerationConfig` (the grammar of its tools and
output format), and drives one request's generation through `specdec_cli.driver` (like every command): the driver
times it, keeps its `RunStats` from the same records the client was sent (so the usage and the statistics cannot
disagree with the stream) and saves a finished prompt to the prompt cache. Everything else in `specdec_cli.server`
sees only requests, text, records and `RequestStats`.

One engine (one drafter, one K controller) serves every request, so the suffix store and `--k auto` learn across
requests; the target's KV cache is never cleared between requests: `backend.sync` at the start of each generation
keeps the longest common prefix with the previous one (chat clients resend the whole conversation).

Not thread-safe: llama.cpp's context is not. `check` and `parser` touch no model (the HTTP side calls them); every
other method runs on one thread (`specdec_cli.server.worker.Worker`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Sequence

from specdec_cli.driver import Drive, stream
from specdec_cli.errors import ToolsUnsupportedError
from specdec_cli.assemble import Assembler
from specdec_cli.core.records import TokenLogprob
from specdec_cli.server.errors import ApiError
from specdec_cli.server.reply import PieceLogprob
from specdec_cli.server.request import Message, Request
from specdec_cli.server.tools import OPEN, ReplyParser, Tags, detect_tags, grammar as tools_grammar
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions


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

    # -- the HTTP side (no model contact) -----------------------------------------------------------------------
    def check(self, request: Request) -> Request:
        """`request` with the grammar its tools and output format ask for in its `config` (llguidance compiles
        nothing here that the translator has not checked already: a bad schema was a 400 there).

        Raises ApiError (400, param "tools"): llguidance refused the tools' grammar."""
        grammar = request.output.grammar if request.output is not None else None
        if request.tools is not None:
            schema = dict(request.output.schema) if request.output is not None else None
            grammar = tools_grammar(request.tools, self.tool_tags, reply=schema)
        return replace(request, config=replace(request.config, grammar=grammar))

    def parser(self, request: Request) -> ReplyParser:
        """The parser that splits `request`'s reply into text and tool calls (`reply.ReplyStream`): it passes text
        through when the request calls no tools; under `auto` without an output format, a reply that is one bare or
        fenced JSON call is a call too (`tools.grammar`)."""
        calls = request.calls_tools
        loose = calls and request.tools.mode == "auto" and request.output is None
        return ReplyParser(calls, loose=loose)

    # -- prompts (the worker thread) ------------------------------------------------------------------------------
    def prompt_tokens(self, request: Request) -> list[int]:
        """Token ids of `request`'s prompt: its messages through the target's chat template (tools included, the
        assistant's generation prompt appended), its raw text (BOS as the model wants, special tokens not parsed),
        or its token ids as they are.

        Raises:
            ApiError (400, param "tools"): the template cannot express tools (`ToolsUnsupportedError`), or asks for
                another tool-call format than `<tool_call>`.
            UsageError: the template refused the conversation. ModelError: the template failed.
        """
        if not request.is_chat:
            if isinstance(request.prompt, str):
                return self.session.target.tokenize(request.prompt, add_special=True, parse_special=False)
            return list(request.prompt)
        tools = [t.template_json() for t in request.tools.specs] if request.tools is not None else None
        try:
            prompt = self.session.chat_prompt(template_messages(request.messages), tools=tools)
        except ToolsUnsupportedError as e:
            raise ApiError(400, str(e), param="tools") from None
        if tools and request.calls_tools and OPEN not in prompt:
            raise ApiError(400, f"The chat template of {self.session.target_path.name} does not ask for tool calls "
                           f"in the {OPEN} format, the one specdec serve parses (Qwen2.5's, Hermes'). Use such a "
                           "model, or send no tools.", param="tools")
        return self.session.tokenize_chat(prompt)

    # -- generation ---------------------------------------------------------------------------------------------
    def stream(self, request: Request, prompt_tokens: Sequence[int]) -> Drive:
        """One request's generation (`driver.Drive`): iterate it for the engine's records, read its stats after.

        Closing it early (client gone, shutdown) leaves the target's KV cache holding only committed tokens, ready
        for the next request's prefix reuse; a request that finished is saved to the prompt cache.

        Args:
            request: the request, `check`ed (its config holds its grammar); its `prediction` (predicted outputs) is
                drafted from by `--method auto` and `predict` (its drafts carry `Step.source == "predict"`), never
                evaluated.
            prompt_tokens: int [n], from `prompt_tokens`.

        Raises:
            ContextOverflowError: the prompt does not fit in the context window (raised here, before generating).
            UsageError: empty prompt. BackendError (from the iteration): llama.cpp failed.
        """
        config = replace(request.config, prediction=self.session.prediction_tokens(request.prediction))
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


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (Hugging Face's convention): {"role", "content"}, an assistant's
    `tool_calls` as [{"id", "type": "function", "function": {"name", "arguments": object}}] (Qwen2.5's template
    writes them with `tojson`; arguments that are not a JSON object stay text), a tool turn's `tool_call_id`."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
