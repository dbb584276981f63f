"""The one event stream every API dialect renders: a reply's text and tool calls as they are generated.

The worker turns a request's output (one piece of text per target pass) into `ReplyEvent`s through the request's
`ReplyStream` — text, a tool call's start, pieces of its arguments, its end, and the end of the reply — parsed by
the request's tool-call parser (`tools.ReplyParser`), calls held back until complete and checked against repeats
(`guards.CallGuard`), and collects the whole reply for a non-streamed answer; it sends the events to the HTTP side
(`jobs.Delta`, `jobs.Done`). A translator renders them in its API's wire format (Chat Completions chunks,
Responses events, Anthropic's content blocks); none of them parses model output itself.

Shaped after llama-server's `task_result_state` diffs (one stream of text/tool-call deltas, formatted per API by
`to_json_oaicompat_chat_stream`, `to_json_oaicompat_resp_stream`, `to_json_anthropic_stream`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from specdec_cli.core.records import FinishReason
from specdec_cli.core.stats import RunStats
from specdec_cli.server.guards import CallGuard
from specdec_cli.server.request import ToolCall, ToolKind

if TYPE_CHECKING:
    from specdec_cli.driver import Drive
    from specdec_cli.server.errors import ApiError


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

    def specdec(self, method: str) -> dict:
        """specdec's extra field on every dialect's response: how this request was speculated.

        method: the drafter. drafted / accepted: draft tokens proposed / accepted by the target. acceptance_rate:
        accepted / drafted. tokens_per_pass: output tokens per target forward pass (1.0 = plain decoding).
        target_passes: forward passes in the decode loop. sources: drafted / accepted per drafter source. mean_k: the
        mean draft length chosen. prefill_ms / decode_ms: target prefill / decode loop wall time (ms). tokens_per_s:
        output tokens per second of the decode loop. j_per_token: decoding's joules per output token from the host's
        energy counters (docs/energy.md), null where it has none.
        """
        r = self.run
        return {
            "method": method,
            "drafted": r.n_drafted,
            "accepted": r.n_accepted,
            "acceptance_rate": round(r.acceptance_rate, 4),
            "tokens_per_pass": round(r.tokens_per_pass, 4),
            "target_passes": r.n_target_passes,
            "sources": dict(sorted(r.by_source.items())),
            "mean_k": round(r.mean_k, 3),
            "prefill_ms": round(r.prefill_ms, 2),
            "decode_ms": round(r.decode_ms, 2),
            "tokens_per_s": round(r.tokens_per_s, 2),
            "j_per_token": round(r.j_per_token, 6) if r.j_per_token is not None else None,
            "finish_reason": r.finish_reason,
        }


@dataclass(frozen=True, slots=True)
class Content:
    """Reply text, with the log-probabilities of the tokens the step emitted (when asked: on the first event of a
    step; `text` may then be "" when the parser held the step's text back)."""

    text: str
    logprobs: tuple[PieceLogprob, ...] = ()


def new_id(prefix: str, *, sep: str = "_", digits: int = 24) -> str:
    """A fresh random id in an API's own shape: `prefix`, `sep`, `digits` hex digits (at most 32): Chat's
    "chatcmpl-" and Completions' "cmpl-" + 24, Responses' "resp_", "msg_", "fc_", "ctc_" + 32, Anthropic's "msg_" +
    24, a tool call's "call_" + 24."""
    return f"{prefix}{sep}{uuid.uuid4().hex[:digits]}"


@dataclass
class ParsedCall:
    """A tool call as it is parsed: `arguments` grows while the call streams.

    Attributes:
        index: 0-based among this reply's calls. id: "call_" + 24 hex digits. name: the tool's name.
        arguments: the arguments' text so far, exactly as the model wrote it.
        kind: "function", or "custom" (then `Arguments` and `CallEnd` carry its raw input: `custom_tools`).
    """

    index: int
    id: str
    name: str
    arguments: str = ""
    kind: ToolKind = "function"

    def frozen(self) -> ToolCall:
        """The call as the internal request's `ToolCall`."""
        return ToolCall(self.id, self.name, self.arguments, self.kind)


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins: its index, id and name (its arguments follow as `Arguments`)."""

    call: ParsedCall


@dataclass(frozen=True, slots=True)
class Arguments:
    """The next piece of call `index`'s arguments, exactly as the model wrote them."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """A call is complete: `call` holds its whole arguments text."""

    call: ToolCall
    index: int


@dataclass(frozen=True, slots=True)
class End:
    """The reply ended.

    Attributes:
        finish: the engine's `FinishReason` ("eog": the model ended it or a grammar completed; "stop": a stop string, or
            the reply ended before a repeated tool call; "length": max tokens; "context": the context window is
            full).
        tool_calls: the reply called tools (and was not cut short).
        stats: the request's numbers (usage, speculation statistics).
    """

    finish: FinishReason
    tool_calls: bool
    stats: RequestStats

    @property
    def truncated(self) -> bool:
        """Cut short by a limit (max tokens or the context window)."""
        return self.finish in (FinishReason.length, FinishReason.context)


ReplyEvent = Content | CallStart | Arguments | CallEnd | End


class Parser(Protocol):
    """Splits reply text into `Content`, `CallStart`, `Arguments` and `CallEnd` events as it streams
    (`tools.ReplyParser`)."""

    def feed(self, text: str) -> list[ReplyEvent]: ...

    def close(self, cut: bool = False) -> list[ReplyEvent]:
        """The events of what was held back at the end of the reply; `cut`: the token limit or the context window
        ended it, so an unfinished call is dropped (no events), never completed."""
        ...


@dataclass
class ReplyStream:
    """One reply's events from the worker's text, and the whole reply collected (on the worker thread).

    A tool call is held back until it is complete (`CallStart`, its `Arguments`, its `CallEnd` are released
    together), so a call the reply may not make is never streamed: a call that repeats one (`guards.CallGuard`)
    ends the reply before it (`stopped`; the worker then stops the generation), and a call cut short by the token
    limit or the context window is dropped at `done` (its text with it: half a JSON object is neither a call nor
    content), the finish staying "length" / "context".

    Args:
        parser: the request's tool-call parser (`GenerationService.parser`).
        guard: which calls the reply may make (`guards.CallGuard.of(request.messages)`).

    Attributes:
        text: the reply's text (not its calls). calls: its complete tool calls. logprobs: every emitted token's (the
            tokens after a stop excluded).
        end: the `End` event, once it came.
        stopped: the reply ended before a repeated call; what the model writes after it is ignored.
    """

    parser: Parser
    guard: CallGuard = field(default_factory=CallGuard)
    text: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[PieceLogprob] = field(default_factory=list)
    end: End | None = None
    stopped: bool = False
    _held: list[ReplyEvent] = field(default_factory=list)  # the events of the call being written

    def delta(self, text: str, logprobs: Sequence[PieceLogprob] = ()) -> list[ReplyEvent]:
        """The events of one step's text (`jobs.Delta`); its log-probabilities ride on the first. Nothing once
        `stopped`."""
        if self.stopped:
            return []
        self.logprobs.extend(logprobs)
        events = self._collect(self._release(self.parser.feed(text)))
        if logprobs:
            if events and isinstance(events[0], Content):
                events[0] = Content(events[0].text, tuple(logprobs))
            else:
                events.insert(0, Content("", tuple(logprobs)))
        return events

    def done(self, stats: RequestStats) -> list[ReplyEvent]:
        """The last events: what the parser held back, then `End` (finish "stop" when the reply was `stopped`)."""
        if self.stopped:  # the worker stopped the generation: no `Finish` record said why
            stats = RequestStats(replace(stats.run, finish_reason=FinishReason.stop), stats.wall_ms)
        finish = stats.run.finish_reason or FinishReason.eog
        cut = finish in (FinishReason.length, FinishReason.context)
        events = [] if self.stopped else self._collect(self._release(self.parser.close(cut=cut)))
        self._held = []  # a call still unfinished: never returned
        self.end = End(finish, bool(self.calls) and not cut, stats)
        return [*events, self.end]

    def restart(self, parser: Parser) -> None:
        """Begin the reply again with `parser` (the worker's second generation, without tool calls, after a reply
        that stopped before it said anything)."""
        self.parser, self.stopped, self._held = parser, False, []
        self.text.clear()
        self.logprobs.clear()

    @property
    def empty(self) -> bool:
        """Neither text (whitespace aside) nor calls so far."""
        return not self.calls and not self.content.strip()

    def _release(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        """`events` with each call held back until its `CallEnd`, then released, or dropped when it repeats a call
        (the reply stops there)."""
        out: list[ReplyEvent] = []
        for e in events:
            if self.stopped:
                break
            if not (isinstance(e, CallStart) or self._held):
                out.append(e)
                continue
            self._held.append(e)
            if isinstance(e, CallEnd):
                held, self._held = self._held, []
                if self.guard.admit(e.call):
                    out.extend(held)
                else:
                    self.stopped = True
        return out

    def _collect(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        for e in events:
            if isinstance(e, Content):
                self.text.append(e.text)
            elif isinstance(e, CallEnd):
                self.calls.append(e.call)
        return events

    @property
    def content(self) -> str:
        """The reply's text (not its calls)."""
        return "".join(self.text)


Sse = dict  # one server-sent event for sse-starlette: {"data": text} and optionally {"event": name}


class Writer(Protocol):
    """How one request's reply is written in its API's wire format: what a translator gives `app.respond`.

    A non-streamed answer is `body(reply)` once the reply is complete; a stream is `opening()`, then `events(e)` for
    each `ReplyEvent` (the `End` included), then `closing()`; `failure(error)` ends a stream that fails after it began
    (headers are sent by then, so the error travels in the stream, in the API's own shape).
    """

    def body(self, reply: ReplyStream) -> dict: ...

    def opening(self) -> list[Sse]: ...

    def events(self, event: ReplyEvent) -> list[Sse]: ...

    def closing(self) -> list[Sse]: ...

    def failure(self, error: ApiError) -> list[Sse]: ...
