"""The serving loop: one thread owns the model and serves every request from one bounded queue.

The thread (`Worker._loop`, drawn in docs/architecture.md) takes waiting requests onto free slots, saves what was learnt
when due, and runs one `lanes.Scheduler.step`; a request on a slot is its job's program (`jobs.Job.run`). The HTTP side
only submits a `request.Request`, cancels it or stops the server, so the worker never learns which API it came in by.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.engine import Rows
from specdec_cli.models.backend import common_prefix
from specdec_cli.server.errors import ClientGoneError, DeadlineError, QueueFullError, ShuttingDownError
from specdec_cli.server.jobs import Event, Failed, Job
from specdec_cli.server.lanes import Scheduler
from specdec_cli.server.request import Request
from specdec_cli.server.service import GenerationService

if TYPE_CHECKING:
    from specdec_cli.server.saver import Saver

FIRST_GUESS_S = 10.0  # a request's wall time before any was served (Retry-After's first estimate), seconds
MEAN_WEIGHT = 0.3  # weight of the latest request in the moving mean of wall times
PLACE_MARGIN = 32  # tokens of prefix another idle lane must share beyond the taking lane's to be handed a request
WAIT_MARGIN = 256  # tokens of prefix a finishing interactive lane must share beyond every idle lane's to be waited for


_stderr = partial(print, file=sys.stderr, flush=True)  # the default log: a line to stderr


class Worker:
    """The serving loop's thread, its slots (`GenerationService.lanes`) and their queue.

    Args:
        service: the models, engines and scheduler (`GenerationService.scheduler`), used from the loop's thread only.
        bound: requests that may wait while every slot is busy (0 = none: a request arriving then gets 429).
        log: one line per request (default: stderr).
        timeout: seconds a request may hold a slot (`--timeout`); None: no deadline.
        saver: the learnt state's periodic save, run between steps and when idle.
        clock: seconds, monotonic: requests' ages, deadlines and Retry-After (tests pass a virtual one).
    """

    def __init__(
        self,
        service: GenerationService,
        *,
        bound: int = 16,
        log: Callable[[str], None] = _stderr,
        timeout: float | None = None,
        saver: Saver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.bound = bound
        self.log = log
        self.timeout = timeout
        self.saver = saver
        self.clock = clock
        self.n_lanes: int = service.lanes
        self.scheduler: Scheduler = service.scheduler
        self._cv = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # slot -> the job it serves
        self._used = [0.0] * self.n_lanes  # clock() each slot last finished a job (least recently used)
        self._stopping = False
        self._save_due = False  # a request's end made a save due: saved before the next step
        self._ids = itertools.count(1)
        self._mean_s = FIRST_GUESS_S  # a request's mean wall time (exponential moving average), for Retry-After
        self._thread = threading.Thread(target=self._loop, name="specdec-serve-worker", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, deliver: Callable[[Event], None]) -> Job:
        """Queue `request`; its events go to `deliver` (called on the loop's thread; it must not block). Raises
        QueueFullError (the queue is at its bound) or ShuttingDownError."""
        with self._cv:
            if self._stopping:
                raise ShuttingDownError()
            # jobs that idle lanes are about to take do not count against the bound
            if len(self._pending) >= self.bound + (self.n_lanes - len(self._running)):
                raise QueueFullError(self.bound, self._retry_after())
            job = Job(next(self._ids), request, deliver, self.service.reply(request), self.clock)
            self._pending.append(job)
            free = len(self._running) < self.n_lanes
            self._cv.notify_all()
        if free and self.scheduler is not None:  # it may stop a long request's pass under way
            self.scheduler.preempt(job.priority)
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop `job` if it is waiting, else stop it at its next step; either way its last
        event is `Failed(ClientGoneError())` (none if it had finished). Idempotent."""
        with self._cv:
            if job.cancelled_at is None:
                job.cancelled_at = self.clock()
            job.cancelled.set()
            try:
                self._pending.remove(job)
            except ValueError:
                return
        job.send(Failed(ClientGoneError()))

    def stop(self) -> None:
        """Stop serving: waiting requests fail with ShuttingDownError, the running ones end after their step."""
        with self._cv:
            self._stopping = True
            waiting = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for job in waiting:
            job.send(Failed(ShuttingDownError()))

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
        """The queue as `/health` shows it: {"waiting": requests queued, "bound": `--queue`, "lanes": N, "running": the
        first lane's {"id", "kind", "age_s" (seconds since it was taken), "tokens" (output so far), "lane"} or None,
        "busy": [the same for every running request], "retry_after_s": what a request refused now would get}."""
        with self._cv:
            busy = [
                {
                    "id": job.id,
                    "kind": job.request.label,
                    "age_s": round(self.clock() - job.started_at, 2),
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
        now = self.clock()
        age = max((now - j.started_at for j in self._running.values() if j.started_at), default=0.0)
        work = self._mean_s * (len(self._pending) + len(self._running)) / self.n_lanes
        return max(1, math.ceil(work - age))

    # -- the loop --------------------------------------------------------------------------------------------------
    def _place(self, lane: int, job: Job) -> int:
        """The lane `job` should run on (lock held): the lane whose KV cache or parked states share the longest prefix
        with its prompt, among the idle lanes (`lane` included) and the lanes finishing an interactive request (an
        editor's next completion arrives as its previous one ends: it waits for that lane rather than evaluate its
        prompt again on another); where no idle lane shares `PLACE_MARGIN` tokens more than the others, the least
        recently used (an agent's request on the editor's lane would evict its prefix and make it wait a turn)."""
        if self.n_lanes == 1 or job.prompt is None:
            return lane
        prompt = np.asarray(job.prompt, dtype=np.int32)
        idle = [i for i in range(self.n_lanes) if i not in self._running or self._running[i].request.interactive]

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
                job = min(waiting, key=lambda j: j.priority)
                if job.prompt is None:
                    job.prompt = self._tokens(job)
                job.lane = self._place(min(free, key=lambda i: self._used[i]), job)
                if job.lane in self._running:  # held for the finishing slot that holds its prefix
                    continue
            assert job.lane is not None  # (placed above, or handed to a slot before)
            self._pending.remove(job)
            self._running[job.lane] = job
            job.started_at = self.clock()
            slot, check = self.scheduler.slots[job.lane], partial(self._check, job)
            self.scheduler.start(slot, self._generate(job, job.lane), job.priority, check=check)

    def _tokens(self, job: Job) -> list[int]:
        if job.request.prompt_ids is not None:
            return list(job.request.prompt_ids)
        try:
            return self.service.prompt_tokens(job.request)
        except Exception:  # noqa: BLE001 (its program reports it: `Job.run` tokenizes again)
            return []

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
            now = self._used[lane] = self.clock()
            took = now - (job.started_at or now)
            self._mean_s = (1 - MEAN_WEIGHT) * self._mean_s + MEAN_WEIGHT * took
            if self.saver is not None and self.saver.note():
                self._save_due = True
            self._cv.notify_all()

    def _generate(self, job: Job, lane: int) -> Generator[Rows, Any, None]:
        """One request's program on slot `lane` (`lanes.Scheduler.start`): the job's `run`, then its slot is freed and
        its line logged. Never raises (the server goes on whatever happens)."""
        try:
            line = yield from job.run(self.service, lane, partial(self._stopped, job))
        finally:
            self._end(job, lane)
        self.log(line + (f"; lane {lane}" if self.n_lanes > 1 else ""))

    def _stopped(self, job: Job) -> Exception | None:
        """Why `job` must stop now, or None: its client went away, the server is stopping, or its deadline
        (`timeout` seconds after the worker took it) passed."""
        if job.cancelled.is_set():
            return ClientGoneError()
        if self._stopping:
            return ShuttingDownError()
        if self.timeout is not None and job.started_at is not None and self.clock() - job.started_at > self.timeout:
            return DeadlineError(self.timeout)
        return None

    def _check(self, job: Job) -> None:
        """Raise `_stopped(job)` if there is a reason: called between the prefill's chunks (`Scheduler.step`)."""
        job.chunk_ends.append(self.clock())
        stopped = self._stopped(job)
        if stopped is not None:
            raise stopped
