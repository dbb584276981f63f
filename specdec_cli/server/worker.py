"""One worker thread serves the requests one at a time, in arrival order, from a bounded queue.

llama.cpp's context is not thread-safe, and one model pair cannot decode two sequences here anyway, so every
contact with the models (tokenizing included) happens on this thread. The HTTP side submits a `request.Request`
(whatever API it came in through: the worker never learns which) with a `deliver` callback and receives, in order:
`Started` (the prompt fit and was evaluated), `Delta`s (the reply's events of each target pass that added text: the
output is parsed here, by the job's `reply.ReplyStream`, so a reply that must end early — a repeated tool call —
stops its generation at once), then `Done` (the last events, `End` with the request's `RequestStats`); or `Failed`
(an exception for `errors.to_api_error`) instead of any of them.

A request waits in the queue at most `bound` deep (beyond: `QueueFullError`, 429 with `Retry-After`: the requests ahead
times the mean time of the recent ones, less the running one's age). `status` is the queue as `/health` shows it. `cancel` (the client went away)
drops a waiting request, or stops the running one at the next step: its `driver.Drive` is closed, so the engine's
`finally` leaves the KV cache holding only committed tokens. Every request that did not finish gets a last `Failed`
event, so a handler waiting on its events never waits forever. `stop` (Ctrl-C / SIGTERM) fails every waiting request
with `ShuttingDownError` and ends the running one after its current step.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from specdec_cli.core.records import Finish, Prefill, Step
from specdec_cli.server.request import Request
from specdec_cli.server.errors import ClientGoneError, QueueFullError, ShuttingDownError, to_api_error
from specdec_cli.driver import Drive
from specdec_cli.server.reply import End, ReplyEvent, ReplyStream, RequestStats
from specdec_cli.server.service import GenerationService
from specdec_cli.core.stats import RunStats
from specdec_cli.spec import Method

T = TypeVar("T")


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
    worker thread; read it after `Done`), and whether it was cancelled; or a task (`Worker.run`): a function of the
    service, run in turn, whose result goes to a future (no request, no reply)."""

    def __init__(self, job_id: int, request: Request | None, deliver: Callable[[Event], None],
                 reply: ReplyStream | None = None, task: Callable[[GenerationService], Any] | None = None) -> None:
        self.id = job_id
        self.request = request
        self.deliver = deliver
        self.reply = reply
        self.task = task
        self.result: Future = Future()
        self.cancelled = threading.Event()
        self.started_at: float | None = None  # time.monotonic() when the worker took it
        self.tokens = 0  # output tokens so far


FIRST_GUESS_S = 10.0  # a request's wall time before any was served (Retry-After's first estimate), seconds
MEAN_WEIGHT = 0.3  # weight of the latest request in the moving mean of wall times


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Worker:
    """The serving thread and its queue.

    Args:
        service: the models and engine (used on this thread only).
        bound: requests that may wait behind the running one (0 = none; a request arriving while one runs gets 429).
        log: one line per request (default: stderr).
    """

    def __init__(self, service: GenerationService, *, bound: int = 16, log: Callable[[str], None] = _stderr) -> None:
        self.service = service
        self.bound = bound
        self.log = log
        self._cv = threading.Condition()
        self._pending: deque[Job] = deque()
        self._current: Job | None = None
        self._stopping = False
        self._ids = itertools.count(1)
        self._mean_s = FIRST_GUESS_S  # a request's mean wall time (exponential moving average), for Retry-After
        self._thread = threading.Thread(target=self._run, name="specdec-serve-worker", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, deliver: Callable[[Event], None]) -> Job:
        """Queue `request`; its events go to `deliver` (called on the worker thread; it must not block).

        Raises: QueueFullError (the queue is at its bound), ShuttingDownError.
        """
        return self._queue(request, deliver)

    def run(self, task: Callable[[GenerationService], T]) -> Future[T]:
        """Queue `task(service)` to run on this thread in turn (what touches the models without generating, e.g.
        tokenizing a prompt to count it: llama.cpp's context must not be used by two threads at once).

        Returns a `concurrent.futures.Future` with the task's result or exception (await it with
        `asyncio.wrap_future`); a task dropped at shutdown fails with ShuttingDownError.
        Raises: QueueFullError, ShuttingDownError.
        """
        return self._queue(None, lambda event: None, task).result

    def _queue(self, request: Request | None, deliver: Callable[[Event], None],
               task: Callable[[GenerationService], Any] | None = None) -> Job:
        with self._cv:
            if self._stopping:
                raise ShuttingDownError()
            # while the worker is idle, the first waiting job is about to run: it does not count against the bound
            if len(self._pending) >= self.bound + (self._current is None):
                raise QueueFullError(self.bound, self._retry_after())
            reply = self.service.reply(request) if request is not None else None
            job = Job(next(self._ids), request, deliver, reply, task)
            self._pending.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop `job` if it is waiting, else stop it at its next step; either way its last
        event is `Failed(ClientGoneError())` (none if it had finished). Idempotent."""
        with self._cv:
            job.cancelled.set()
            try:
                self._pending.remove(job)
            except ValueError:
                return
        _send(job, Failed(ClientGoneError()))

    def stop(self) -> None:
        """Stop serving: waiting requests fail with ShuttingDownError, the running one ends after its current step."""
        with self._cv:
            self._stopping = True
            waiting = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for job in waiting:
            _send(job, Failed(ShuttingDownError()))
            if job.task is not None:
                job.result.set_exception(ShuttingDownError())

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def ahead(self, job: Job) -> int:
        """Requests `job` waits for (the running one and those queued before it); 0 once it runs or if it will be
        taken next by an idle worker."""
        with self._cv:
            try:
                index = self._pending.index(job)
            except ValueError:
                return 0
            return index + (self._current is not None)

    def status(self) -> dict:
        """The queue as `/health` shows it: {"waiting": requests queued, "bound": `--queue`, "running": {"id",
        "kind", "age_s" (seconds since it was taken), "tokens" (output so far)} or None, "retry_after_s": the
        Retry-After a request refused now would get}."""
        with self._cv:
            job = self._current
            running = None if job is None or job.started_at is None else {
                "id": job.id, "kind": job.request.label if job.request is not None else "task", "age_s": round(time.monotonic() - job.started_at, 2),
                "tokens": job.tokens}
            return {"waiting": len(self._pending), "bound": self.bound, "running": running,
                    "retry_after_s": self._retry_after()}

    def _retry_after(self) -> int:
        """Whole seconds until a queue place is likely free (>= 1): the waiting requests and the running one, each
        the mean time of recent requests, less the running one's age (lock held)."""
        age = time.monotonic() - self._current.started_at if self._current and self._current.started_at else 0.0
        return max(1, math.ceil(self._mean_s * (len(self._pending) + (self._current is not None)) - age))

    # -- the worker thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._current = self._pending.popleft()
                job.started_at = time.monotonic()
            try:
                if job.task is not None:
                    _run_task(job, self.service)
                else:
                    self._serve(job)
            except Exception as e:  # not expected (`_serve` catches); the thread must outlive it all the same
                _send(job, Failed(e))
            finally:
                with self._cv:
                    self._current = None
                    if job.task is None:  # a request's wall time (a task's, e.g. count_tokens, is no guide)
                        took = time.monotonic() - job.started_at
                        self._mean_s = (1 - MEAN_WEIGHT) * self._mean_s + MEAN_WEIGHT * took

    def _serve(self, job: Job) -> None:
        """Generate one request, delivering its events; never raises (the server goes on whatever happens).

        A reply that stops before a repeated tool call (`reply.ReplyStream.stopped`) ends there: its generation is
        stopped; when it said nothing yet, the request is generated once more without tool calls
        (`GenerationService.without_calls`: same prompt, so the KV cache holds all of it but its last token)."""
        request, service, reply = job.request, self.service, job.reply
        drive = None
        outcome, note = "ok", ""
        try:
            tokens = service.prompt_tokens(request)
            drive = service.stream(request, tokens)
            ended = self._follow(job, drive, len(tokens))
            if not ended and reply.stopped and reply.empty:
                note = " (a repeated tool call dropped: generated again without tools)"
                drive.close()
                request = service.without_calls(request)
                reply.restart(service.parser(request))
                drive = service.stream(request, tokens)
                ended = self._follow(job, drive, None)
            elif not ended and reply.stopped:
                note = " (ended before a repeated tool call)"
                _send(job, Done(tuple(reply.done(RequestStats.of(drive)))))
                ended = True
            if not ended:
                if job.cancelled.is_set():
                    outcome = "cancelled (client gone)"
                    _send(job, Failed(ClientGoneError()))
                elif self._stopping:
                    outcome = "cut short (shutting down)"
                    _send(job, Failed(ShuttingDownError()))
                else:  # the engine ended without a finish reason (not expected): answer with what there is
                    _send(job, Done(tuple(reply.done(RequestStats.of(drive)))))
        except Exception as e:  # a domain error (400) or a bug (500): reported to the client, the server goes on
            api = to_api_error(e)
            outcome = f"error {api.status}: {api.message}"
            if api.status >= 500 and os.environ.get("SPECDEC_DEBUG", "") not in ("", "0"):
                import traceback

                traceback.print_exc()
            _send(job, Failed(e))
        finally:
            if drive is not None:
                drive.close()  # the engine's finally: the KV cache keeps only committed tokens
        stats = RequestStats.of(drive) if drive is not None else RequestStats(RunStats())
        if reply.stopped and reply.end is not None:  # stopped here, not by the engine: the reply's own finish
            stats = reply.end.stats
        self.log(log_line(job.id, request.label, stats, outcome, self.service.method) + note)

    def _follow(self, job: Job, drive: Drive, n_prompt: int | None) -> bool:
        """Deliver one generation's events: `Started` after its prefill (unless `n_prompt` is None: a second
        generation), a `Delta` per step, `Done` at its `Finish`. Returns True when the reply ended (`Done` sent);
        False when the client went away, the server is stopping, or the reply stopped before a repeated call."""
        reply, ended = job.reply, False
        for record in drive:
            if drive.finish_reason is None and (job.cancelled.is_set() or self._stopping):
                return False  # closing the drive (finally) stops the engine before its next step
            if isinstance(record, Prefill):
                if n_prompt is not None:  # the prompt fit and was evaluated
                    _send(job, Started(n_prompt, max(record.n_prompt - 1 - record.n_evaluated, 0)))
            elif isinstance(record, Step):
                job.tokens += len(record.emitted)
                if not (record.text or record.logprobs):
                    continue
                events = reply.delta(record.text, self.service.pieces(record.logprobs))
                if events:
                    _send(job, Delta(tuple(events)))
                if reply.stopped:
                    return False
            elif isinstance(record, Finish):
                # answer now; the drive goes on to its end, where the prompt cache is saved
                _send(job, Done(tuple(reply.done(RequestStats.of(drive)))))
                ended = True
        return ended


def _run_task(job: Job, service: GenerationService) -> None:
    """Run a `Worker.run` task; its result or exception goes to its future."""
    try:
        job.result.set_result(job.task(service))
    except Exception as e:
        job.result.set_exception(e)


def _send(job: Job, event: Event) -> None:
    try:
        job.deliver(event)
    except Exception:  # the receiving side is gone (event loop closed at shutdown): nothing to tell
        pass


def log_line(job_id: int, kind: str, stats: RequestStats, outcome: str, method: str) -> str:
    """One line per request: prompt (cached), tokens, tok/s, acceptance by source, tokens per pass, finish."""
    r = stats.run
    parts = [f"#{job_id} {kind}: {r.n_prompt} prompt tokens ({r.n_cached} cached)",
             f"{r.n_generated} tokens in {stats.wall_ms / 1e3:.2f} s", f"{r.tokens_per_s:.1f} tok/s"]
    if method != Method.none:
        by_source = ", ".join(f"{src} {v['accepted']}/{v['drafted']}" for src, v in sorted(r.by_source.items()))
        parts.append(f"acceptance {r.acceptance_rate:.0%}" + (f" ({by_source})" if by_source else ""))
        parts.append(f"{r.tokens_per_pass:.2f} tok/pass")
    parts.append(f"finish {r.finish_reason}" if outcome == "ok" else outcome)
    return ", ".join(parts)
