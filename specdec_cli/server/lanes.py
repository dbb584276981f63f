"""Several generations at once on one loaded model: slots, and the one loop that plans their passes.

A slot is one sequence of the target's context (`LlamaBackend.lane`: its own KV stream and tokens); the request on it
is a program that yields its rows (`engine.Rows`) and is sent their logits. The thread that owns llama.cpp calls
`Scheduler.step` again and again, as llama-server's `update_slots` does (docs/architecture.md draws the loop;
docs/serving-concurrency.md says why each rule is there). Lossless per slot: its rows attend to its own cells only, and
a seeded request's noise is keyed by its seed (`sampling.sample_at`), whatever its neighbours do. A prompt's prefix that
another slot of the same client holds is copied from it (`LlamaBackend.copy_prefix`), not read again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.controller import flat
from specdec_cli.core.cost_model import meet
from specdec_cli.errors import PassInterrupted

if TYPE_CHECKING:
    from specdec_cli.core.engine import Rows
    from specdec_cli.core.verify_curve import VerifyCurve

INTERACTIVE, BATCH = 0, 1  # priority classes: lower first
PIECE_S = 1.0  # seconds of prefill in one pass (its piece), so a request that arrives waits about that at most
SHARE = 0.1  # the long requests' share of the passes' time while an interactive slot runs (so they never starve)
FIRST_PIECE = 256  # prefill rows per pass before any pass was timed
QUIET_S = 60.0  # no editor's request for this long: prefill pieces are whole batches
MIN_PIECE = 32  # smaller pieces cost a CPU more per row than they save a newcomer


@dataclass(order=True)
class Priority:
    """A sequence's place in line: class (INTERACTIVE first), deadline (time.monotonic() s; inf: none), arrival.
    `editor` (not part of the order): its next request comes soon, so prefill pieces stay short for `quiet_s`."""

    cls: int = BATCH
    deadline: float = math.inf
    seq: int = 0
    editor: bool = field(default=False, compare=False)


@dataclass
class _Sub:
    """A slot's rows waiting for a pass: `tokens` int32 [m] of which `done` are evaluated (a prefill's in chunks, its
    first `copied` copied from another slot), `n_logits` at the end want logits; `branch`, `expected`: `Rows`'."""

    slot: Slot
    tokens: np.ndarray
    n_logits: int
    branch: np.ndarray | None = None
    expected: np.ndarray | None = None
    call: int = 0  # parts of equal rows and call go in one llama_decode (`cost_model.meet`)
    done: int = 0
    copied: int = 0

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def splittable(self) -> int:
        """Rows that may go in an earlier pass than the logits rows (a prefill's rows)."""
        return max(0, len(self.tokens) - self.n_logits - self.done)


class Slot:
    """One sequence of the target: its backend (`LlamaBackend.lane`; the target itself with one slot), the program on
    it, and what its engine's passes allow (`SpeculativeEngine.passes`). Used from the scheduler's thread only."""

    def __init__(self, scheduler: Scheduler, backend: Any, index: int) -> None:
        self._s, self.backend, self.index = scheduler, backend, index
        self.priority = Priority()
        self.program: Generator[Rows, np.ndarray | int | None, None] | None = None  # what runs on it (`start`)
        self.check: Callable[[], None] | None = None  # raises to stop its prefill between pieces
        self.answer: np.ndarray | int | None = None  # the logits its program is sent next (a prefill's: rows copied)
        self.scope: str | None = None  # whose requests its cells hold (`Request.scope`): copied only within one
        self.shared_rows = 0

    @property
    def branches(self) -> bool:
        return self.backend.branches and len(self._s._active) <= 1  # alone: a second branch takes a pass of its own

    @property
    def draft_limit(self) -> int:
        """A batch's worth of draft tokens, or a recurrent target's snapshots (each slot has a KV stream of its own)."""
        return min(self.backend.n_batch - 1, self.backend.draft_limit)


class Scheduler:
    """The slots of one target and the one loop that runs them. Every call but `preempt` comes from the one thread
    that owns llama.cpp's context (the server's `Worker` loop).

    Args:
        backend: the target (`LlamaBackend` made with n_lanes = `n_slots`, or a fake with `lane(i)` and
            `decode_many`); one slot uses it directly, each pass a `decode` of its own.
        n_slots: sequences at once (`specdec serve --parallel`).
        curve: the target's measured verify curve (`_steep`, and a step's cost in `_compose`); None: an affine
            guess, v(b) = 1 + 0.1 (b - 1).
        clock: seconds, monotonic.
        piece_s, quiet_s, share: see PIECE_S, QUIET_S and SHARE; the share is paid at most `piece_s` of passes from
            one run of interactive slots' end to the next's (`_account`): a completion waits about one piece at most.
    """

    def __init__(
        self,
        backend: Any,
        n_slots: int,
        *,
        curve: VerifyCurve | None = None,
        clock: Callable[[], float] = time.perf_counter,
        piece_s: float = PIECE_S,
        quiet_s: float = QUIET_S,
        share: float = SHARE,
    ) -> None:
        self.backend, self.curve, self.clock = backend, curve, clock
        self.slots = [Slot(self, backend.lane(i) if n_slots > 1 else backend, i) for i in range(n_slots)]
        self.interruptible = bool(getattr(backend, "interruptible", False))  # it can stop a pass under way
        self.piece_s, self.quiet_s, self.share = piece_s, quiet_s, share
        self._editor_at = -math.inf  # when an editor's request last started or ended (clock s)
        self._owed_ms = 0.0  # time owed to long requests while interactive slots run (negative: ahead)
        self._lent_ms = 0.0  # the long requests' pass ms since the last run of interactive slots ended
        self._due = False  # a run of interactive slots ended and the long requests had no pass since
        self._lock = threading.Lock()  # guards `_stop_below` (`preempt` comes from other threads)
        self._stop_below: Priority | None = None  # a newcomer ahead of this may interrupt the pass under way
        self.interrupted = 0  # passes interrupted
        self._subs: dict[int, _Sub] = {}  # slot index -> its rows waiting for a pass
        self._active: set[int] = set()
        self._ms_per_row: float | None = None  # prefill ms per row, from passes that were mostly prefill
        self.passes = 0  # llama_decode calls made
        self.log: deque[tuple[float, tuple[tuple[int, int, int], ...]]] = deque(maxlen=256)  # `_pass`: the last ones

    # -- the loop's side ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A sequence is running (`step` has work)."""
        return bool(self._active)

    def start(
        self,
        slot: Slot,
        program: Generator[Rows, np.ndarray | int | None, None],
        priority: Priority,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Run `program` on `slot` from the next `step` on: it yields its rows and is sent their logits (None for a
        prefill's); `check` raises to stop it between its prefill's pieces. The slot is free once it returns."""
        assert slot.program is None, "a slot runs one sequence at a time"
        self.note(priority)
        slot.priority, slot.program, slot.check, slot.answer = priority, program, check, None
        self._active.add(slot.index)

    def note(self, priority: Priority) -> None:
        """A request of `priority` came (started, or a warm-up served): an editor's keeps prefill pieces short."""
        if priority.editor:
            self._editor_at = self.clock()

    def preempt(self, priority: Priority) -> None:
        """A request of `priority` is about to start (any thread): an interactive one interrupts a pass under way whose
        sequences all come after it (`_preemption`), which is evaluated again after the newcomer's first pass."""
        with self._lock:
            if priority.cls == INTERACTIVE and self._stop_below is not None and priority < self._stop_below:
                self._stop_below = None
                self.backend.interrupt()

    def step(self) -> bool:
        """Start the new programs (to their first rows), plan the pass (`_compose`), check the prefills it continues,
        run it and hand each sequence its logits (`_pass`). False: nothing was waiting. Raises what a program raised."""
        for slot in sorted((self.slots[i] for i in self._active if i not in self._subs), key=lambda x: x.priority):
            self._advance(slot)
        if not self._subs:
            return False
        parts = self._compose()
        checks = [(s, s.slot.check) for s, _ in parts if s.done > s.copied and s.slot.check is not None]
        for sub, check in checks:  # between a prefill's pieces (after its first pass: it runs a copy, `copy_prefix`)
            try:
                check()
            except BaseException as e:  # noqa: BLE001 (its program's to handle)
                parts = [p for p in parts if p[0] is not sub]
                self._subs.pop(sub.slot.index, None)
                self._advance(sub.slot, e)
        if parts:
            self._pass(parts)
        return True

    def _advance(self, slot: Slot, error: BaseException | None = None) -> None:
        """Send `slot`'s program its answer (or throw `error` into it) and keep the rows it yields next."""
        program, answer = slot.program, slot.answer
        assert program is not None  # (a slot is advanced only while it runs one)
        slot.answer = None
        try:
            rows = program.throw(error) if error is not None else program.send(answer)
        except StopIteration:
            self._end(slot)
            return
        except BaseException:
            self._end(slot)
            raise
        self._subs[slot.index] = _sub(slot, rows)

    def _end(self, slot: Slot) -> None:
        self.note(slot.priority)
        self._active.discard(slot.index)
        if slot.priority.cls == INTERACTIVE and all(self.slots[i].priority.cls != INTERACTIVE for i in self._active):
            self._lent_ms, self._due = 0.0, bool(self._active)  # counted again from here, the time between runs too
        self._due = self._due and any(self.slots[i].priority.cls != INTERACTIVE for i in self._active)  # (nobody left)
        self._subs.pop(slot.index, None)
        slot.program, slot.check, slot.answer, slot.shared_rows = None, None, None, 0

    # -- what the slots read ---------------------------------------------------------------------------------------
    def _v(self, b: int, depth: int | None = None) -> float:
        """v(b): ms of a pass over b rows (after `depth` tokens of context: `VerifyCurve.predict`), from the measured
        curve (or the affine guess without one, at every depth)."""
        return self.curve.predict(b, depth or self.curve.context) if self.curve is not None else 1.0 + 0.1 * (b - 1)

    # -- a pass -------------------------------------------------------------------------------------------------------
    def _pass(self, parts: list[tuple[_Sub, int]]) -> None:
        """Evaluate `parts` (`decode` with one slot, `decode_branches` for a second branch, else `decode_many`), then
        send each program whose rows are all evaluated its logits (or the error), interactive first, while they last."""
        with self._lock:
            self._stop_below = self._preemption(parts)
            may_stop = self._stop_below is not None
        error: BaseException | None = None
        t0 = self.clock()
        try:
            if len(parts) == 1 and parts[0][0].branch is not None:
                sub = parts[0][0]
                results = [sub.slot.backend.decode_branches(sub.tokens, sub.branch)]
            else:
                pieces = [
                    (s.slot.backend, s.tokens[s.done : s.done + m], s.n_logits if s.done + m == len(s.tokens) else 0)
                    for s, m in parts
                ]
                calls = [s.call for s, _ in parts]
                one = len(self.slots) == 1  # (then the target itself, whose `decode` it calls)
                results = [pieces[0][0].decode(*pieces[0][1:])] if one else self.backend.decode_many(pieces, calls)
        except BaseException as e:  # noqa: BLE001 (thrown into every program of the pass)
            error, results = e, [None] * len(parts)
        ms = (self.clock() - t0) * 1e3
        if may_stop:
            with self._lock:
                self._stop_below = None
                self.backend.interrupt(False)  # (one asked for as this pass ended must not stop the next)
            if isinstance(error, PassInterrupted):  # nothing evaluated: the same rows go again, after the newcomer's
                self.interrupted += 1
                return
        self.passes += 1
        logged = tuple((s.slot.index, m, s.n_logits if s.done + m == len(s.tokens) else 0) for s, m in parts)
        self.log.append((ms, logged))  # its ms; per part: slot, rows, rows that want logits (a prefill piece's: 0)
        total, prefill = sum(m for _, m, _ in logged), sum(m for _, m, n in logged if n == 0)
        self._account(parts, ms)
        if error is None and prefill >= max(MIN_PIECE, total // 2):
            per = ms / total
            self._ms_per_row = per if self._ms_per_row is None else 0.7 * self._ms_per_row + 0.3 * per
        done = []
        for (sub, m), result in zip(parts, results, strict=False):
            sub.slot.shared_rows = total - m
            sub.done += m if error is None else 0
            if error is not None or sub.done == len(sub.tokens):
                self._subs.pop(sub.slot.index, None)
                sub.slot.answer = result if sub.n_logits else sub.copied
                done.append(sub.slot)
        for slot in sorted(done, key=lambda x: x.priority):  # each accepts its logits now: no view outlives the pass
            self._advance(slot, error)

    def _preemption(self, parts: list[tuple[_Sub, int]]) -> Priority | None:
        """Who may interrupt the pass of `parts` (`preempt`): an interactive newcomer ahead of every slot in it, unless
        an interactive slot waits outside it (it is then the long requests' share, paid while that slot waits), it is
        their pass owed as interactive slots last ended (`_due`: owed again, it would go before the newcomer's first,
        a whole piece), or an interactive slot's part has logits rows (a verify step is short); None: nobody."""
        if not self.interruptible or (self._due and all(s.slot.priority.cls != INTERACTIVE for s, _ in parts)):
            return None
        inside = {id(s) for s, _ in parts}
        if any(s.slot.priority.cls == INTERACTIVE and id(s) not in inside for s in self._subs.values()):
            return None
        if any(s.slot.priority.cls == INTERACTIVE and s.n_logits and s.done + m == len(s.tokens) for s, m in parts):
            return None
        return min(s.slot.priority for s, _ in parts)

    def _account(self, parts: list[tuple[_Sub, int]], ms: float) -> None:
        """Keep the long requests' time share while an interactive slot runs: owed += share x an interactive pass's ms
        while they wait, -= each pass of theirs, those between an editor's requests too (down to one piece ahead: a
        piece in the gap counts as the share of the next request's passes). What they get from the end of one run of
        interactive slots to the end of the next (`_lent_ms`; the gap's passes included, which cost the next run
        nothing) is capped at `piece_s`, one pass at least (`_compose`): a completion waits about a piece for them."""
        if not any(s.slot.priority.cls == INTERACTIVE for s, _ in parts):  # the long requests' pass: it pays
            self._owed_ms = max(-self.piece_s * 1e3, self._owed_ms - ms)  # (ahead by one piece at most)
            self._lent_ms += ms  # (from 0 again as a run of interactive slots ends: `_end`)
            self._due = False
        elif any(s.slot.priority.cls != INTERACTIVE for s in self._subs.values()):  # they waited for it
            self._owed_ms += self.share * ms

    def _compose(self) -> list[tuple[_Sub, int]]:
        """(sub, rows it gets) for the next pass, in priority order within `n_batch` rows: a second branch alone; every
        decoding slot's verify step (steps of unequal rows pay a call each: cut to a common count where that pays,
        `cost_model.meet`), then prefill pieces (one interactive prompt at a time). Interactive slots' rows never
        share a pass with the others' (llama.cpp would run them as ubatches of their own, each paying the weights'
        read): the others get a pass once they are owed as much as it costs (`_account`)."""
        subs = sorted(self._subs.values(), key=lambda s: s.slot.priority)
        branch = next((s for s in subs if s.branch is not None), None)
        if branch is not None:
            return [(branch, len(branch.tokens))]
        budget = self.backend.n_batch
        inter = [s for s in subs if s.slot.priority.cls == INTERACTIVE]
        rest = [s for s in subs if s.slot.priority.cls != INTERACTIVE]
        if len(rest) > 1 and self._steep():
            prompts = [s for s in rest if s.splittable]
            rest = prompts[:1] or rest  # the long prompts first, one at a time; then their steps together: `_steep`
            subs = inter + rest
        piece = self._piece()
        if inter and rest:  # a pass for the interactive slots, or one for the others when they are owed it
            per = self._ms_per_row if self._ms_per_row is not None else 0.0
            steps = sum(s.left for s in rest if s.splittable == 0)
            cost = (self._v(steps) if steps else 0.0) + (MIN_PIECE * per if any(s.splittable for s in rest) else 0.0)
            left_ms = self.piece_s * 1e3 - self._lent_ms  # of the most they get beside these interactive slots
            # (one pass at least, however deep: where the smallest piece costs more than `piece_s` they would starve)
            if self._owed_ms >= cost and (left_ms >= cost or self._lent_ms == 0):
                subs = rest
                paid = min(self._owed_ms, left_ms)
                piece = min(piece, max(MIN_PIECE, int(paid / per))) if per > 0 else piece
            else:
                subs = inter
        # an interactive slot alone among the interactive ones reads its prompt in whole batches: nothing waits
        # behind it that a piece would let in sooner, and a CPU reads a whole batch cheaper per row than a piece
        alone = sum(1 for x in self.slots if x.index in self._active and x.priority.cls == INTERACTIVE) <= 1
        if len(verify := [s for s in subs if s.n_logits == len(s.tokens) and s.branch is None]) > 1:
            plan = meet([(len(s.tokens), s.expected, len(s.slot.backend.tokens)) for s in verify], self._v)
            for s, (r, call) in zip(verify, plan, strict=True):
                s.tokens, s.n_logits, s.call = s.tokens[:r], r, call
        parts: list[tuple[_Sub, int]] = []
        for s in subs:  # whole steps first: the rows that want logits, with whatever prefill precedes them
            if s.splittable == 0 and s.left <= budget:
                parts.append((s, s.left))
                budget -= s.left
        reading = False  # an interactive slot earlier in line reads its prompt in this pass
        for s in subs:  # then prefill pieces
            if s.splittable == 0 or budget <= 0:
                continue
            urgent = s.slot.priority.cls == INTERACTIVE
            if urgent and reading:
                continue  # one interactive prompt at a time (its piece would be a llama_decode of its own)
            reading = reading or urgent
            if not s.done and not s.n_logits and len(self.slots) > 1:  # rows a slot of its scope holds: copied
                peers = [x.backend for x in self.slots if x is not s.slot and x.scope == s.slot.scope]
                s.done = s.copied = s.slot.backend.copy_prefix(s.tokens[: s.left - 1], peers)
            # an interactive slot reads its prompt in whole batches when it is the only interactive one (nothing waits
            # behind it) or the first in line and a newcomer ahead of it could interrupt the pass (`_preemption`)
            whole = urgent and (alone or (s is subs[0] and self.interruptible))
            cap = budget if whole else piece
            m = min(s.splittable, budget, cap)
            if s.left - m <= s.n_logits and s.left <= min(budget, cap):
                m = s.left  # the rest fits: take the logits rows too
            parts.append((s, m))
            budget -= m
        if not parts:  # one step larger than the budget left: it goes alone
            parts = [(subs[0], min(subs[0].left, self.backend.n_batch))]
        return parts

    def _steep(self) -> bool:
        """A CPU's verify curve (not `controller.flat`; no curve counts as steep): the long requests' prompts are then
        read one at a time, in arrival order, before any long request's verify step, and their verify steps go in the
        same passes once none is reading. On such a curve a prefill piece beside a step only makes the step wait for
        it (docs/results-history.md, 2026-11-27, night), while steps of equal rows share a ubatch and so one read of
        the weights (`LlamaBackend.decode_many`): reading the prompts first lets the most steps meet. On a flat curve
        (a GPU) every long request shares every pass."""
        return not flat(np.asarray(self.curve.ms) if self.curve is not None else None)

    def _piece(self) -> int:
        """Prefill rows per pass: a whole batch when no editor's request came for `quiet_s` seconds, else about
        `piece_s` seconds at the measured ms per row; half that for the pass owed as interactive slots end (`_due`:
        nobody interrupts it, and an editor's next completion, sent as the last one is answered, waits for it)."""
        editing = any(x.priority.editor for x in self.slots if x.index in self._active)
        if self.clock() - self._editor_at > self.quiet_s and not editing and not self._due:
            return self.backend.n_batch
        part = 2 if self._due else 1
        if self._ms_per_row is None:
            return FIRST_PIECE // part
        return int(min(self.backend.n_batch, max(MIN_PIECE // part, self.piece_s * 1e3 / part / self._ms_per_row)))


def _sub(slot: Slot, rows: Rows) -> _Sub:
    """`rows` as waiting rows of `slot`: a verify pass with a second branch wants logits for every row."""
    tokens = np.asarray(rows.tokens, dtype=np.int32)
    branch = None if rows.branch is None else np.asarray(rows.branch, dtype=np.int32)
    return _Sub(slot, tokens, len(tokens) if branch is not None else rows.n_logits, branch, rows.expected)
