"""Several generations at once on one loaded model: lanes, and the scheduler that shares verify passes among them.

A lane is one sequence of the target's context (`LlamaBackend.lane`: its own KV stream and tokens, or its cells in one
unified pool with `--kv-unified`) wrapped as a `Backend` (`SharedLane`) whose `decode` and `decode_branches` do not
call llama.cpp themselves: they hand
their rows to the `PassScheduler` and wait. Each lane's generation runs the ordinary engine (`SpeculativeEngine`,
unchanged) on a thread of its own, but only one of them runs Python at a time: a lane holds the *baton* while it
drafts, verifies and emits, and gives it back when it submits its next rows. When every active lane has submitted,
the scheduler puts their rows into one `llama_decode` (`LlamaBackend.decode_many`) and wakes them, the interactive
ones first. So the engine's step stays on one screen, lanes never race over the shared stores (the suffix store, the
K controller's statistics), and the model sees one batch per pass, as llama-server's `update_slots` builds it.

What a pass holds (`PassScheduler._compose`), in priority order (interactive requests — FIM, warm-ups, short replies —
first, then earliest deadline, then arrival):
- every decoding lane's verify rows (its newest token and its draft): a step is never split;
- prefill rows of the lanes still reading their prompts, cut into pieces: while an editor is in use (one of its
  requests ran in the last `quiet_s` seconds: `Priority.editor`), a piece of about `piece_s` seconds of prefill
  (measured per row, so an editor's next completion joins within about that); otherwise a whole batch (`n_batch`
  rows: on a CPU each pass has a fixed cost besides its rows, so pieces make a prompt slower to read); while
  an interactive lane is in the pass, a long request's prefill gets a time share instead: `share` of the passes'
  time (the rows its owed milliseconds buy at the measured cost per row, carried over from pass to pass), so it
  never starves and an interactive lane's steps run at about (1 - `share`) of their speed alone; an interactive
  lane with no other interactive lane beside it reads its prompt in whole batches (nothing waits behind it);
- with a KV stream per lane (the default), a pass never mixes interactive lanes' rows with the others': llama.cpp
  would run them as ubatches of their own, each paying the weights' read and more (`benchmarks/bench_kv_pool.py`),
  so the others get passes of their own once they are owed as much as such a pass costs (`share` of the
  interactive passes' time, paid by the measured time of theirs);
- a lane's second-branch pass (`decode_branches`) runs alone: branches are offered only while a lane is alone.

An interactive request that arrives while a pass of lanes that all come after it is under way (a long request's
piece; an interactive prompt read in a whole batch, by a newcomer with an earlier deadline) interrupts it
(`LlamaBackend.interrupt`, llama.cpp's abort callback): it starts within a graph node (milliseconds) instead of after
the rest of the pass (a piece lasts seconds at an agent's depth on a CPU), and the pass is evaluated again
after its first one (the time it had run is lost, once per such arrival). Passes paid as the long requests' share
while an interactive lane waits, and interactive verify steps, are never interrupted (`_preemption`).

K per lane is chosen jointly through `SharedLane.draft_limit`: each lane's best response to the rows and expected
tokens of the others' last passes on the measured verify curve, (E_lane(k) + T_others) / v(k + 1 + R_others)
maximised over k (v: the measured curve as a straight line), with E(k) = 1 + a + ... + a^k from the lane's
measured acceptance a (0.9 before any evidence); the lane's controller then
chooses K within it. As the batch grows, a lane's extra rows must beat the batch's own tokens per ms, so speculation
shrinks, and never below plain batched decoding (k = 0 is always allowed). After TurboSpec/SmartSpec (Liu et al.
2024, arXiv 2406.14066): speculate by goodput, less as the batch grows. That is for one KV pool (`--kv-unified`),
where a pass is one ubatch. With a KV stream per lane (the default) lanes of unequal rows are evaluated one
`llama_decode` each (`LlamaBackend.decode_many`), so a lane's draft costs the others nothing and its own controller's
K stands.

Lossless per lane: each lane's rows attend to its own cells only, so its logits are those of its own pass up to the
rounding of a larger batch (llama.cpp's kernels are not batch-invariant: near-ties, which `specdec check` explains);
each request's sampling has its own random generator (`sampling.make_rng(seed)` per generation), and a seeded one's K
does not follow its neighbours (`SharedLane.pinned`), so its output is the same whatever runs beside it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.errors import PassInterrupted

if TYPE_CHECKING:
    from specdec_cli.core.verify_curve import VerifyCurve

INTERACTIVE, BATCH = 0, 1  # priority classes: lower first
PIECE_S = 1.0  # seconds of prefill in one pass (its piece), so a request that arrives waits about that at most
SHARE = 0.1  # a long request's share of the passes' time while an interactive lane is in them (its guaranteed share)
SHARE_ROWS = 32  # a long request's prefill rows per pass with an interactive lane before any pass was timed
FIRST_PIECE = 256  # prefill rows per pass before any pass was timed
QUIET_S = 60.0  # no editor's request for this long: prefill pieces are whole batches
MIN_PIECE = 64  # smaller pieces cost a CPU more per row than they save a newcomer
ACCEPT_PRIOR = (9.0, 1.0)  # pseudo-counts (accepted, rejections): 0.9 before evidence (a lookup draft is mostly right or absent)
ACCEPT_DECAY = 0.9  # per verify pass: a lane's acceptance follows its current text


@dataclass(order=True)
class Priority:
    """A lane's place in line: class (INTERACTIVE before BATCH), then deadline (time.monotonic() s; inf: none),
    then arrival order. `editor`: an editor's request (a completion, a warm-up, one with a deadline), whose next one
    comes soon: prefill pieces stay short for `quiet_s` after it (not part of the order)."""

    cls: int = BATCH
    deadline: float = math.inf
    seq: int = 0
    editor: bool = field(default=False, compare=False)


@dataclass
class _Sub:
    """A lane's rows waiting for a pass: `tokens` int32 [m] of which `done` are evaluated (a prefill part is
    evaluated in pieces), `n_logits` rows at the end want logits; `branch`: a second branch (a pass of its own)."""

    lane: SharedLane
    tokens: np.ndarray
    n_logits: int
    branch: np.ndarray | None = None
    done: int = 0
    result: Any = None
    error: BaseException | None = None
    finished: bool = False

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def splittable(self) -> int:
        """Rows that may go in an earlier pass than the logits rows (a prefill's rows)."""
        return max(0, len(self.tokens) - self.n_logits - self.done)


class SharedLane:
    """A `Backend` for one lane: everything is the lane's own `LlamaBackend` (or fake lane), except `decode` and
    `decode_branches` (through the scheduler), `branches` (only while the lane is alone), `draft_limit` (the joint K
    bound) and `shared_rows` (rows of other lanes in its last pass). Use from the lane's thread while it holds the
    baton (`PassScheduler.enter`)."""

    def __init__(self, scheduler: PassScheduler, backend: Any, index: int) -> None:
        self._s = scheduler
        self.inner = backend
        self.index = index
        self.path = backend.path
        self.priority = Priority()
        self.pinned = False  # a seeded sampled request: its K must not follow its neighbours (`draft_limit`)
        self.shared_rows = 0
        self.last_rows = 1  # rows of its last verify pass
        self._pass_start: int | None = None  # len(tokens) before its last verify pass
        self._acc = list(ACCEPT_PRIOR)  # decayed (accepted tokens, rejections)

    # -- what goes through the scheduler ------------------------------------------------------------------------
    def decode(self, tokens: Sequence[int] | np.ndarray, n_logits: int = 0) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int32)
        if n_logits == len(toks):  # a verify pass (a prefill wants logits of its last rows only)
            self._pass_start, self.last_rows = len(self.inner.tokens), len(toks)
        elif n_logits:  # a prompt: its next pass verifies a draft; until then it counts as one row
            self._pass_start, self.last_rows = None, 1
        return self._s.submit(_Sub(self, toks, n_logits))

    def decode_branches(self, tokens: Sequence[int] | np.ndarray, branch: Sequence[int] | np.ndarray) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int32)
        self._pass_start, self.last_rows = len(self.inner.tokens), len(toks)
        return self._s.submit(_Sub(self, toks, len(toks), branch=np.asarray(branch, dtype=np.int32)))

    def truncate(self, n: int, *, branch: bool = False) -> None:
        start, self._pass_start = self._pass_start, None
        if start is not None and self.last_rows > 1:  # after a verify pass: its accepted drafts, for the joint K
            accepted = max(0, min(n - start - 1, self.last_rows - 1))
            self._acc[0] = ACCEPT_DECAY * self._acc[0] + accepted
            self._acc[1] = ACCEPT_DECAY * self._acc[1] + (accepted < self.last_rows - 1)
        self.inner.truncate(n, branch=branch)

    @property
    def acceptance(self) -> float:
        """This lane's chance that a draft token is accepted, given the one before it was (a geometric fit)."""
        acc, rej = self._acc
        return acc / (acc + rej)

    @property
    def branches(self) -> bool:
        return self.inner.branches and self._s.alone(self)

    @property
    def draft_limit(self) -> int:
        return self._s.draft_limit(self)

    # -- the lane's own backend ----------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.inner.n_vocab

    @property
    def n_ctx(self) -> int:
        return self.inner.n_ctx

    @property
    def n_batch(self) -> int:
        return self.inner.n_batch

    @property
    def n_threads(self) -> int:
        return self.inner.n_threads

    @property
    def tokens(self) -> np.ndarray:
        return self.inner.tokens

    def __getattr__(self, name: str) -> Any:  # tokenize, piece, is_eog, snapshot, save_state, lltokenizer, ...
        return getattr(self.inner, name)


class PassScheduler:
    """The lanes of one target and the passes they share.

    Args:
        backend: the target's root lane (`LlamaBackend` made with n_lanes = `n_lanes`, or a fake with `lane(i)` and
            `decode_many`).
        n_lanes: lanes (`specdec serve --parallel`).
        curve: the target's measured verify curve (prices the joint K); None: an affine guess, v(b) = 1 + 0.1 (b - 1).
        clock: seconds, monotonic.
        piece_s, quiet_s, share, share_rows: see the module's docstring.

    Thread use: a lane's thread calls `enter` before using its lane, the lane's `decode` (through `submit`) while
    holding the baton, and `leave` when done; `run` is `enter` + a function + `leave`.
    """

    def __init__(self, backend: Any, n_lanes: int, *, curve: VerifyCurve | None = None,
                 clock: Callable[[], float] = time.perf_counter, piece_s: float = PIECE_S,
                 quiet_s: float = QUIET_S, share: float = SHARE, share_rows: int = SHARE_ROWS) -> None:
        self.backend = backend
        self.lanes = [SharedLane(self, backend.lane(i), i) for i in range(n_lanes)]
        self.curve = curve
        self.clock = clock
        self.piece_s, self.quiet_s, self.share, self.share_rows = piece_s, quiet_s, share, share_rows
        self._editor_at = -math.inf  # when an editor's request last started or ended (clock s)
        self._owed_ms = 0.0  # time owed to long requests' prefill while interactive lanes run (negative: ahead)
        # a KV stream per lane (`LlamaBackend.kv_streams`): llama.cpp runs a pass's lanes as ubatches of equal rows per
        # stream, so a long request's rows beside an interactive lane's cost a ubatch of their own and more: they get
        # passes of their own instead
        self.split = bool(getattr(backend, "kv_streams", False))
        self._cv = threading.Condition(threading.Lock())
        self._holder: SharedLane | None = None  # the lane running Python now (or the lane whose thread runs a pass)
        self._passing = False
        self._stop_below: Priority | None = None  # a newcomer ahead of this may interrupt the pass under way
        self.interrupted = 0  # passes interrupted
        self._ready: list[tuple[Priority, int, SharedLane]] = []  # lanes waiting for the baton (a heap)
        self._subs: dict[int, _Sub] = {}  # lane index -> its rows waiting for a pass
        self._active: set[int] = set()
        self._order = itertools.count()
        self._ms_per_row: float | None = None  # prefill ms per row, from passes that were mostly prefill
        self._line: tuple[float, float] | None = None  # (ms, ms per row): the curve as a line, for `draft_limit`
        self.passes = 0  # llama_decode calls made
        self.log: list[tuple[tuple[int, int], ...]] = []  # per pass: (lane, rows) of each part (the last 256)

    # -- a lane's thread -----------------------------------------------------------------------------------------
    def enter(self, lane: SharedLane, priority: Priority | None = None, *, preempt: bool = True) -> None:
        """`lane`'s generation starts: wait for the baton (after the lanes before it in line). An interactive one
        (`preempt`) interrupts a pass under way whose lanes all come after it (`_preemption`): that pass is evaluated
        again after the newcomer's first pass, which starts within a graph node (milliseconds) instead of after the
        rest of another's prefill piece (or of a whole batch)."""
        with self._cv:
            if priority is not None:
                lane.priority = priority
            if lane.priority.editor:
                self._editor_at = self.clock()
            if preempt and lane.priority.cls == INTERACTIVE and self._stop_below is not None \
                    and lane.priority < self._stop_below:
                self._stop_below = None
                self.backend.interrupt()
            self._active.add(lane.index)
            self._want(lane)
            if self._holder is None and not self._passing:
                self._hand_over()
            while self._holder is not lane:
                self._cv.wait()

    def leave(self, lane: SharedLane) -> None:
        """`lane`'s generation ended (or failed): give the baton back."""
        with self._cv:
            if lane.priority.editor:
                self._editor_at = self.clock()
            self._active.discard(lane.index)
            self._subs.pop(lane.index, None)
            lane.shared_rows = 0
            if self._holder is lane:
                self._holder = None
                self._next()

    def run(self, lane: SharedLane, fn: Callable[[], Any], priority: Priority | None = None) -> Any:
        """Run `fn()` on the calling thread as `lane`, holding the baton (what touches the shared stores)."""
        self.enter(lane, priority, preempt=False)  # (what it runs is short: a pass under way may finish)
        try:
            return fn()
        finally:
            self.leave(lane)

    def submit(self, sub: _Sub) -> np.ndarray:
        """Hand `sub`'s rows to the next passes, wait until they are evaluated and the baton is back; the logits.
        The passes run on the threads waiting here (`_due`), never on a thread that only enters or leaves: a lane
        whose request ended must be free to take the next one (an editor's next completion waits for that lane),
        not run another lane's prefill to its end. Raises what the pass raised for these rows."""
        lane = sub.lane
        with self._cv:
            assert self._holder is lane, "a lane decodes only while it holds the baton"
            self._subs[lane.index] = sub
            self._holder = None
            self._next()
            while not (sub.finished and self._holder is lane):
                if self._due():
                    self._pass()
                    self._next()
                else:
                    self._cv.wait()
        if sub.error is not None:
            raise sub.error
        return sub.result

    # -- what the lanes read ---------------------------------------------------------------------------------------
    @property
    def interruptible(self) -> bool:
        """The backend can stop a pass under way (`LlamaBackend.interrupt`)."""
        return bool(getattr(self.backend, "interruptible", False))

    def alone(self, lane: SharedLane) -> bool:
        """No other lane is generating (then a second branch is offered: it needs a pass of its own)."""
        return len(self._active) <= 1

    def draft_limit(self, lane: SharedLane) -> int:
        """The most draft tokens `lane` should verify in its next pass: all a batch can take while it is alone (or
        `pinned`: a seeded sampled request, whose draws follow its K, gives the same output whatever runs beside it;
        or with a KV stream per lane, `split`: its rows are evaluated apart, so they cost what they cost alone and
        its controller's K is the one to use);
        with others, the k maximising (E(k) + T) / v(k + 1 + R) (R, T: the other lanes' rows in their last passes and
        the tokens those are expected to give; a lane still reading its prompt adds its next piece to R and nothing
        to T, and its piece gives way to verify rows, so beside a long prefill a draft's rows are nearly free)."""
        top = min(lane.n_batch - 1, lane.inner.draft_limit)  # a recurrent target: its snapshots
        others = [x for x in self.lanes if x is not lane and x.index in self._active]
        if not others or lane.pinned or self.split:  # split: its rows are evaluated apart, priced as alone
            return top
        rows = tokens = reading = 0
        for x in others:
            sub = self._subs.get(x.index)
            if sub is not None and len(sub.tokens) > sub.n_logits:  # reading its prompt: a piece, giving no token
                reading += min(sub.left, self._piece())
            else:
                rows += max(1, x.last_rows)
                tokens += _expected(x.acceptance, max(1, x.last_rows) - 1)[-1]
        top = max(0, min(top, lane.n_batch - 1 - rows))  # a prefill piece yields the batch to verify rows
        rows += min(reading, lane.n_batch - 1 - rows)
        v = self._v(np.arange(rows + 1, rows + top + 2))  # [top + 1] ms of a pass over R + k + 1 rows
        rate = (_expected(lane.acceptance, top) + tokens) / v
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

    # -- the baton and the passes (lock held) ----------------------------------------------------------------------
    def _want(self, lane: SharedLane) -> None:
        heapq.heappush(self._ready, (lane.priority, next(self._order), lane))

    def _hand_over(self) -> bool:
        if not self._ready:
            return False
        self._holder = heapq.heappop(self._ready)[2]
        self._cv.notify_all()
        return True

    def _next(self) -> None:
        """The baton is free (or a pass ended): the next lane in line runs; else wake the lanes waiting for a pass,
        one of which runs it when every active lane waits (`_due`)."""
        if not self._hand_over():
            self._cv.notify_all()

    def _due(self) -> bool:
        """A pass should start now: no lane runs Python or is in line for the baton, no pass is under way, and every
        active lane has its rows waiting (a lane still entering submits soon)."""
        return self._holder is None and not self._passing and not self._ready and bool(self._subs) \
            and len(self._subs) >= len(self._active)

    def _pass(self) -> None:
        """Compose one pass, evaluate it (the lock released meanwhile, `_passing` set), and put the lanes whose rows
        are all evaluated in line for the baton."""
        parts = self._compose()
        self._passing = True
        self._stop_below = self._preemption(parts)
        may_stop = self._stop_below is not None
        self._cv.release()
        error: BaseException | None = None
        t0 = self.clock()
        try:
            if len(parts) == 1 and parts[0][0].branch is not None:
                sub = parts[0][0]
                results = [sub.lane.inner.decode_branches(sub.tokens, sub.branch)]
            else:
                results = self.backend.decode_many([(s.lane.inner, s.tokens[s.done : s.done + m], s.n_logits
                                                     if s.done + m == len(s.tokens) else 0) for s, m in parts])
        except BaseException as e:  # noqa: BLE001 (delivered to every lane of the pass, which raises it)
            error, results = e, [None] * len(parts)
        ms = (self.clock() - t0) * 1e3
        self._cv.acquire()
        self._passing = False
        if may_stop:
            self._stop_below = None
            self.backend.interrupt(False)  # (one asked for as this pass ended must not stop the next)
            if isinstance(error, PassInterrupted):  # nothing evaluated: the same rows go again, after the newcomer's
                self.interrupted += 1
                return
        self.passes += 1
        self.log = [*self.log[-255:], tuple((s.lane.index, m) for s, m in parts)]
        total = sum(m for _, m in parts)
        prefill = sum(m for s, m in parts if s.n_logits == 0 or s.done + m < len(s.tokens))
        self._account(parts, ms, total)
        if error is None and prefill >= max(MIN_PIECE, total // 2):
            per = ms / total
            self._ms_per_row = per if self._ms_per_row is None else 0.7 * self._ms_per_row + 0.3 * per
        for (sub, m), result in zip(parts, results, strict=False):
            lane = sub.lane
            lane.shared_rows = total - m
            if error is not None:
                sub.error, sub.finished = error, True
            else:
                sub.done += m
                if sub.done == len(sub.tokens):
                    sub.result, sub.finished = result, True
            if sub.finished:
                self._subs.pop(lane.index, None)
                self._want(lane)

    def _preemption(self, parts: list[tuple[_Sub, int]]) -> Priority | None:
        """Who may interrupt the pass of `parts` (`enter`): an interactive newcomer ahead of every lane in it, unless
        an interactive lane waits outside it (it is then the long requests' share, paid while that lane waits) or
        an interactive lane's part has logits rows (a verify step is short: it finishes); None: nobody."""
        if not self.interruptible:
            return None
        inside = {id(s) for s, _ in parts}
        if any(s.lane.priority.cls == INTERACTIVE and id(s) not in inside for s in self._subs.values()):
            return None
        if any(s.lane.priority.cls == INTERACTIVE and s.n_logits and s.done + m == len(s.tokens) for s, m in parts):
            return None
        return min(s.lane.priority for s, _ in parts)

    def _account(self, parts: list[tuple[_Sub, int]], ms: float, total: int) -> None:
        """Keep the long requests' time share while an interactive lane is in the passes. Split (`split`): owed +=
        share x an interactive pass's ms while they wait, -= the ms of each pass of theirs, the ones between an
        editor's requests too (down to one piece ahead: the piece an editor's next request waits for as it arrives
        counts as the share of its passes, which then need not stop for another). Else: owed += share x the pass's
        ms - the ms its long prefill rows took (rows x the measured ms per row), within one piece either way.
        Nothing owed once no interactive lane shares the passes (the share is for the time they are slowed)."""
        if self.split:
            inter = any(s.lane.priority.cls == INTERACTIVE for s, _ in parts)
            if not inter:  # the long requests' pass, or theirs between an editor's requests: it pays what is owed
                self._owed_ms = max(-self.piece_s * 1e3, self._owed_ms - ms)  # (ahead by one piece at most)
            elif any(s.lane.priority.cls != INTERACTIVE for s in self._subs.values()):  # they waited for it
                self._owed_ms += self.share * ms
            return
        shared = any(s.lane.priority.cls == INTERACTIVE for s, _ in parts) and \
            any(s.lane.priority.cls != INTERACTIVE and s.splittable for s in self._subs.values())
        if not shared:
            self._owed_ms = 0.0
            return
        rows = sum(m for s, m in parts if s.lane.priority.cls != INTERACTIVE and s.splittable)
        per = self._ms_per_row if self._ms_per_row is not None else ms / max(1, total)
        bound = self.piece_s * 1e3
        self._owed_ms = min(bound, max(-bound, self._owed_ms + self.share * ms - rows * per))

    def _share(self) -> int:
        """Prefill rows a long request may add to a pass with an interactive lane: what its owed time buys."""
        if self._ms_per_row is None:
            return self.share_rows
        if self._owed_ms <= 0.0:
            return 0
        return max(1, math.ceil(self._owed_ms / self._ms_per_row))

    def _compose(self) -> list[tuple[_Sub, int]]:
        """(sub, rows it gets) for the next pass; see the module's docstring."""
        subs = sorted(self._subs.values(), key=lambda s: s.lane.priority)
        branch = next((s for s in subs if s.branch is not None), None)
        if branch is not None:
            return [(branch, len(branch.tokens))]
        budget = self.backend.n_batch
        inter = [s for s in subs if s.lane.priority.cls == INTERACTIVE]
        rest = [s for s in subs if s.lane.priority.cls != INTERACTIVE]
        if self.split and len(rest) > 1 and self._steep():
            rest = rest[:1]  # one long request at a time, the first in line: see `_steep`
            subs = inter + rest
        interactive = bool(inter) and bool(rest)
        piece, share = self._piece(), self._share()
        if interactive and self.split:  # a pass for the interactive lanes, or one for the others when they are owed it
            per = self._ms_per_row if self._ms_per_row is not None else 0.0
            steps = sum(s.left for s in rest if s.splittable == 0)
            cost = (self._v(np.array([steps]))[0] if steps else 0.0) + \
                (MIN_PIECE * per if any(s.splittable for s in rest) else 0.0)
            if self._owed_ms >= cost:
                subs = rest
                piece = min(piece, max(MIN_PIECE, int(self._owed_ms / per))) if per > 0 else piece
            else:
                subs = inter
            interactive = False
        # an interactive lane alone among the interactive ones reads its prompt in whole batches: nothing waits
        # behind it that a piece would let in sooner, and a CPU reads a whole batch cheaper per row than a piece
        alone = sum(1 for x in self.lanes if x.index in self._active and x.priority.cls == INTERACTIVE) <= 1
        parts: list[tuple[_Sub, int]] = []
        for s in subs:  # whole steps first: the rows that want logits, with whatever prefill precedes them
            if s.splittable == 0 and s.left <= budget:
                parts.append((s, s.left))
                budget -= s.left
        reading = False  # an interactive lane earlier in line reads its prompt in this pass
        for s in subs:  # then prefill pieces
            if s.splittable == 0 or budget <= 0:
                continue
            urgent = s.lane.priority.cls == INTERACTIVE
            if urgent and reading and self.split:
                continue  # KV streams: one interactive prompt at a time (its piece would be a llama_decode of its own)
            reading = reading or urgent
            shared = interactive and not urgent  # a long request beside an interactive one
            # an interactive lane reads its prompt in whole batches when it is the only interactive one (nothing waits
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
        """A CPU's verify curve (v(64) > 1.3 v(1), as `--k auto` calls it): with a KV stream per lane, long requests
        then run one at a time beside the interactive ones. Their rows cannot share a ubatch (each lane's are evaluated
        apart) and a row costs nearly the same in any pass, so interleaving them shared nothing and made each one's
        steps wait for the others' prefill, so four chats at once came out slower interleaved than one at a time
        (docs/results-history.md, 2026-11-27, night). On a flat curve (a GPU) they still share the passes."""
        v = self._v(np.array([1, 64]))
        return bool(v[1] > 1.3 * v[0])

    def _piece(self) -> int:
        """Prefill rows per pass: a whole batch when no editor's request came for `quiet_s` seconds, else about
        `piece_s` seconds at the measured ms per row."""
        if self.clock() - self._editor_at > self.quiet_s and \
                not any(x.priority.editor for x in self.lanes if x.index in self._active):
            return self.backend.n_batch
        if self._ms_per_row is None:
            return FIRST_PIECE
        return int(min(self.backend.n_batch, max(MIN_PIECE, self.piece_s * 1e3 / self._ms_per_row)))


def _expected(a: float, k: int) -> np.ndarray:
    """E[tokens] of a pass verifying k' = 0..k draft tokens accepted in a row with chance a each: float [k + 1]."""
    return np.cumsum(a ** np.arange(k + 1, dtype=np.float64))
