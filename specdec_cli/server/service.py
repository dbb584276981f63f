"""The server's only contact with the engine: one loaded `Session`, one engine kept for the server's life.

`GenerationService` turns the internal `request.Request` (whatever API it came in through) into prompt tokens (the
chat template with the tools, raw text, token ids) and the engine's `GenerationConfig` (the grammar of its tools and
output format), and drives one request's generation through `specdec_cli.driver` (like every command): the driver
times it, keeps its `RunStats` from the same records the client was sent (so the usage and the statistics cannot
disagree with the stream) and saves a finished prompt to the prompt cache. Everything else in `specdec_cli.server`
sees only requests, text, records and `RequestStats`.

One engine (one drafter, one K controller) serves every request, so the suffix store and `--k auto` learn across
requests; the target's KV cache is never cleared between requests: `backend.sync` at the start of each generation
keeps the longest common prefix with the previous one (chat clients resend the whole conversation), and a long
conversation's KV is parked in memory while a request with other tokens runs (`stores.kv_parking`: a coding agent's
title request between two turns), then swapped back in for its next turn.

Not thread-safe: llama.cpp's context is not. `check`, `parser` and `prompt_tokens` touch no model (the HTTP side calls
them: a prompt is rendered and tokenized with `session.PromptText`, a vocabulary-only load apart from the context, so
`count_tokens` and a request's tokenizing never wait for a generation); every other method runs on one thread
(`specdec_cli.server.worker.Worker`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from specdec_cli.assemble import Assembler
from specdec_cli.core.records import TokenLogprob
from specdec_cli.driver import Drive, stream
from specdec_cli.errors import ToolsUnsupportedError
from specdec_cli.models.backend import FimTokens
from specdec_cli.server.custom_tools import decode_calls, template_arguments
from specdec_cli.server.errors import ApiError
from specdec_cli.server.fim import fim_prompt
from specdec_cli.server.guards import CallGuard
from specdec_cli.server.lanes import Scheduler
from specdec_cli.server.pass_log import pass_log
from specdec_cli.server.reply import Parser, PieceLogprob, ReplyStream
from specdec_cli.server.request import Message, Output, Request
from specdec_cli.server.tool_formats import ToolFormat
from specdec_cli.server.tool_formats import detect as detect_tool_format
from specdec_cli.session import Session
from specdec_cli.spec import SpecOptions
from specdec_cli.stores.kv_parking import KvParking
from specdec_cli.stores.prompt_cache import PromptCache

KEPT_PROMPTS = 8  # conversations whose prompt token ids `GenerationService.prompt_tokens` keeps


class GenerationService:
    """One loaded model pair and one speculative engine, for every request of a server's life.

    Args:
        session: the loaded models (`open_session`); the service owns it and closes it.
        spec: drafter and K. The drafter and `--k auto` controller are built once here and keep learning.
        saved_k: the fixed K `specdec tune --save` chose (None: `spec.k`).
        model_id: the name `/v1/models` reports (default: the target file's stem).

    Raises (construction): UsageError for a bad method or K (`Assembler.make_drafter`, `make_controller`).
    """

    def __init__(
        self, session: Session, spec: SpecOptions, *, saved_k: int | None = None, model_id: str | None = None
    ) -> None:
        self.session = session
        self.spec = spec
        self.model_id = model_id or session.target_path.stem
        self.assembler = Assembler(session)  # the drafter and `--k auto`'s controller, saved by `close`
        self._engine = self.assembler.engine(spec, saved_k=saved_k)
        self._engine.parking = KvParking()  # a conversation's KV survives a side request (kv_parking)
        self._engines = [self._engine]  # one per slot
        self.scheduler = self._share(getattr(session.target, "n_lanes", 1))
        self._closed = False
        target = session.target  # looked up here, before the worker thread owns the models
        self.text = session.prompt_text()
        """The target's tokenizer and chat template apart from its context (`session.PromptText`): any thread."""
        self.tool_format: ToolFormat = detect_tool_format(
            target.chat_template(), lambda t: target.tokenize(t, add_special=False, parse_special=True), target.piece
        )
        """How the chat template takes tools and writes calls (`tool_formats`: Hermes, Llama 3, Mistral, Phi-4, or
        the generic JSON fallback)."""
        self.fim: FimTokens = self.text.fim_tokens()
        """The model's fill-in-the-middle tokens (`require_fim`)."""
        self.n_vocab: int = target.n_vocab
        self._kept: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # `prompt_tokens`' conversations, newest last
        self._kept_lock = threading.Lock()

    def _share(self, n_lanes: int) -> Scheduler:
        """Serve `n_lanes` requests at once (`server.lanes`): an engine per slot over its `Slot`, each with its own
        drafter state (`Drafter.fork`: the suffix store and corpora shared), parked states and prompt-cache scope; the
        K controller is shared, so what `--k auto` learns across replies on one slot serves all, while each slot's
        engine keeps the per-reply state of its own sequence of it (`KController.sequence`). One slot: the engine
        as it is, over the target."""
        from specdec_cli.core.engine import SpeculativeEngine

        engine = self._engine
        scheduler = Scheduler(self.session.target, n_lanes, curve=engine.curve)
        if (log := pass_log()) is not None:
            scheduler.log = log  # every pass, on disk too
        engine.target, engine.passes = scheduler.slots[0].backend, scheduler.slots[0]
        for slot in scheduler.slots[1:]:
            drafter = engine.drafter.fork() if engine.drafter is not None else None
            cache = PromptCache() if engine.prompt_cache is not None else None
            self._engines.append(
                SpeculativeEngine(
                    slot.backend,
                    drafter,
                    engine.controller,
                    prompt_cache=cache,
                    parking=KvParking(),
                    curve=engine.curve,
                )
            )
            self._engines[-1].passes = slot
        return scheduler

    def kv_memory(self) -> dict[str, Any]:
        """The KV cache's size: {"lanes", "ctx" (tokens per lane), "bytes_per_token", "bytes" (the whole pool,
        allocated at load: lanes x ctx x bytes per token)}; bytes 0 where the backend cannot say (a fake). A recurrent
        or hybrid target adds "kind", "rollback", "n_rs_seq" (snapshots per sequence) and "snapshot_bytes" (what
        they take per lane, `LlamaBackend.snapshot_bytes`)."""
        target = self.session.target
        per = target.kv_bytes_per_token() if hasattr(target, "kv_bytes_per_token") else 0
        doc: dict[str, Any] = {
            "lanes": self.lanes,
            "ctx": target.n_ctx,
            "bytes_per_token": per,
            "bytes": per * target.n_ctx * self.lanes,
        }
        if getattr(target, "kind", "transformer") != "transformer":
            doc.update(
                kind=target.kind,
                rollback=target.rollback,
                n_rs_seq=getattr(target, "n_rs_seq", 0),
                snapshot_bytes=target.snapshot_bytes if hasattr(target, "snapshot_bytes") else 0,
            )
        return doc

    @property
    def lanes(self) -> int:
        """Requests generated at once (`specdec serve --parallel`)."""
        return len(self._engines)

    def lane_tokens(self, lane: int) -> list[np.ndarray]:
        """What lane `lane` could reuse for a prompt: the tokens its KV cache holds and those of its parked states
        (for choosing the lane that shares the longest prefix with a request, as llama-server picks a slot)."""
        engine = self._engines[lane]
        held = [np.asarray(engine.target.tokens)]
        if isinstance(engine.parking, KvParking):
            held += engine.parking.parked_tokens()
        return held

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def n_ctx(self) -> int:
        """The target's context window (tokens)."""
        return self.session.target.n_ctx

    def prepare(self) -> None:
        """Build now, before the server answers, what the first request would otherwise build on the worker thread
        while holding the GIL: the target's llguidance tokenizer (`Backend.lltokenizer`, for grammars: tools and
        JSON schemas). Its construction in Rust (long for a large vocabulary) does not release the GIL, so the
        event loop (`/health`, every stream) would stand still that long at the first request with tools. A
        vocabulary it cannot be built from is left to that request's error, as before."""
        try:
            self.session.target.lltokenizer()
        except Exception:  # noqa: BLE001 (the first request with a grammar reports it)
            pass

    # -- the HTTP side (no model contact) -----------------------------------------------------------------------
    def check(self, request: Request) -> Request:
        """`request` with the grammar its tools (in the template's tool-call format) and output format ask for in
        its `config` (llguidance compiles nothing here that the translator has not checked already: a bad schema
        was a 400 there).

        Raises ApiError (400, param "tools"): llguidance refused the tools' grammar."""
        grammar = request.output.grammar if request.output is not None else None
        if request.tools is not None:
            schema = dict(request.output.schema) if request.output is not None else None
            grammar = self.tool_format.grammar(request.tools, schema)
        return replace(request, config=replace(request.config, grammar=grammar))

    def require_fim(self, param: str) -> None:
        """Raise ApiError (400, `param`, naming the model) unless the model has fill-in-the-middle tokens."""
        if not self.fim.usable:
            raise ApiError(
                400,
                f"{self.session.target_path.name} has no fill-in-the-middle tokens (FIM prefix, "
                "suffix and middle), so it cannot complete between a prefix and a suffix. Serve a code "
                "model trained for it (e.g. -t qwen2.5-coder-1.5b), or send the prompt without a suffix.",
                param=param,
            )

    def check_token_ids(self, ids, param: str) -> tuple[int, ...]:
        """`ids` (a prompt as token ids) as a tuple; raise ApiError (400, `param`) for an id outside the
        vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ApiError(
                400,
                f"{param} holds token id {bad}, outside this model's vocabulary (0-{self.n_vocab - 1}).",
                param=param,
            )
        return tuple(ids)

    def parser(self, request: Request) -> Parser:
        """The parser that splits `request`'s reply into text and tool calls (`reply.ReplyStream`), in the
        template's format (`ToolFormat.parser`): text passes through when the request has no tools; a custom tool's
        call carries its raw input (`custom_tools.decode_calls`)."""
        return decode_calls(self.tool_format.parser(request.tools, request.output is not None), request.tools)

    def reply(self, request: Request) -> ReplyStream:
        """The reply of `request`, parsed and collected as it is generated: its parser, and the guard against
        repeated tool calls (`guards.CallGuard`: none identical to an earlier one of the reply, or to an answered
        one of the conversation's last assistant turn)."""
        return ReplyStream(self.parser(request), CallGuard.of(request.messages))

    def without_calls(self, request: Request) -> Request:
        """`request` with tool_choice "none" (the same prompt: the template still shows the tools), `check`ed: the
        worker's second generation after a reply that stopped before a repeated call and said nothing."""
        if request.tools is None:
            return request
        return self.check(replace(request, tools=replace(request.tools, mode="none")))

    # -- prompts (any thread) -------------------------------------------------------------------------------------
    def tokenized(self, request: Request) -> Request:
        """`request` with its prompt's token ids (`prompt_tokens`) in `Request.prompt_ids` and its prediction's in
        `Request.prediction_ids`: the HTTP side calls it (off the event loop) before queueing, so the worker only
        decodes. Raises what `prompt_tokens` raises."""
        if request.prompt_ids is not None:
            return request
        prediction = (
            None
            if request.prediction is None
            else tuple(self.text.tokenize(request.prediction, add_special=False, parse_special=False))
        )
        return replace(request, prompt_ids=tuple(self.prompt_tokens(request)), prediction_ids=prediction)

    def prompt_tokens(self, request: Request) -> list[int]:
        """Token ids of `request`'s prompt: `Request.prompt_ids` when `tokenized` filled them in, else its messages
        through the target's chat template (tools and the history's calls as the template's tool-call format has
        them: `ToolFormat.render`; the assistant's generation prompt appended), its raw text (BOS as the model wants,
        special tokens such as `<|fim_prefix|>` parsed, as llama-server does), its token ids as they are, or its FIM
        prompt (`fim.fim_prompt`). Safe from any thread, while the worker decodes (`session.PromptText`).

        The token ids of the last `KEPT_PROMPTS` conversations are kept, keyed by what the template is given (the
        messages, tools and template arguments): one rendered again (Anthropic's `count_tokens` of a conversation just
        sent to be answered, a client's retry) is neither rendered nor tokenized again, since rendering and tokenizing
        an agent's long request is slow while a generation's compute threads hold the cores.

        Raises:
            ApiError (400, param "tools"): the template cannot express tools (`ToolsUnsupportedError`).
            UsageError: the template refused the conversation. ModelError: the template failed.
        """
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        text = self.text
        if request.fim is not None:
            self.require_fim("suffix")
            return fim_prompt(text, request.fim, n_ctx=self.n_ctx, n_predict=request.config.max_tokens)
        if not request.is_chat:
            if isinstance(request.prompt, str):
                return text.tokenize(request.prompt, add_special=True, parse_special=True)
            assert request.prompt is not None  # (a request is a chat, a completion's prompt or a FIM)
            return list(request.prompt)
        tools = [t.template_json() for t in request.tools.specs] if request.tools is not None else None
        messages = template_messages(with_description(request.messages, request.output))
        try:  # in the order given: a template's `tojson` keeps a dict's order, so {"b", "a"} is another prompt
            key: str | None = json.dumps([messages, tools, request.template_kwargs])
        except (TypeError, ValueError):  # a value JSON cannot write: not kept
            key = None
        with self._kept_lock:
            kept = self._kept.get(key) if key is not None else None
            if key is not None and kept is not None:
                self._kept.move_to_end(key)
                return list(kept)
        messages, tools = self.tool_format.render(messages, tools)
        try:
            prompt = text.chat_prompt(messages, tools=tools, template_kwargs=request.template_kwargs)
        except ToolsUnsupportedError as e:
            raise ApiError(400, str(e), param="tools") from None
        ids = text.tokenize_chat(prompt)
        if key is not None:
            with self._kept_lock:
                self._kept[key] = tuple(ids)
                while len(self._kept) > KEPT_PROMPTS:
                    self._kept.popitem(last=False)
        return ids

    # -- generation ---------------------------------------------------------------------------------------------
    def stream(
        self,
        request: Request,
        prompt_tokens: Sequence[int],
        interrupt: Callable[[], None] | None = None,
        lane: int = 0,
        *,
        rows: bool = False,
    ) -> Drive:
        """One request's generation (`driver.Drive`): iterate it for the engine's records, read its stats after.

        Closing it early (client gone, shutdown) leaves the target's KV cache holding only committed tokens, ready
        for the next request's prefix reuse; a request that finished is saved to the prompt cache.

        Args:
            request: the request, `check`ed (its config holds its grammar); its `prediction` (predicted outputs) is
                drafted from by `--method auto` and `predict` (its drafts carry `Step.source == "predict"`), never
                evaluated.
            prompt_tokens: int [n], from `prompt_tokens`.
            interrupt: called between the prefill's chunks; raises to stop it (`GenerationConfig.interrupt`).
            lane: the slot generating it (0..lanes - 1: `server.lanes`).
            rows: the `Drive` hands each pass out as `engine.Rows` to be answered with its logits (the server's
                `lanes.Scheduler` runs them); False: it runs them on the target itself.

        Raises:
            ContextOverflowError: the prompt does not fit in the context window (raised here, before generating).
            UsageError: empty prompt. BackendError (from the iteration): llama.cpp failed.
        """
        prediction = (
            request.prediction_ids
            if request.prediction_ids is not None
            else self.session.prediction_tokens(request.prediction)
        )
        config = replace(request.config, prediction=prediction, interrupt=interrupt)
        if request.scope != self.scheduler.slots[lane].scope:  # (whose requests the slot's caches hold)
            self._enter_scope(request.scope, lane)
        return stream(self._engines[lane], prompt_tokens, config, rows=rows)

    def _enter_scope(self, scope: str | None, lane: int = 0) -> None:
        """Serve `scope`'s requests from now on on `lane`: nothing another client's requests left may serve them
        (whose cached prefix would also show in `usage.cached_tokens`): the lane's KV cache is emptied, its parked
        states dropped, its prompt cache keyed by `scope`."""
        engine = self._engines[lane]
        engine.save_prompt()  # the previous scope's last state, under its own key
        engine.target.truncate(0)
        engine.parking = KvParking()
        if isinstance(engine.prompt_cache, PromptCache):
            engine.prompt_cache.scope = scope
        self.scheduler.slots[lane].scope = scope  # (and so whose cells another slot may copy: `Scheduler`)

    def pieces(self, logprobs: Sequence[TokenLogprob]) -> tuple[PieceLogprob, ...]:
        """The step's `Step.logprobs` with each token's bytes (`Backend.piece`), for the response JSON."""
        piece = self.session.target.piece
        return tuple(
            PieceLogprob(piece(lp.token), lp.logprob, tuple((piece(t), p) for t, p in lp.top)) for lp in logprobs
        )

    def save_learnt(self) -> None:
        """Save what the drafter's store and `--k auto` learnt so far (`Assembler.save`), serving on: the worker
        calls it between requests and when idle (`Saver`)."""
        self.assembler.save()

    def close(self) -> None:
        """Save what was learnt (`Assembler.close`: the drafter's store, `--k auto`'s controller), then free the
        models (`Session.close`). The KV cache goes to the prompt cache first: a finished request's is saved already
        (then this writes nothing), but a request that did not finish (a client that gave up during a long prefill,
        a shutdown mid-reply) would otherwise be evaluated again after a restart. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for engine in self._engines:
                engine.save_prompt()
            self.assembler.close()
        finally:
            self.session.close()


def with_description(messages: Sequence[Message], output: Output | None) -> Sequence[Message]:
    """`messages` with a response format's description shown to the model, as OpenAI does: a line "Respond with JSON
    (NAME): DESCRIPTION" appended to the first system message, or a system message of its own first."""
    if output is None or not output.description:
        return messages
    line = (
        f"Respond with JSON ({output.name}): {output.description}"
        if output.name
        else f"Respond with JSON: {output.description}"
    )
    if messages and messages[0].role == "system":
        first = messages[0]
        return (replace(first, content=f"{first.content}\n\n{line}" if first.content else line), *messages[1:])
    return (Message("system", line), *messages)


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (Hugging Face's convention): {"role", "content"}, a participant's
    `name`, an assistant's `reasoning_content` (sent back) and `tool_calls` as [{"id", "type": "function",
    "function": {"name", "arguments": object}}] (Qwen2.5's template writes them with `tojson`; arguments that are not
    a JSON object stay text; a custom tool's input is {"input": text}: `custom_tools.template_arguments`), a tool
    turn's `tool_call_id`."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning is not None:
            msg["reasoning_content"] = m.reasoning
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": template_arguments(c)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out
