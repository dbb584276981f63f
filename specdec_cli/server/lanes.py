"""Several generations at once on one loaded model: slots, and the one loop that plans their passes.

A slot is one sequence of the target's context (`LlamaBackend.lane`: its own KV stream and tokens, or its cells in one
unified pool with `--kv-unified`); the request running on it is a program (the engine's `SpeculativeEngine.steps`
under the worker's delivery) that yields its rows (`engine.Rows`) and is sent their logits. One thread, the one that
owns llama.cpp's context, runs `Scheduler.step` again and again, as llama-server's `update_slots` and vLLM's
schedule -> execute -> update do:

    plan the pass (`_compose`): verify rows first, interactive sequences first, prefill chunks under the budget
      -> one llama_decode (`LlamaBackend.decode_many`; a plain `decode` with one slot)
      -> each program whose rows were evaluated is sent its logits: it accepts, rolls back, emits its records,
         drafts, and yields its next rows for the next plan

What a pass holds (`_compose`), in priority order (interactive requests — FIM, warm-ups, short replies — first, then
earliest deadline, then arrival), within a token budget of `n_batch` rows:
- every decoding slot's verify rows (its newest token and its draft): a step is never split;
- prefill chunks of the slots still reading their prompts: while an editor is in use (one of its requests ran in the
  last `quiet_s` seconds: `Priority.editor`), a chunk of about `piece_s` seconds of prefill (measured per row, so an
  editor's next completion joins within about that); otherwise a whole batch (on a CPU each pass has a fixed cost
  besides its rows, so small chunks make a prompt slower to read); while an interactive slot is in the pass, a long
  request's prefill gets a time share instead: `share` of the passes' time (the rows its owed milliseconds buy at the
  measured cost per row, carried over from pass to pass), so it never starves; an interactive slot with no other
  interactive slot beside it reads its prompt in whole batches (nothing waits behind it);
- with a KV stream per slot (the default), a pass never mixes interactive slots' rows with the others': llama.cpp
  would run them as ubatches of their own, each paying the weights' read and more (`benchmarks/bench_kv_pool.py`),
  so the others get passes of their own once they are owed as much as such a pass costs;
- a slot's second-branch pass (`decode_branches`) runs alone: branches are offered only while a slot is alone.

An interactive request that arrives while a pass of sequences that all come after it is under way (a long request's
chunk) interrupts it (`preempt`, from the HTTP side: `LlamaBackend.interrupt`, llama.cpp's abort callback): it starts
within a graph node instead of after the rest of the pass, and the pass is evaluated again after its first one.
Passes paid as the long requests' share while an interactive slot waits, and interactive verify steps, are never
interrupted (`_preemption`).

K per slot is chosen jointly through `Slot.draft_limit`: each slot's best response to the rows and expected tokens of
the others' last passes on the measured verify curve, (E_slot(k) + T_others) / v(k + 1 + R_others) maximised over k
(v: the measured curve as a straight line), with E(k) = 1 + a + ... + a^k from the slot's measured acceptance a (0.9
before any evidence); the slot's controller then chooses K within it (never below plain batched decoding). After
TurboSpec/SmartSpec (Liu et al. 2024, arXiv 2406.14066): speculate by goodput, less as the batch grows. That is for
one KV pool (`--kv-unified`), where a pass is one ubatch; with a KV stream per slot each slot's rows are evaluated
apart (`LlamaBackend.decode_many`), so its own controller's K stands.

Lossless per slot: each slot's rows attend to its own cells only, so its logits are those of its own pass up to the
rounding of a larger batch (near-ties, which `specdec check` explains); each request's sampling has its own random
generator, and a seeded one samples each position with noise keyed by its seed (`sampling.sample_at`), so its output
is the same whatever K its neighbours leave it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.errors import PassInterrupted

if TYPE_CHECKING:
    from specdec_cli.core.engine import Rows
    from specdec_cli.core.verify_curve import VerifyCurve

INTERACTIVE, BATCH = 0, 1  # priority classes: lower first
PIECE_S = 1.0  # seconds of prefill in one pass (its piece), so a request that arrives waits about that at most
SHARE = 0.1  # a long request's share of the passes' time while an interactive slot is in them (its guaranteed share)
SHARE_ROWS = 32  # a long request's prefill rows per pass with an interactive slot before any pass was timed
FIRST_PIECE = 256  # prefill rows per pass before any pass was timed
QUIET_S = 60.0  # no editor's request for this long: prefill pieces are whole batches
MIN_PIECE = 64  # smaller pieces cost a CPU more per row than they save a newcomer
ACCEPT_PRIOR = (
    9.0,
    1.0,
)  # pseudo-counts (accepted, rejections): 0.9 before evidence (a lookup draft is mostly right or absent)
ACCEPT_DECAY = 0.9  # per verify pass: a slot's acceptance follows its current text


@dataclass(order=True)
class Priority:
    """A sequence's place in line: class (INTERACTIVE before BATCH), then deadline (time.monotonic() s; inf: none),
    then arrival order. `editor`: an editor's request (a completion, a warm-up, one with a deadline), whose next one
    comes soon: prefill pieces stay short for `quiet_s` after it (not part of the order)."""

    cls: int = BATCH
    deadline: float = math.inf
    seq: int = 0
    editor: bool = field(default=False, compare=False)


@dataclass
class _Sub:
    """A slot's rows waiting for a pass: `tokens` int32 [m] of which `done` are evaluated (a prefill is evaluated in
    chunks), `n_logits` rows at the end want logits; `branch`: a second branch (a pass of its own)."""

    slot: Slot
    tokens: np.ndarray
    n_logits: int
    branch: np.ndarray | None = None
    done: int = 0

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def splittable(self) -> int:
        """Rows that may go in an earlier pass than the logits rows (a prefill's rows)."""
        return max(0, len(self.tokens) - self.n_logits - self.done)


class Slot:
    """One sequence of the target's context: its own backend (`LlamaBackend.lane`, or the target itself with one slot:
    its engine's target), the program running on it, and what its engine's passes allow (`SpeculativeEngine.passes`):
    `draft_limit` (the joint K bound), `branches` (only while the slot is alone) and `shared_rows` (rows of other
    sequences in its last pass). Used from the scheduler's thread only."""

    def __init__(self, scheduler: Scheduler, backend: Any, index: int) -> None:
        self._s = scheduler
        self.backend = backend
        self.index = index
        self.priority = Priority()
        self.program: Generator[Rows, np.ndarray | None, None] | None = None  # what runs on it (`Scheduler.start`)
        self.check: Callable[[], None] | None = None  # raises to stop its prefill between pieces
        self.answer: np.ndarray | None = None  # the logits its program is sent next
        self.shared_rows = 0
        self.last_rows = 1  # rows of its last verify pass
        self._pass_start: int | None = None  # len(tokens) before its last verify pass
        self._acc = list(ACCEPT_PRIOR)  # decayed (accepted tokens, rejections)

    def _rows(self, rows: Rows) -> _Sub:
        """Its program's next rows, noted for the joint K: the drafts its last verify pass kept (its cache then held
        the tokens before the pass, the pass's first token and the accepted drafts); a prompt's next pass verifies a
        draft: until then it counts as one row."""
        n = len(self.backend.tokens)
        start, self._pass_start = self._pass_start, None
        if start is not None and self.last_rows > 1:
            accepted = max(0, min(n - start - 1, self.last_rows - 1))
            self._acc[0] = ACCEPT_DECAY * self._acc[0] + accepted
            self._acc[1] = ACCEPT_DECAY * self._acc[1] + (accepted < self.last_rows - 1)
        toks = np.asarray(rows.tokens, dtype=np.int32)
        if rows.branch is not None or rows.n_logits == len(toks):  # a verify pass
            self._pass_start, self.last_rows = n, len(toks)
        elif rows.n_logits:
            self.last_rows = 1
        branch = None if rows.branch is None else np.asarray(rows.branch, dtype=np.int32)
        return _Sub(self, toks, len(toks) if branch is not None else rows.n_logits, branch)

    @property
    def acceptance(self) -> float:
        """This slot's chance that a draft token is accepted, given the one before it was (a geometric fit)."""
        acc, rej = self._acc
        return acc / (acc + rej)

    @property
    def branches(self) -> bool:
        return self.backend.branches and self._s.alone(self)

    @property
    def draft_limit(self) -> int:
        return self._s.draft_limit(self)


class Scheduler:
    """The slots of one target and the one loop that runs them: `step` plans every sequence's rows, makes one
    `llama_decode` of them and hands each its logits. Every call but `preempt` comes from one thread, the one that
    owns llama.cpp's context (the server's `Worker` loop).

    Args:
        backend: the target (`LlamaBackend` made with n_lanes = `n_slots`, or a fake with `lane(i)` and
            `decode_many`); one slot uses it directly, each pass a `decode` of its own.
        n_slots: sequences at once (`specdec serve --parallel`).
        curve: the target's measured verify curve (prices the joint K); None: an affine guess, v(b) = 1 + 0.1 (b - 1).
        clock: seconds, monotonic.
        piece_s, quiet_s, share, share_rows: see the module's docstring.
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
        share_rows: int = SHARE_ROWS,
    ) -> None:
        self.backend = backend
        self.slots = [Slot(self, backend.lane(i) if n_slots > 1 else backend, i) for i in range(n_slots)]
        self.curve = curve
        self.clock = clock
        self.piece_s, self.quiet_s, self.share, self.share_rows = piece_s, quiet_s, share, share_rows
        self._editor_at = -math.inf  # when an editor's request last started or ended (clock s)
        self._owed_ms = 0.0  # time owed to long requests' prefill while interactive slots run (negative: ahead)
        # a KV stream per slot (`LlamaBackend.kv_streams`): llama.cpp runs a pass's sequences as ubatches of equal rows
        # per stream, so a long request's rows beside an interactive slot's cost a ubatch of their own and more: they
        # get passes of their own instead
        self.split = bool(getattr(backend, "kv_streams", False))
        self._lock = threading.Lock()  # guards `_stop_below` (`preempt` comes from other threads)
        self._stop_below: Priority | None = None  # a newcomer ahead of this may interrupt the pass under way
        self.interrupted = 0  # passes interrupted
        self._subs: dict[int, _Sub] = {}  # slot index -> its rows waiting for a pass
        self._active: set[int] = set()
        self._ms_per_row: float | None = None  # prefill ms per row, from passes that were mostly prefill
        self._line: tuple[float, float] | None = None  # (ms, ms per row): the curve as a line, for `draft_limit`
        self.passes = 0  # llama_decode calls made
        self.log: list[tuple[tuple[int, int], ...]] = []  # per pass: (slot, rows) of each part (the last 256)

    # -- the loop's side ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A sequence is running (`step` has work)."""
        return bool(self._active)

    def start(
        self,
        slot: Slot,
        program: Generator[Rows, np.ndarray | None, None],
        priority: Priority,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Run `program` on `slot` from the next `step` on: a generator that yields its rows (`engine.Rows`) and is
        sent their logits (None for a prefill's); `check` raises to stop it between its prefill's pieces (the error is
        thrown into it). The slot is free again once the program returns."""
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
        """One step: start the programs new since the last step (to their first rows), plan the pass (`_compose`),
        check the prefills it continues, run it (one `llama_decode`) and hand each sequence its logits to accept
        (`_pass`). Returns False when nothing was waiting. Raises what a program raised (that slot is then free)."""
        for slot in sorted((self.slots[i] for i in self._active if i not in self._subs), key=lambda x: x.priority):
            self._advance(slot)
        if not self._subs:
            return False
        parts = self._compose()
        for sub, _ in [p for p in parts if p[0].done and p[0].slot.check is not None]:  # between a prefill's pieces
            check = sub.slot.check
            assert check is not None  # (the filter above)
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
        self._subs[slot.index] = slot._rows(rows)

    def _end(self, slot: Slot) -> None:
        self.note(slot.priority)
        self._active.discard(slot.index)
        self._subs.pop(slot.index, None)
        slot.program = slot.check = slot.answer = None
        slot.shared_rows = 0

    # -- what the slots read ---------------------------------------------------------------------------------------
    @property
    def interruptible(self) -> bool:
        """The backend can stop a pass under way (`LlamaBackend.interrupt`)."""
        return bool(getattr(self.backend, "interruptible", False))

    def alone(self, slot: Slot) -> bool:
        """No other slot is generating (then a second branch is offered: it needs a pass of its own)."""
        return len(self._active) <= 1

    def draft_limit(self, slot: Slot) -> int:
        """The most draft tokens `slot` should verify in its next pass: all a batch can take while it is alone (or
        with a KV stream per slot, `split`: its rows are evaluated apart, so they cost what they cost alone and
        its controller's K is the one to use);
        with others, the k maximising (E(k) + T) / v(k + 1 + R) (R, T: the other slots' rows in their last passes and
        the tokens those are expected to give; a slot still reading its prompt adds its next piece to R and nothing
        to T, and its piece gives way to verify rows, so beside a long prefill a draft's rows are nearly free)."""
        top = min(slot.backend.n_batch - 1, slot.backend.draft_limit)  # a recurrent target: its snapshots
        others = [x for x in self.slots if x is not slot and x.index in self._active]
        if not others or self.split:  # split: its rows are evaluated apart, priced as alone
            return top
        rows = tokens = reading = 0
        for x in others:
            sub = self._subs.get(x.index)
            if sub is not None and len(sub.tokens) > sub.n_logits:  # reading its prompt: a piece, giving no token
                reading += min(sub.left, self._piece())
            else:
                rows += max(1, x.last_rows)
                tokens += _expected(x.acceptance, max(1, x.last_rows) - 1)[-1]
        top = max(0, min(top, slot.backend.n_batch - 1 - rows))  # a prefill piece yields the batch to verify rows
        rows += min(reading, slot.backend.n_batch - 1 - rows)
        v = self._v(np.arange(rows + 1, rows + top + 2))  # [top + 1] ms of a pass over R + k + 1 rows
        rate = (_expected(slot.acceptance, top) + tokens) / v
        return int(np.argmax(rate))

    def _v(self, b: np.ndarray) -> np.ndarray:
        """v(b) in ms for sizes b (int [n], >= 1): a straight line fitted to the measured curve (least squares over its
        sizes, made once). A CPU's curve is bumpy from one size to the next (kernel tiles), and a best response on the
        bumps jumps between extremes; the line keeps what matters: the pass's fixed cost and the cost of a row."""
        if self.curve is None:
            return 1.0 + 0.1 * (b.astype(np.float64) - 1.0)
        if self._line is None:
            sizes = np.arange(1, self.curve.b_max + 1, dtype=np.float64)
            slope, intercept = np.polyfit(sizes, np.asarray(self.curve.ms, dtype=np.float64), 1)
            slope = max(float(slope), 0.0)
            self._line = (max(float(intercept), 1e-3), slope)
        intercept, slope = self._line
        return intercept + slope * b.astype(np.float64)

    # -- a pass -------------------------------------------------------------------------------------------------------
    def _pass(self, parts: list[tuple[_Sub, int]]) -> None:
        """Evaluate `parts` (one `decode` with one slot, a second branch's `decode_branches`, else one `decode_many`),
        then hand each program whose rows are all evaluated their logits (or the pass's error), interactive ones
        first: each accepts, rolls back and yields its next rows before the next pass overwrites the logits."""
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
                results = (
                    [pieces[0][0].decode(pieces[0][1], pieces[0][2])]
                    if len(self.slots) == 1
                    else self.backend.decode_many(pieces)
                )
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
        self.log = [*self.log[-255:], tuple((s.slot.index, m) for s, m in parts)]
        total = sum(m for _, m in parts)
        prefill = sum(m for s, m in parts if s.n_logits == 0 or s.done + m < len(s.tokens))
        self._account(parts, ms, total)
        if error is None and prefill >= max(MIN_PIECE, total // 2):
            per = ms / total
            self._ms_per_row = per if self._ms_per_row is None else 0.7 * self._ms_per_row + 0.3 * per
        done = []
        for (sub, m), result in zip(parts, results, strict=False):
            sub.slot.shared_rows = total - m
            sub.done += m if error is None else 0
            if error is not None or sub.done == len(sub.tokens):
                self._subs.pop(sub.slot.index, None)
                sub.slot.answer = result
                done.append(sub.slot)
        for slot in sorted(done, key=lambda x: x.priority):  # each accepts its logits now: no view outlives the pass
            self._advance(slot, error)

    def _preemption(self, parts: list[tuple[_Sub, int]]) -> Priority | None:
        """Who may interrupt the pass of `parts` (`preempt`): an interactive newcomer ahead of every slot in it, unless
        an interactive slot waits outside it (it is then the long requests' share, paid while that slot waits) or
        an interactive slot's part has logits rows (a verify step is short: it finishes); None: nobody."""
        if not self.interruptible:
            return None
        inside = {id(s) for s, _ in parts}
        if any(s.slot.priority.cls == INTERACTIVE and id(s) not in inside for s in self._subs.values()):
            return None
        if any(s.slot.priority.cls == INTERACTIVE and s.n_logits and s.done + m == len(s.tokens) for s, m in parts):
            return None
        return min(s.slot.priority for s, _ in parts)

    def _account(self, parts: list[tuple[_Sub, int]], ms: float, total: int) -> None:
        """Keep the long requests' time share while an interactive slot is in the passes. Split (`split`): owed +=
        share x an interactive pass's ms while they wait, -= the ms of each pass of theirs, the ones between an
        editor's requests too (down to one piece ahead: the piece an editor's next request waits for as it arrives
        counts as the share of its passes, which then need not stop for another). Else: owed += share x the pass's
        ms - the ms its long prefill rows took (rows x the measured ms per row), within one piece either way.
        Nothing owed once no interactive slot shares the passes (the share is for the time they are slowed)."""
        if self.split:
            inter = any(s.slot.priority.cls == INTERACTIVE for s, _ in parts)
            if not inter:  # the long requests' pass, or theirs between an editor's requests: it pays what is owed
                self._owed_ms = max(-self.piece_s * 1e3, self._owed_ms - ms)  # (ahead by one piece at most)
            elif any(s.slot.priority.cls != INTERACTIVE for s in self._subs.values()):  # they waited for it
                self._owed_ms += self.share * ms
            return
        shared = any(s.slot.priority.cls == INTERACTIVE for s, _ in parts) and any(
            s.slot.priority.cls != INTERACTIVE and s.splittable for s in self._subs.values()
        )
        if not shared:
            self._owed_ms = 0.0
            return
        rows = sum(m for s, m in parts if s.slot.priority.cls != INTERACTIVE and s.splittable)
        per = self._ms_per_row if self._ms_per_row is not None else ms / max(1, total)
        bound = self.piece_s * 1e3
        self._owed_ms = min(bound, max(-bound, self._owed_ms + self.share * ms - rows * per))

    def _share(self) -> int:
        """Prefill rows a long request may add to a pass with an interactive slot: what its owed time buys."""
        if self._ms_per_row is None:
            return self.share_rows
        if self._owed_ms <= 0.0:
            return 0
        return max(1, math.ceil(self._owed_ms / self._ms_per_row))

    def _compose(self) -> list[tuple[_Sub, int]]:
        """(sub, rows it gets) for the next pass; see the module's docstring."""
        subs = sorted(self._subs.values(), key=lambda s: s.slot.priority)
        branch = next((s for s in subs if s.branch is not None), None)
        if branch is not None:
            return [(branch, len(branch.tokens))]
        budget = self.backend.n_batch
        inter = [s for s in subs if s.slot.priority.cls == INTERACTIVE]
        rest = [s for s in subs if s.slot.priority.cls != INTERACTIVE]
        if self.split and len(rest) > 1 and self._steep():
            rest = rest[:1]  # one long request at a time, the first in line: see `_steep`
            subs = inter + rest
        interactive = bool(inter) and bool(rest)
        piece, share = self._piece(), self._share()
        if interactive and self.split:  # a pass for the interactive slots, or one for the others when they are owed it
            per = self._ms_per_row if self._ms_per_row is not None else 0.0
            steps = sum(s.left for s in rest if s.splittable == 0)
            cost = (self._v(np.array([steps]))[0] if steps else 0.0) + (
                MIN_PIECE * per if any(s.splittable for s in rest) else 0.0
            )
            if self._owed_ms >= cost:
                subs = rest
                piece = min(piece, max(MIN_PIECE, int(self._owed_ms / per))) if per > 0 else piece
            else:
                subs = inter
            interactive = False
        # an interactive slot alone among the interactive ones reads its prompt in whole batches: nothing waits
        # behind it that a piece would let in sooner, and a CPU reads a whole batch cheaper per row than a piece
        alone = sum(1 for x in self.slots if x.index in self._active and x.priority.cls == INTERACTIVE) <= 1
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
            if urgent and reading and self.split:
                continue  # KV streams: one interactive prompt at a time (its piece would be a llama_decode of its own)
            reading = reading or urgent
            shared = interactive and not urgent  # a long request beside an interactive one
            # an interactive slot reads its prompt in whole batches when it is the only interactive one (nothing waits
            # behind it) or the first in line and a newcomer ahead of it could interrupt the pass (`_preemption`)
            whole = urgent and (alone or (s is subs[0] and self.interruptible))
            cap = min(share, piece) if shared else budget if whole else piece
            if cap <= 0:
                continue
            m = min(s.splittable, budget, cap)
            if s.left - m <= s.n_logits and s.left <= min(budget, cap):
                m = s.left  # the rest fits: take the logits rows too
            parts.append((s, m))
            budget -= m
            share -= m if shared else 0
        if not parts:  # one step larger than the budget left: it goes alone
            parts = [(subs[0], min(subs[0].left, self.backend.n_batch))]
        return parts

    def _steep(self) -> bool:
        """A CPU's verify curve (v(64) > 1.3 v(1), as `--k auto` calls it): with a KV stream per slot, long requests
        then run one at a time beside the interactive ones. Their rows cannot share a ubatch (each slot's are evaluated
        apart) and a row costs nearly the same in any pass, so interleaving them shared nothing and made each one's
        steps wait for the others' prefill, so four chats at once came out slower interleaved than one at a time
        (docs/results-history.md, 2026-11-27, night). On a flat curve (a GPU) they still share the passes."""
        v = self._v(np.array([1, 64]))
        return bool(v[1] > 1.3 * v[0])

    def _piece(self) -> int:
        """Prefill rows per pass: a whole batch when no editor's request came for `quiet_s` seconds, else about
        `piece_s` seconds at the measured ms per row."""
        if self.clock() - self._editor_at > self.quiet_s and not any(
            x.priority.editor for x in self.slots if x.index in self._active
        ):
            return self.backend.n_batch
        if self._ms_per_row is None:
            return FIRST_PIECE
        return int(min(self.backend.n_batch, max(MIN_PIECE, self.piece_s * 1e3 / self._ms_per_row)))


def _expected(a: float, k: int) -> np.ndarray:
    """E[tokens] of a pass verifying k' = 0..k draft tokens accepted in a row with chance a each: float [k + 1]."""
    return np.cumsum(a ** np.arange(k + 1, dtype=np.float64))
