"""The serving loop: one thread owns the model and serves every request from one bounded queue.

The thread (`Worker._loop`) repeats: take waiting requests onto free slots (`server.lanes`, `specdec serve --parallel
N`: N sequences at once; one slot serves one request at a time) — interactive requests (FIM, warm-ups, short replies:
`Request.interactive`) before long ones, earlier deadlines first, then arrival — each on the free slot whose KV cache
(or parked state) shares the longest prefix with its prompt, as llama-server picks a slot; save what was learnt
when a save is due; then one `lanes.Scheduler.step` (every sequence's rows in one `llama_decode`). A request on a slot
is a program (`_generate`): it drives its `driver.Drive` (the engine's steps), yields the rows of each pass to the
scheduler, and delivers, in order: `Started` (the prompt fit and was evaluated), `Delta`s (the reply's events of each
target pass that added text: parsed here, by the job's `reply.ReplyStream`, so a reply that must end early — a
repeated tool call — stops its generation at once), then `Done` (the last events, `End` with the request's
`RequestStats`); or `Failed` (an exception for `errors.to_api_error`) instead of any of them. The HTTP side submits a
`request.Request` (whatever API it came in through: the worker never learns which) with a `deliver` callback.

A request waits in the queue at most `bound` deep (beyond: `QueueFullError`, 429 with `Retry-After`: the requests ahead
times the mean time of the recent ones, less the running one's age). `status` is the queue as `/health` shows it.
`cancel` (the client went away) drops a waiting request, or stops the running one at its next step or prefill chunk: its
`driver.Drive` is closed, so the engine's `finally` leaves the KV cache holding only committed tokens. Every request
that did not finish gets a last `Failed` event, so a handler waiting on its events never waits forever. `stop` (Ctrl-C
/ SIGTERM) fails every waiting request with `ShuttingDownError` and ends the running ones after their current step.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from specdec_cli.core.engine import Rows
from specdec_cli.core.records import Finish, Prefill, Step
from specdec_cli.core.stats import RunStats
from specdec_cli.driver import Drive
from specdec_cli.models.backend import common_prefix
from specdec_cli.server.errors import (
    ClientGoneError,
    DeadlineError,
    QueueFullError,
    ShuttingDownError,
    internal,
    to_api_error,
)
from specdec_cli.server.lanes import BATCH, INTERACTIVE, Priority
from specdec_cli.server.reply import End, ReplyEvent, ReplyStream, RequestStats
from specdec_cli.server.request import Request
from specdec_cli.server.service import GenerationService
from specdec_cli.spec import Method


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
        self, job_id: int, request: Request, deliver: Callable[[Event], None], reply: ReplyStream | None = None
    ) -> None:
        self.id = job_id
        self.request = request
        self.deliver = deliver
        self.reply = reply
        self.cancelled = threading.Event()
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None  # time.monotonic() when the worker took it
        self.cancelled_at: float | None = None  # time.monotonic() when its client went away
        self.tokens = 0  # output tokens so far
        self.prompt: list[int] | None = None  # its prompt tokens, once a lane has computed them
        self.lane: int | None = None  # the lane it must run on (the one sharing its prompt's longest prefix)
        self.chunk_ends: list[float] = []  # time.monotonic() at each of its prefill's chunks' ends (`Worker._check`)


OUTCOMES = {
    ClientGoneError: "cancelled (client gone)",
    ShuttingDownError: "cut short (shutting down)",
    DeadlineError: "stopped at its deadline (--timeout)",
}  # the log's word for each
FIRST_GUESS_S = 10.0  # a request's wall time before any was served (Retry-After's first estimate), seconds
MEAN_WEIGHT = 0.3  # weight of the latest request in the moving mean of wall times
PLACE_MARGIN = 32  # tokens of prefix another idle lane must share beyond the taking lane's to be handed a request
WAIT_MARGIN = 256  # tokens of prefix a finishing interactive lane must share beyond every idle lane's to be waited for


def _rank(job: Job) -> tuple:
    """A waiting job's place in line: interactive requests first, then the earliest deadline, arrival."""
    request = job.request
    deadline = job.submitted_at + request.deadline_ms / 1e3 if request.deadline_ms is not None else math.inf
    return (INTERACTIVE if request.interactive else BATCH, deadline, job.id)


def _priority(job: Job) -> Priority:
    """A request's place in the scheduler's passes; an editor's request (a completion, one with a deadline) keeps
    prefill chunks short, since its next one comes soon."""
    request = job.request
    cls, deadline, seq = _rank(job)
    return Priority(cls, deadline, seq, editor=request.fim is not None or request.deadline_ms is not None)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Worker:
    """The serving loop's thread, its slots (`GenerationService.lanes`) and their queue.

    Args:
        service: the models, engines and scheduler (`GenerationService.scheduler`), used from the loop's thread only.
        bound: requests that may wait while every slot is busy (0 = none: a request arriving then gets 429).
        log: one line per request (default: stderr).
        timeout: seconds a request may hold a slot (`--timeout`); None: no deadline.
        saver: the learnt state's periodic save, run between steps and when idle.
    """

    def __init__(
        self,
        service: GenerationService,
        *,
        bound: int = 16,
        log: Callable[[str], None] = _stderr,
        timeout: float | None = None,
        saver: Saver | None = None,
    ) -> None:
        self.service = service
        self.bound = bound
        self.log = log
        self.timeout = timeout
        self.saver = saver
        self.n_lanes = getattr(service, "lanes", 1)
        self.scheduler = getattr(service, "scheduler", None)
        self._cv = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # slot -> the job it serves
        self._used = [0.0] * self.n_lanes  # time.monotonic() each slot last finished a job (least recently used)
        self._stopping = False
        self._save_due = False  # a request's end made a save due: saved before the next step
        self._ids = itertools.count(1)
        self._mean_s = FIRST_GUESS_S  # a request's mean wall time (exponential moving average), for Retry-After
        self._thread = threading.Thread(target=self._loop, name="specdec-serve-worker", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, deliver: Callable[[Event], None]) -> Job:
        """Queue `request`; its events go to `deliver` (called on the loop's thread; it must not block).

        Raises: QueueFullError (the queue is at its bound), ShuttingDownError.
        """
        return self._queue(request, deliver)

    def _queue(self, request: Request, deliver: Callable[[Event], None]) -> Job:
        with self._cv:
            if self._stopping:
                raise ShuttingDownError()
            # jobs that idle lanes are about to take do not count against the bound
            if len(self._pending) >= self.bound + (self.n_lanes - len(self._running)):
                raise QueueFullError(self.bound, self._retry_after())
            job = Job(next(self._ids), request, deliver, self.service.reply(request))
            self._pending.append(job)
            free = len(self._running) < self.n_lanes
            self._cv.notify_all()
        if free and self.scheduler is not None:  # it may stop a long request's pass under way
            self.scheduler.preempt(_priority(job))
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop `job` if it is waiting, else stop it at its next step; either way its last
        event is `Failed(ClientGoneError())` (none if it had finished). Idempotent."""
        with self._cv:
            if job.cancelled_at is None:
                job.cancelled_at = time.monotonic()
            job.cancelled.set()
            try:
                self._pending.remove(job)
            except ValueError:
                return
        _send(job, Failed(ClientGoneError()))

    def stop(self) -> None:
        """Stop serving: waiting requests fail with ShuttingDownError, the running ones end after their current
        step."""
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
    def alive(self) -> bool:
        """True while the loop runs (after `stop`: until its requests' current chunk or step ends)."""
        return self._thread.is_alive()

    def ahead(self, job: Job) -> int:
        """Requests `job` waits for (those running and those queued before it, beyond the free lanes); 0 once it
        runs or if an idle lane will take it next."""
        with self._cv:
            try:
                index = self._pending.index(job)
            except ValueError:
                return 0
            return max(0, index + len(self._running) - (self.n_lanes - 1))

    def status(self) -> dict:
        """The queue as `/health` shows it: {"waiting": requests queued, "bound": `--queue`, "lanes": N, "running":
        the first lane's {"id", "kind", "age_s" (seconds since it was taken), "tokens" (output so far), "lane"} or
        None, "busy": [the same for every running request], "retry_after_s": the Retry-After a request refused now
        would get}."""
        with self._cv:
            busy = [
                {
                    "id": job.id,
                    "kind": job.request.label,
                    "age_s": round(time.monotonic() - job.started_at, 2),
                    "tokens": job.tokens,
                    "lane": lane,
                }
                for lane, job in sorted(self._running.items())
                if job.started_at is not None
            ]
            return {
                "waiting": len(self._pending),
                "bound": self.bound,
                "lanes": self.n_lanes,
                "running": busy[0] if busy else None,
                "busy": busy,
                "retry_after_s": self._retry_after(),
            }

    def _retry_after(self) -> int:
        """Whole seconds until a queue place is likely free (>= 1): the waiting requests and the running ones, each
        the mean time of recent requests, over the lanes, less the oldest running one's age (lock held)."""
        now = time.monotonic()
        age = max((now - j.started_at for j in self._running.values() if j.started_at), default=0.0)
        work = self._mean_s * (len(self._pending) + len(self._running)) / self.n_lanes
        return max(1, math.ceil(work - age))

    # -- the loop --------------------------------------------------------------------------------------------------
    def _place(self, lane: int, job: Job) -> int:
        """The lane `job` should run on (lock held): the lane whose KV cache or parked states share the longest prefix
        with its prompt, among the idle lanes (`lane` included) and the lanes finishing an interactive request (an
        editor's next completion arrives as its previous one ends: it waits for that lane rather than evaluate its
        prompt again on another); where no idle lane shares more than `PLACE_MARGIN` tokens beyond the others, the
        least recently used of them (an agent's new request taken by the editor's lane as it finished would evict
        the editor's cached prefix and make its next completion queue for the agent's whole turn)."""
        if self.n_lanes == 1 or job.prompt is None:
            return lane
        prompt = np.asarray(job.prompt, dtype=np.int32)
        idle = [
            i
            for i in range(self.n_lanes)
            if i not in self._running or (self._running[i].request is not None and self._running[i].request.interactive)
        ]

        def shared(i: int) -> int:
            return max((common_prefix(held, prompt) for held in self.service.lane_tokens(i)), default=0)

        scores = {i: shared(i) for i in idle}
        best = max(idle, key=lambda i: (scores[i], -self._used[i]))
        if (
            best in self._running
            and scores[best] <= max(scores.get(i, 0) for i in idle if i not in self._running) + WAIT_MARGIN
        ):
            idle = [i for i in idle if i not in self._running]  # not worth waiting for: the best idle lane
            best = max(idle, key=lambda i: (scores[i], -self._used[i]))
        if best in self._running:
            return best
        # no lane holds much more of it: the least recently used of those near the best, which keeps the caches of the
        # lanes used last for their clients' next requests (the lane that took it is a handover's worth ahead)
        near = [i for i in idle if i not in self._running and scores[i] + PLACE_MARGIN >= scores[best]]
        lru = min(near, key=lambda i: (self._used[i], -scores[i]))
        return lane if lane in near and self._used[lane] <= self._used[lru] else lru

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopping and not self._running:
                        return
                    self._admit()
                    if self._running or self._save_due:
                        break
                    due = self.saver.due_in() if self.saver is not None else None
                    if due is not None and due <= 0:
                        self._save_due = True  # idle, and what the last requests taught is due on disk: save it now
                        break
                    self._cv.wait(due)
            if self._save_due:
                self._save_due = False
                self._save()
            if self._running:
                try:
                    self.scheduler.step()
                except Exception as e:  # not expected (the programs catch); the loop must outlive it all the same
                    self.log(f"the serving loop: {type(e).__name__}: {e}")

    def _admit(self) -> None:
        """Start waiting requests on free slots (lock held): one handed to a slot first, else the first waiting one
        (interactive, earliest deadline, arrival) on the slot `_place` picks, or held for a finishing slot."""
        while len(self._running) < self.n_lanes and self._pending:
            free = [i for i in range(self.n_lanes) if i not in self._running]
            job = next((j for j in self._pending if j.lane in free), None)
            if job is None:
                waiting = [j for j in self._pending if j.lane is None]
                if not waiting:
                    break
                job = min(waiting, key=_rank)
                if job.prompt is None:
                    job.prompt = (
                        list(job.request.prompt_ids) if job.request.prompt_ids is not None else self._tokens(job)
                    )
                job.lane = self._place(min(free, key=lambda i: self._used[i]), job)
                if job.lane in self._running:  # held for the finishing slot that holds its prefix
                    continue
            assert job.lane is not None  # (placed above, or handed to a slot before)
            self._pending.remove(job)
            self._running[job.lane] = job
            job.started_at = time.monotonic()
            self._start(job, job.lane)

    def _tokens(self, job: Job) -> list[int]:
        try:
            return self.service.prompt_tokens(job.request)
        except Exception:  # noqa: BLE001 (its program reports it: `_generate` tokenizes again)
            return []

    def _start(self, job: Job, lane: int) -> None:
        slot = self.scheduler.slots[lane]
        self.scheduler.start(slot, self._generate(job, lane), _priority(job), check=partial(self._check, job))

    def _save(self) -> None:
        """Run the `Saver` between two steps (nothing mutates the stores meanwhile)."""
        try:
            if self.saver is not None and self.saver.due_in() == 0:
                self.saver.save_now()
        except Exception as e:  # a failed save must not stop the loop
            self.log(f"saving what was learnt: {type(e).__name__}: {e}")

    def _end(self, job: Job, lane: int) -> None:
        """`job` left its slot: free it and count the request for Retry-After and the saver."""
        with self._cv:
            self._running.pop(lane, None)
            self._used[lane] = time.monotonic()
            took = time.monotonic() - job.started_at
            self._mean_s = (1 - MEAN_WEIGHT) * self._mean_s + MEAN_WEIGHT * took
            if self.saver is not None and self.saver.note():
                self._save_due = True
            self._cv.notify_all()

    def _generate(self, job: Job, lane: int) -> Generator[Rows, Any, None]:
        """One request's program on slot `lane` (`lanes.Scheduler.start`): yields each pass's rows, delivers its events;
        never raises (the server goes on whatever happens).

        A reply that stops before a repeated tool call (`reply.ReplyStream.stopped`) ends there: its generation is
        stopped; when it said nothing yet, the request is generated once more without tool calls
        (`GenerationService.without_calls`: same prompt, so the KV cache holds all of it but its last token)."""
        request, service, reply = job.request, self.service, job.reply
        drive = None
        outcome, note = "ok", ""
        try:
            tokens = job.prompt or service.prompt_tokens(request)  # tokenized when it was placed, or now
            drive = service.stream(request, tokens, lane=lane, rows=True)
            ended = yield from self._follow(job, drive, len(tokens))
            if not ended and reply.stopped and reply.empty:
                note = " (a repeated tool call dropped: generated again without tools)"
                drive.close()
                request = service.without_calls(request)
                reply.restart(service.parser(request))
                drive = service.stream(request, tokens, lane=lane, rows=True)
                ended = yield from self._follow(job, drive, None)
            elif not ended and reply.stopped:
                note = " (ended before a repeated tool call)"
                _send(job, Done(tuple(reply.done(RequestStats.of(drive)))))
                ended = True
            if not ended:
                stopped = self._stopped(job)
                if stopped is not None:
                    raise stopped
                # the engine ended without a finish reason (not expected): answer with what there is
                _send(job, Done(tuple(reply.done(RequestStats.of(drive)))))
        except (ClientGoneError, ShuttingDownError, DeadlineError) as e:  # between steps or prefill chunks
            outcome = OUTCOMES[type(e)]
            _send(job, Failed(e))
        except Exception as e:  # a domain error (400) or a bug (500): reported to the client, the server goes on
            api = to_api_error(e)
            outcome = f"error {api.status}: {internal(e)}"
            if api.status >= 500 and os.environ.get("SPECDEC_DEBUG", "") not in ("", "0"):
                import traceback

                traceback.print_exc()
            _send(job, Failed(e))
        finally:
            if drive is not None:
                drive.close()  # the engine's finally: the KV cache keeps only committed tokens
            self._end(job, lane)
        stats = RequestStats.of(drive) if drive is not None else RequestStats(RunStats())
        if reply.stopped and reply.end is not None:  # stopped here, not by the engine: the reply's own finish
            stats = reply.end.stats
        if job.cancelled_at is not None and outcome == OUTCOMES[ClientGoneError]:  # the worker's time after it
            note += f" (stopped {max(0.0, time.monotonic() - job.cancelled_at):.2f} s after the client left" + (
                f"; its prefill's chunks took {max(chunks):.2f} s at most)" if (chunks := _chunk_s(job)) else ")"
            )
        note += f"; queued {job.started_at - job.submitted_at:.2f} s"
        if self.n_lanes > 1:
            note += f"; lane {lane}"
        self.log(log_line(job.id, request.label, stats, outcome, self.service.method) + note)

    def _stopped(self, job: Job) -> Exception | None:
        """Why `job` must stop now, or None: its client went away, the server is stopping, or its deadline
        (`timeout` seconds after the worker took it) passed."""
        if job.cancelled.is_set():
            return ClientGoneError()
        if self._stopping:
            return ShuttingDownError()
        if self.timeout is not None and job.started_at is not None and time.monotonic() - job.started_at > self.timeout:
            return DeadlineError(self.timeout)
        return None

    def _check(self, job: Job) -> None:
        """Raise `_stopped(job)` if there is a reason: called between the prefill's chunks (`Scheduler.step`)."""
        job.chunk_ends.append(time.monotonic())
        stopped = self._stopped(job)
        if stopped is not None:
            raise stopped

    def _follow(self, job: Job, drive: Drive, n_prompt: int | None) -> Generator[Rows, Any, bool]:
        """Deliver one generation's events, yielding its rows: `Started` after its prefill (unless `n_prompt` is None:
        a second generation), a `Delta` per step, `Done` at its `Finish`. Returns True when the reply ended (`Done`
        sent); False when the client went away, the server is stopping, or the reply stopped before a repeated call."""
        reply, ended = job.reply, False
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
            if drive.finish_reason is None and self._stopped(job) is not None:
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


SAVE_EVERY = 16  # requests between two saves of what was learnt, at most
SAVE_INTERVAL_S = 300.0  # seconds between two saves, at most (`specdec serve --save-interval`)


class Saver:
    """When to save what was learnt while the server runs (`Worker(saver=Saver(service.save_learnt))`): once `every`
    requests were served since the last save, or `interval` seconds passed with at least one served, so a crash
    (SIGKILL) loses at most that much. The worker calls `note` after each request (and, when that made a save due, saves
    on the loop's thread between two steps) and `save_now` when a save falls due while it is idle (the learning of the
    last requests before a quiet hour is on disk within `interval`, not at the next request), so nothing mutates the
    stores during a save; each store writes atomically under its own file lock. Nothing served since the last save:
    nothing to write."""

    def __init__(
        self,
        save: Callable[[], None],
        *,
        every: int = SAVE_EVERY,
        interval: float = SAVE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.save, self.every, self.interval, self.clock = save, every, interval, clock
        self.served = 0  # requests served since the last save (their learning is in memory only)
        self.last = clock()
        self.saves = 0

    def due_in(self) -> float | None:
        """Seconds until a save is due (0: now); None: nothing served since the last save, nothing to save."""
        if self.served == 0:
            return None
        if self.served >= self.every:
            return 0.0
        return max(0.0, self.last + self.interval - self.clock())

    def note(self) -> bool:
        """One request was served: whether that made a save due (nothing saved yet)."""
        self.served += 1
        return self.due_in() == 0

    def __call__(self) -> None:
        """One request was served: save if that made a save due."""
        if self.note():
            self.save_now()

    def save_now(self) -> None:
        self.served, self.last = 0, self.clock()
        self.save()
        self.saves += 1


def _send(job: Job, event: Event) -> None:
    try:
        job.deliver(event)
    except Exception:  # the receiving side is gone (event loop closed at shutdown): nothing to tell
        pass


def _chunk_s(job: Job) -> list[float]:
    """Seconds each of `job`'s prefill chunks took, the first from when the worker took it (tokenizing included)."""
    if job.started_at is None or not job.chunk_ends:
        return []
    ends = [job.started_at, *job.chunk_ends]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def log_line(job_id: int, kind: str, stats: RequestStats, outcome: str, method: str) -> str:
    """One line per request: prompt (cached), tokens, tok/s, acceptance by source, tokens per pass, finish."""
    r = stats.run
    parts = [
        f"#{job_id} {kind}: {r.n_prompt} prompt tokens ({r.n_cached} cached)",
        f"{r.n_generated} tokens in {stats.wall_ms / 1e3:.2f} s",
        f"{r.tokens_per_s:.1f} tok/s",
    ]
    if method != Method.none:
        by_source = ", ".join(f"{src} {v['accepted']}/{v['drafted']}" for src, v in sorted(r.by_source.items()))
        parts.append(f"acceptance {r.acceptance_rate:.0%}" + (f" ({by_source})" if by_source else ""))
        parts.append(f"{r.tokens_per_pass:.2f} tok/pass")
    parts.append(f"finish {r.finish_reason}" if outcome == "ok" else outcome)
    return ", ".join(parts)
