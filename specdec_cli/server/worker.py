"""One worker thread serves the requests one at a time, in arrival order, from a bounded queue.

llama.cpp's context is not thread-safe, and one model pair cannot decode two sequences here anyway, so every
contact with the models (tokenizing included) happens on this thread. The HTTP side submits a `request.Request` (whatever
API it came in through: the worker never learns which) with a `deliver` callback and receives, in order: `Started` (the prompt fit and was evaluated), `Delta`s (output text, one
per target pass that added text), then `Done` (the request's `RequestStats`); or `Failed` (an exception for
`errors.to_api_error`) instead of any of them.

A request waits in the queue at most `bound` deep (beyond: `QueueFullError`, 429). `cancel` (the client went away)
drops a waiting request, or stops the running one at the next step: its `driver.Drive` is closed, so the engine's
`finally` leaves the KV cache holding only committed tokens. Every request that did not finish gets a last `Failed`
event, so a handler waiting on its events never waits forever. `stop` (Ctrl-C / SIGTERM) fails every waiting request
with `ShuttingDownError` and ends the running one after its current step.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specdec_cli.core.records import Finish, Prefill, Step
from specdec_cli.server.request import Request
from specdec_cli.server.errors import ClientGoneError, QueueFullError, ShuttingDownError, to_api_error
from specdec_cli.server.reply import PieceLogprob, RequestStats
from specdec_cli.server.service import GenerationService
from specdec_cli.core.stats import RunStats
from specdec_cli.spec import Method


@dataclass(frozen=True)
class Started:
    """The prompt fit and was evaluated (prefill done); generation is under way."""

    n_prompt: int


@dataclass(frozen=True)
class Delta:
    """Output text added by one target pass, and the log-probabilities of the tokens it emitted (when asked)."""

    text: str
    logprobs: tuple[PieceLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    """The generation finished; `stats.finish_reason` says why."""

    stats: RequestStats


@dataclass(frozen=True)
class Failed:
    """The request failed (before or during generation); map `error` with `errors.to_api_error`."""

    error: BaseException


Event = Started | Delta | Done | Failed


class Job:
    """A submitted request: its id (for the log), its delivery callback, and whether it was cancelled."""

    def __init__(self, job_id: int, request: Request, deliver: Callable[[Event], None]) -> None:
        self.id = job_id
        self.request = request
        self.deliver = deliver
        self.cancelled = threading.Event()


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
        self._thread = threading.Thread(target=self._run, name="specdec-serve-worker", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, deliver: Callable[[Event], None]) -> Job:
        """Queue `request`; its events go to `deliver` (called on the worker thread; it must not block).

        Raises: QueueFullError (the queue is at its bound), ShuttingDownError.
        """
        with self._cv:
            if self._stopping:
                raise ShuttingDownError()
            # while the worker is idle, the first waiting job is about to run: it does not count against the bound
            if len(self._pending) >= self.bound + (self._current is None):
                raise QueueFullError(self.bound)
            job = Job(next(self._ids), request, deliver)
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

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queued(self) -> int:
        """Requests waiting (not counting the running one)."""
        with self._cv:
            return len(self._pending)

    @property
    def busy(self) -> bool:
        """True while a request is being served."""
        with self._cv:
            return self._current is not None

    # -- the worker thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._current = self._pending.popleft()
            try:
                self._serve(job)
            except Exception as e:  # not expected (`_serve` catches); the thread must outlive it all the same
                _send(job, Failed(e))
            finally:
                with self._cv:
                    self._current = None

    def _serve(self, job: Job) -> None:
        """Generate one request, delivering its events; never raises (the server goes on whatever happens)."""
        request, service = job.request, self.service
        drive = None
        outcome = "ok"
        try:
            tokens = service.prompt_tokens(request)
            drive = service.stream(request, tokens)
            for record in drive:
                if drive.finish_reason is None and (job.cancelled.is_set() or self._stopping):
                    break  # closing the drive (finally) stops the engine before its next step
                if isinstance(record, Prefill):
                    _send(job, Started(len(tokens)))  # the prompt fit and was evaluated
                elif isinstance(record, Step) and (record.text or record.logprobs):
                    _send(job, Delta(record.text, service.pieces(record.logprobs)))
                elif isinstance(record, Finish):
                    # answer now; the drive goes on to its end, where the prompt cache is saved
                    _send(job, Done(RequestStats.of(drive)))
            if drive.finish_reason is None:
                if job.cancelled.is_set():
                    outcome = "cancelled (client gone)"
                    _send(job, Failed(ClientGoneError()))
                elif self._stopping:
                    outcome = "cut short (shutting down)"
                    _send(job, Failed(ShuttingDownError()))
                else:  # the engine ended without a finish reason (not expected): answer with what there is
                    _send(job, Done(RequestStats.of(drive)))
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
        self.log(log_line(job.id, request.label, stats, outcome, self.service.method))


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
