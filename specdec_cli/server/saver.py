"""When the server saves what was learnt (the suffix store, `--k auto`), so a crash loses little of it."""

from __future__ import annotations

import time
from collections.abc import Callable

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
