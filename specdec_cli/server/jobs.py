"""A submitted request as the worker holds it (`Job`): the events it delivers to the HTTP side, and its log line.

The HTTP side waits on a job's events, in order: `Started` (the prompt fit and was evaluated), `Delta`s (the reply's
events of each target pass that added text: parsed on the loop's thread by the job's `reply.ReplyStream`, so a reply
that must end early, a repeated tool call, stops its generation at once), then `Done`; or `Failed` instead of any.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec_cli.core.engine import Rows
from specdec_cli.core.records import Finish, Prefill, Step
from specdec_cli.core.stats import RunStats
from specdec_cli.driver import Drive
from specdec_cli.server.errors import ClientGoneError, DeadlineError, ShuttingDownError, internal, to_api_error
from specdec_cli.server.lanes import BATCH, INTERACTIVE, Priority
from specdec_cli.server.reply import End, ReplyEvent, ReplyStream, RequestStats
from specdec_cli.server.request import Request
from specdec_cli.spec import Method

if TYPE_CHECKING:
    from specdec_cli.server.service import GenerationService

OUTCOMES = {
    ClientGoneError: "cancelled (client gone)",
    ShuttingDownError: "cut short (shutting down)",
    DeadlineError: "stopped at its deadline (--timeout)",
}  # the log's word for each


@dataclass(frozen=True)
class Started:
    """The prompt fit and was evaluated (prefill done); generation is under way.

    Attributes:
        n_prompt: prompt tokens. n_cached: of them, those the KV cache or the prompt cache held (not evaluated).
    """

    n_prompt: int
    n_cached: int = 0


@dataclass(frozen=True)
class Delta:
    """The reply events of one target pass's output (`reply.ReplyStream.delta`: text, and tool calls as they
    complete), the step's log-probabilities riding on the first."""

    events: tuple[ReplyEvent, ...]


@dataclass(frozen=True)
class Done:
    """The reply ended: its last events, the `reply.End` last (its `stats.run.finish_reason` says why the engine
    stopped)."""

    events: tuple[ReplyEvent, ...]

    @property
    def end(self) -> End:
        last = self.events[-1]
        assert isinstance(last, End)
        return last


@dataclass(frozen=True)
class Failed:
    """The request failed (before or during generation); map `error` with `errors.to_api_error`."""

    error: BaseException


Event = Started | Delta | Done | Failed


class Job:
    """A submitted request: its id (for the log), its delivery callback, its reply (parsed and collected on the
    loop's thread; read it after `Done`), and whether it was cancelled."""

    def __init__(
        self,
        job_id: int,
        request: Request,
        deliver: Callable[[Event], None],
        reply: ReplyStream | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.id = job_id
        self.clock = clock  # seconds, monotonic: the worker's (`Worker.clock`)
        self.request = request
        self.deliver = deliver
        self.reply = reply
        self.cancelled = threading.Event()
        self.submitted_at = clock()
        self.started_at: float | None = None  # clock() when the worker took it
        self.cancelled_at: float | None = None  # clock() when its client went away
        self.tokens = 0  # output tokens so far
        self.prompt: list[int] | None = None  # its prompt tokens, once a lane has computed them
        self.lane: int | None = None  # the lane it must run on (the one sharing its prompt's longest prefix)
        self.chunk_ends: list[float] = []  # clock() at each of its prefill's chunks' ends (`Worker._check`)
        deadline = self.submitted_at + request.deadline_ms / 1e3 if request.deadline_ms is not None else math.inf
        # its place in line, in the queue and in the scheduler's passes: interactive requests first, then the earliest
        # deadline, arrival; an editor's (a completion, one with a deadline) keeps prefill chunks short: its next comes
        editor = request.fim is not None or request.deadline_ms is not None
        self.priority = Priority(INTERACTIVE if request.interactive else BATCH, deadline, job_id, editor=editor)

    def send(self, event: Event) -> None:
        """Deliver `event`; a receiving side that is gone (its event loop closed at shutdown) is nothing to tell."""
        try:
            self.deliver(event)
        except Exception:
            pass

    def run(
        self, service: GenerationService, lane: int, stopped: Callable[[], Exception | None]
    ) -> Generator[Rows, Any, str]:
        """Generate this request on slot `lane` as the scheduler's program: yield each pass's rows, deliver its events,
        and return its log line; never raises (the server goes on whatever happens). `stopped()`: why it must stop now,
        or None.

        A reply that stops before a repeated tool call (`reply.ReplyStream.stopped`) ends there: its generation is
        stopped; when it said nothing yet, the request is generated once more without tool calls
        (`GenerationService.without_calls`: same prompt, so the KV cache holds all of it but its last token)."""
        request, reply = self.request, self.reply
        assert reply is not None  # (given at `Worker.submit`)
        drive = None
        outcome, note = "ok", ""
        try:
            tokens = self.prompt or service.prompt_tokens(request)  # tokenized when it was placed, or now
            drive = service.stream(request, tokens, lane=lane, rows=True)
            ended = yield from self.follow(drive, len(tokens), stopped, service.pieces)
            if not ended and reply.stopped and reply.empty:
                note = " (a repeated tool call dropped: generated again without tools)"
                drive.close()
                request = service.without_calls(request)
                reply.restart(service.parser(request))
                drive = service.stream(request, tokens, lane=lane, rows=True)
                ended = yield from self.follow(drive, None, stopped, service.pieces)
            elif not ended and reply.stopped:
                note = " (ended before a repeated tool call)"
                self.send(Done(tuple(reply.done(RequestStats.of(drive)))))
                ended = True
            if not ended:
                error = stopped()
                if error is not None:
                    raise error
                # the engine ended without a finish reason (not expected): answer with what there is
                self.send(Done(tuple(reply.done(RequestStats.of(drive)))))
        except (ClientGoneError, ShuttingDownError, DeadlineError) as e:  # between steps or prefill chunks
            outcome = OUTCOMES[type(e)]
            self.send(Failed(e))
        except Exception as e:  # a domain error (400) or a bug (500): reported to the client, the server goes on
            api = to_api_error(e)
            outcome = f"error {api.status}: {internal(e)}"
            if api.status >= 500 and os.environ.get("SPECDEC_DEBUG", "") not in ("", "0"):
                import traceback

                traceback.print_exc()
            self.send(Failed(e))
        finally:
            if drive is not None:
                drive.close()  # the engine's finally: the KV cache keeps only committed tokens
        stats = RequestStats.of(drive) if drive is not None else RequestStats(RunStats())
        if reply.stopped and reply.end is not None:  # stopped here, not by the engine: the reply's own finish
            stats = reply.end.stats
        return self.log_line(stats, outcome, service.method, note)

    def follow(
        self, drive: Drive, n_prompt: int | None, stopped: Callable[[], Exception | None], pieces: Callable[[Any], Any]
    ) -> Generator[Rows, Any, bool]:
        """Deliver one generation's events, yielding its rows: `Started` after its prefill (unless `n_prompt` is None:
        a second generation), a `Delta` per step (`pieces`: `GenerationService.pieces` of its log-probabilities),
        `Done` at its `Finish`. Returns True when the reply ended (`Done` sent); False when `stopped()` gives a reason
        (client gone, shutting down, deadline) or the reply stopped before a repeated call."""
        reply, ended = self.reply, False
        assert reply is not None  # (the worker gives every job its reply)
        records, answer = iter(drive), None
        while True:
            try:
                record = records.send(answer)
            except StopIteration:
                return ended
            answer = None
            if isinstance(record, Rows):
                answer = yield record
                continue
            if drive.finish_reason is None and stopped() is not None:
                return False  # closing the drive (finally) stops the engine before its next step
            if isinstance(record, Prefill):
                if n_prompt is not None:  # the prompt fit and was evaluated
                    self.send(Started(n_prompt, max(record.n_prompt - 1 - record.n_evaluated, 0)))
            elif isinstance(record, Step):
                self.tokens += len(record.emitted)
                if not (record.text or record.logprobs):
                    continue
                events = reply.delta(record.text, pieces(record.logprobs))
                if events:
                    self.send(Delta(tuple(events)))
                if reply.stopped:
                    return False
            elif isinstance(record, Finish):
                # answer now; the drive goes on to its end, where the prompt cache is saved
                self.send(Done(tuple(reply.done(RequestStats.of(drive)))))
                ended = True

    def log_line(self, stats: RequestStats, outcome: str, method: str, note: str = "") -> str:
        """One line per request: prompt (cached), tokens, tok/s, acceptance by source, tokens per pass, finish (or
        `outcome`), `note`, how long it stopped after its client left, and its time queued."""
        r = stats.run
        parts = [
            f"#{self.id} {self.request.label}: {r.n_prompt} prompt tokens ({r.n_cached} cached)",
            f"{r.n_generated} tokens in {stats.wall_ms / 1e3:.2f} s",
            f"{r.tokens_per_s:.1f} tok/s",
        ]
        if method != Method.none:
            by_source = ", ".join(f"{src} {v['accepted']}/{v['drafted']}" for src, v in sorted(r.by_source.items()))
            parts.append(f"acceptance {r.acceptance_rate:.0%}" + (f" ({by_source})" if by_source else ""))
            parts.append(f"{r.tokens_per_pass:.2f} tok/pass")
        parts.append(f"finish {r.finish_reason}" if outcome == "ok" else outcome)
        if self.cancelled_at is not None and outcome == OUTCOMES[ClientGoneError]:  # the worker's time after it
            note += f" (stopped {max(0.0, self.clock() - self.cancelled_at):.2f} s after the client left" + (
                f"; its prefill's chunks took {max(chunks):.2f} s at most)" if (chunks := self._chunk_s()) else ")"
            )
        if self.started_at is not None:
            note += f"; queued {self.started_at - self.submitted_at:.2f} s"
        return ", ".join(parts) + note

    def _chunk_s(self) -> list[float]:
        """Seconds each of its prefill's chunks took, the first from when the worker took it (tokenizing included)."""
        if self.started_at is None or not self.chunk_ends:
            return []
        ends = [self.started_at, *self.chunk_ends]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]
