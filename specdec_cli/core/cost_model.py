"""The learnt cost model behind `--k auto`: what a step of K draft tokens is expected to cost and yield.

`CostModel` estimates, from the engine's `Step` records, the target's verify cost v(b) by batch size, the draft
model's cost per token and per call, and the acceptance a_i and fill q_i by draft position: pooled over every draft,
for the draft model's drafts alone, and for lookup drafts by source and by the length of their match (`bucket_of`);
`expected_tokens`, `expected_ms` and `best_k` turn them into the K with the highest expected tokens/s. The controllers
that use it are in `specdec_cli.core.controller`; the reasoning (formulas, priors, why the CPU's verify curve is treated
as it is) is in docs/design.md.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.records import Source
from specdec_cli.core.verify_curve import DRIFT, WATCH_CONTEXT

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from specdec_cli.core.records import Step
    from specdec_cli.core.verify_curve import VerifyCurve

K_LIMIT = 64  # largest K accepted anywhere (--k, tune, k_max)
CURVE_PRIOR = 4.0  # a measured curve's v(b) counts as this many passes at b against the passes timed since
ATTENTION_MIN_SPREAD = 0.05  # the passes separate load from attention when their features are this far from collinear
DEFAULT_K_MAX = 16
MARGIN = 0.03  # hysteresis: K > 0 must beat plain decoding by this fraction
BUCKET_EDGES = np.array([1, 2, 3, 5, 9, 17, 33])  # lower edges of the match-length buckets
REJECTION_DECAY = 0.5  # a rejected draft halves its bucket's evidence before it is counted
# the prior mean of a_1 after a match of 1, 2, 3-4 tokens is at most this (then the pooled a_1): on free text such
# matches are function words and common phrases, right a third of the time, and on a CPU a wrong draft costs most of
# a plain step, so a short match is verified only once its own evidence says it pays
SHORT_MATCH_PRIOR = np.array([0.3, 0.4, 0.5, 1.0, 1.0, 1.0, 1.0])
# sources whose drafts are right from the first token whatever their match length: a prediction is the user's own
# statement of the output (its match length is 1 at the start of every reply and after every re-sync)
SOURCE_PRIOR: dict[str, float] = {Source.predict: 0.9}


# --------------------------------------------------------------------------------------------------------------
# The pure math (shapes: k_max draft positions; K = 0..k_max)


def expected_tokens(accept: np.ndarray, fill: np.ndarray | None = None) -> np.ndarray:
    """E[tokens | K] for K = 0..k_max: float [k_max + 1] from accept a_i and fill q_i, float [k_max] each."""
    p = np.asarray(accept, dtype=np.float64)
    if fill is not None:
        p = p * np.asarray(fill, dtype=np.float64)
    return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(p))))  # [k_max + 1]


def expected_ms(verify: np.ndarray, draft_per_token: float, draft_call: float, fill: np.ndarray) -> np.ndarray:
    """E[ms | K] for K = 0..k_max: float [k_max + 1].

    verify: float [k_max + 1], v(b) for b = 1..k_max + 1.  fill: float [k_max], q_i.
    """
    q = np.asarray(fill, dtype=np.float64)  # [k_max]
    v = np.asarray(verify, dtype=np.float64)  # [k_max + 1]
    at_least = np.concatenate(([1.0], np.cumprod(q)))  # [k_max + 1] P(L >= l)
    stops = np.concatenate(([0.0], np.cumsum(at_least[:-1] * (1.0 - q) * v[:-1])))  # [k_max + 1] sum_{l<K} P(L=l) v
    verify_k = stops + at_least * v  # [k_max + 1]
    draft_k = np.concatenate(([0.0], draft_call + draft_per_token * np.cumsum(at_least[1:])))  # [k_max + 1]
    return verify_k + draft_k


def best_k(rates: np.ndarray, margin: float = MARGIN) -> int:
    """argmax of rates [k_max + 1] (tokens/s by K), but 0 unless the best K > 0 beats K = 0 by `margin`."""
    k = int(np.argmax(rates))
    return k if k > 0 and rates[k] > (1.0 + margin) * rates[0] else 0


def meet(
    steps: Sequence[tuple[int, np.ndarray | None, int]], predict: Callable[[int, int], float], margin: float = MARGIN
) -> list[tuple[int, int]]:
    """Rows to evaluate of each of several sequences' verify steps in one pass (the server's slots, each K chosen
    alone), and the call each goes in. A call over KV streams reads the weights once for all its rows, which must be
    as many for every stream in it, and every stream's attention in it spans the deepest stream's cells (llama.cpp's
    `get_n_kv`): steps whose K differs pay a call each, and a shallow sequence beside a deep one pays for the deep
    one's cells. Returns the plan with the most expected tokens per ms: each step that can be cut (an estimate given)
    cut to a common count where that makes fewer calls, or all kept whole (a cut taken only when it beats that by
    `margin`), the steps of each row count split into calls by depth where that is cheaper. Cutting a draft is
    lossless; a cut keeps one draft token at least (a step cut to a plain one verifies nothing, and its controller,
    which learns acceptance from verified tokens only, would draft the same and see it cut again, every step).

    steps: per verify step (its rows, K + 1; float [rows] E[tokens] when only its first j + 1 rows are evaluated,
    `KController.expected`, or None: never cut; tokens in its sequence's cache). predict(b, depth): ms of one call
    over b rows whose deepest sequence holds `depth` tokens (`VerifyCurve.predict`). Returns per step (its rows,
    1..rows; its call, 0..: steps of one call have equal rows).
    """

    def calls(plan: list[int]) -> tuple[float, list[int]]:
        """The cheapest calls for `plan`: (their ms, each step's call). The steps of one row count, by depth, split
        into runs (a run costs by its deepest step, so the cheapest split keeps neighbours in depth together)."""
        ms, call, first = 0.0, [0] * len(plan), 0
        for r in sorted(set(plan)):
            group = sorted((i for i, x in enumerate(plan) if x == r), key=lambda i: steps[i][2])
            best: list[tuple[float, list[int]]] = [(0.0, [])]  # best[j]: (ms, where each run starts) for group[:j]
            for j in range(1, len(group) + 1):
                deepest = steps[group[j - 1]][2]
                prices = [best[i][0] + predict(r * (j - i), deepest) for i in range(j)]  # the last run: group[i:j]
                i = int(np.argmin(prices))
                best.append((prices[i], [*best[i][1], i]))
            total, cuts = best[-1]
            ms += total
            for k, i in enumerate(group):
                call[i] = first + sum(1 for c in cuts if c <= k) - 1
            first += len(cuts)
        return ms, call

    def rate(plan: list[int]) -> tuple[float, int, list[int]]:
        ms, call = calls(plan)
        tokens = sum(float(e[r - 1]) if e is not None else float(r) for r, (_, e, _) in zip(plan, steps, strict=True))
        return tokens / ms, max(call) + 1, call

    whole = [r for r, _, _ in steps]
    best_rate, n_calls, call = rate(whole)
    best, best_rate = list(zip(whole, call, strict=True)), (1.0 + margin) * best_rate
    for cap in range(max(whole) - 1, 1, -1):  # (down to 2 rows: the last committed token and one draft token)
        plan = [min(r, cap) if e is not None else r for r, e, _ in steps]
        x, n, call = rate(plan)
        if n < n_calls and x > best_rate:  # fewer calls: K itself is not redone
            best, best_rate = list(zip(plan, call, strict=True)), x
    return best


# --------------------------------------------------------------------------------------------------------------
# The learnt cost model


@dataclass(frozen=True, slots=True)
class CostPrior:
    """What the model assumes before measuring.

    Attributes:
        acceptance: prior mean of a_1 (later positions borrow from the one before).
        strength: pseudo-counts behind each prior mean (a_i and q_i).
        verify_slope: alpha in v(b) = v(1)(1 + alpha (b - 1)), used while fewer than two batch sizes are measured.
        draft_ms_per_token: d until the first draft is timed (0: optimistic, so the first steps try drafting).
        draft_ms_per_call: c until the first draft is timed.
        verify_ms: known (b, ms) points, each counted as one observation.
    """

    acceptance: float = 0.7
    strength: float = 2.0
    verify_slope: float = 0.5
    draft_ms_per_token: float = 0.0
    draft_ms_per_call: float = 0.0
    verify_ms: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class _Point:
    ms: float  # EWMA of verify_ms at this batch size
    n: int  # observations
    last: int  # step index of the last observation
    verified: bool = False  # measured by a verify step (not only by a prefill, nor given by a prior)


def _isotonic(y: list[float], w: list[float]) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of y (pool adjacent violators): float [len(y)]."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for yi, wi in zip(y, w, strict=True):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    return np.array([v for v, _, c in blocks for _ in range(int(c))])


@dataclass
class CostModel:
    """Estimates v(b), d, c, a_i and q_i from `Step` records and turns them into expected tokens/s by K."""

    k_max: int = DEFAULT_K_MAX
    half_life: float = 32.0
    prior: CostPrior = field(default_factory=CostPrior)
    curve: VerifyCurve | None = None  # the measured v(b) (`verify_curve.measure`): its shape is kept as it is

    def __post_init__(self) -> None:
        self.decay = 0.5 ** (1.0 / self.half_life)
        self.steps = 0
        self.points: dict[int, _Point] = {b: _Point(ms, 1, -1) for b, ms in self.prior.verify_ms if b >= 1}
        self._curve: np.ndarray | None = None  # verify_curve() of the current points (None: to be fitted)
        self._base: tuple[VerifyCurve, np.ndarray] | None = None  # (the measured curve, its v(b) for b <= k_max + 1)
        self._draft = np.zeros(5)  # decayed sums over draft-model calls: w, w n, w n^2, w ms, w n ms
        self._acc = np.zeros((2, self.k_max))  # [accepted, verified] by position, every draft
        self._fill = np.zeros((2, self.k_max))  # [proposed, asked] by position, every draft
        self._acc_m = np.zeros((2, self.k_max))  # [accepted, verified] by position, drafts without evidence (a model)
        self._fill_m = np.zeros((2, self.k_max))  # [proposed, asked] by position, drafts without evidence
        # lookup drafts by source: float [bucket, accepted/verified, position] (prompt lookup, suffix store and a
        # prediction are right at different rates after a match of the same length)
        self._acc_b: dict[str, np.ndarray] = {}
        self._acc_b_run: dict[str, np.ndarray] = {}  # the same, counted by this model alone (never restored)
        self._run_chains: dict[str, list[np.ndarray]] = {}  # run_acceptance by source: the chains of buckets 0..len-1
        self.by_source: dict[str, dict[str, float]] = {}
        self._memo: dict[tuple[int | None, str], np.ndarray] = {}  # acceptance() until the counts change
        # the attention term of a measured curve (`attention`): decayed sums over verify passes of the features
        # f1 = curve(b), f2 = b x (context - the curve's context) / 1000 and the ms y: f1 f1, f1 f2, f2 f2, f1 y, f2 y
        self._attn = np.zeros(5)
        self.context = 0  # tokens in the KV cache before the next pass (the last pass's context + its tokens)
        self._v1 = (0.0, 0)  # (mean timed / predicted, passes) of the b = 1 passes at short contexts (`drifted`)

    # ---- learning

    def observe(self, step: Step, bucket: int | None = None, source: str | None = None) -> None:
        """Learn from one step. `bucket`: the match-length bucket of its draft (`bucket_of`), None without evidence
        (a draft model's draft, or a plain step); `source`: the lookup source it came from (default `step.source`).
        """
        n = len(step.drafted)
        self.steps += 1
        self._memo.clear()
        for counts in (self._acc, self._fill, self._acc_m, self._fill_m):
            counts *= self.decay  # evidence fades while a source is not used
        if bucket is not None and n:
            for counts in (self.bucket_counts(source or step.source), self._run_counts(source or step.source)):
                acc = counts[bucket]
                acc *= self.decay  # per observation of this bucket: rare buckets keep their evidence
                m = min(step.n_accepted, self.k_max)
                if step.rejected and m < self.k_max:
                    acc *= REJECTION_DECAY  # multiplicative decrease: a rejection weighs more than a long good run
                    acc[1, m] += 1.0
                acc[:, :m] += 1.0
            del self._run_chains.get(source or step.source, [])[bucket:]  # run_acceptance's chains from here up
        if not step.shared_rows or self.curve is None:
            # a pass shared with other sequences times their rows too: with a measured curve, it is not this step's
            # cost to learn; without one, it is the only timing there is (K then shrinks with the others' rows)
            # a pass's cost includes its rollback (a recurrent state's checkpoint restored and replayed: `rollback_ms`)
            self._observe_verify(step.batch_size, step.verify_ms + step.rollback_ms)
            self._observe_attention(step)
            if (
                self.curve is not None
                and step.batch_size == 1
                and step.verify_ms > 0.0
                and step.n_past <= WATCH_CONTEXT
            ):
                v1, v1_n = self._v1
                ratio = step.verify_ms / self.curve.predict(1, step.n_past or self.curve.context)  # at its depth
                self._v1 = (v1 + (ratio - v1) / (v1_n + 1), v1_n + 1)
        model = bucket is None and step.k > 0  # a draft without evidence: the draft model's
        if model:
            self._draft = self._draft * self.decay + np.array([1.0, n, n * n, step.draft_ms, n * step.draft_ms])
        for acc, fill in (
            ((self._acc, self._fill), (self._acc_m, self._fill_m)) if model else ((self._acc, self._fill),)
        ):
            _count(acc, fill, step, n, self.k_max)
        if step.k > 0:
            src = self.by_source.setdefault(step.source or "?", {"steps": 0, "drafted": 0, "accepted": 0, "ms": 0.0})
            src["steps"] += 1
            src["drafted"] += n
            src["accepted"] += step.n_accepted
            src["ms"] += step.draft_ms

    def bucket_counts(self, source: str) -> np.ndarray:
        """The lookup source's decayed counts, float [bucket, accepted/verified, position] (a view; created empty)."""
        counts = self._acc_b.get(source)
        if counts is None:
            counts = self._acc_b[source] = np.zeros((len(BUCKET_EDGES), 2, self.k_max))
        return counts

    def _run_counts(self, source: str) -> np.ndarray:
        counts = self._acc_b_run.get(source)
        if counts is None:
            counts = self._acc_b_run[source] = np.zeros((len(BUCKET_EDGES), 2, self.k_max))
        return counts

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        """A prefill of `n_evaluated` tokens in `ms` milliseconds, evaluated in chunks of at most `n_batch`: one
        measurement of v(min(n_evaluated, n_batch)) (a longer prefill: its mean cost per chunk)."""
        if n_evaluated < 2 or ms <= 0.0:
            return
        b = min(n_evaluated, n_batch)
        self._observe_verify(b, ms * b / n_evaluated, verified=False)

    def _observe_attention(self, step: Step) -> None:
        if self.curve is None or step.n_past <= 0 or step.verify_ms <= 0.0:
            return
        self.context = step.n_past + step.n_accepted + 1
        f1 = self.curve.at(step.batch_size)
        f2 = step.batch_size * max(step.n_past - self.curve.context, 0) / 1000.0
        y = step.verify_ms
        self._attn = self._attn * self.decay + np.array([f1 * f1, f1 * f2, f2 * f2, f1 * y, f2 * y])
        self._curve = None

    def attention(self) -> tuple[float, float] | None:
        """(s, A): the passes timed so far fitted as v(b, L) = s curve(b) + A b (L - L0) / 1000, L0 the context the
        curve was measured at (256), A in ms per row per 1,000 tokens of context (llama.cpp's CPU attention runs
        every row of a pass over the whole KV cache: a pass of b rows at a long context pays ~b x one row's
        attention). Decayed least squares over the verify passes. None while the passes cannot tell load (s) from
        attention (A): no measured curve, no pass past L0, or passes whose sizes keep the two collinear; then
        `verify_curve` scales the curve by load alone, as it always did."""
        s11, s12, s22, s1y, s2y = self._attn
        det = s11 * s22 - s12 * s12
        if s22 <= 0.0 or det <= ATTENTION_MIN_SPREAD * s11 * s22:
            return None
        s = (s22 * s1y - s12 * s2y) / det
        a = (s11 * s2y - s12 * s1y) / det
        return (float(s), float(a)) if s > 0.0 and a > 0.0 else None

    def _observe_verify(self, b: int, ms: float, verified: bool = True) -> None:
        if ms <= 0.0:
            return
        self._curve = None  # the points change: refit on the next verify_curve()
        p = self.points.get(b)
        if p is None:
            self.points[b] = _Point(ms, 1, self.steps, verified)
            return
        p.n += 1
        p.last = self.steps
        p.verified = p.verified or verified
        if p.n > 3:
            ms = min(ms, 3.0 * p.ms)  # one hiccup (swap, another process) must not double the estimate
        p.ms += max(1.0 / p.n, 1.0 - self.decay) * (ms - p.ms)

    # ---- carrying what was learnt to a later process (`specdec_cli.stores.learnt`)

    def state(self) -> dict[str, Any]:
        """Everything learnt, JSON-serialisable: the verify points, the draft-cost sums and the decayed acceptance and
        fill counts (float [2, k_max]; for the draft model's drafts alone; by lookup source and match-length bucket
        float [7, 2, k_max])."""
        return {
            "k_max": self.k_max,
            "verify": [[b, p.ms, p.n, p.verified] for b, p in sorted(self.points.items())],
            "draft": self._draft.tolist(),
            "acc": self._acc.tolist(),
            "fill": self._fill.tolist(),
            "acc_model": self._acc_m.tolist(),
            "fill_model": self._fill_m.tolist(),
            "acc_by_source": {source: counts.tolist() for source, counts in self._acc_b.items()},
        }

    def restore(self, state: dict[str, Any], max_weight: float) -> None:
        """Start from `state()` of an earlier model as a prior: every estimate keeps its value, but its evidence is
        capped at `max_weight` observations (a verify point counts as at most 3), so a few steps measured now
        outweigh it. The points count as measured (no plain step to time v(1) first).

        Raises ValueError (shapes, k_max) or TypeError/KeyError when `state` is not a `state()` of this k_max.
        """
        if int(state["k_max"]) != self.k_max:
            raise ValueError(f"learnt for k_max {state['k_max']}, not {self.k_max}")
        acc, fill = np.asarray(state["acc"], float), np.asarray(state["fill"], float)
        # a state saved before per-source estimates has no draft-model-only counts and its lookup counts are not
        # by source: those start afresh, the verify curve and the rest carry over
        zeros = np.zeros_like(self._acc).tolist()
        acc_m = np.asarray(state.get("acc_model", zeros), float)
        fill_m = np.asarray(state.get("fill_model", zeros), float)
        draft = np.asarray(state["draft"], float)
        acc_b = {str(k): np.asarray(v, float) for k, v in dict(state.get("acc_by_source", {})).items()}
        bucket_shape = (len(BUCKET_EDGES), 2, self.k_max)
        if (
            any(a.shape != self._acc.shape for a in (acc, fill, acc_m, fill_m))
            or draft.shape != self._draft.shape
            or any(a.shape != bucket_shape for a in acc_b.values())
        ):
            raise ValueError("learnt arrays of another shape")
        for a in (acc, fill, acc_m, fill_m, draft, *acc_b.values()):
            if not np.isfinite(a).all() or (a < 0).any():
                raise ValueError("learnt counts must be finite and >= 0")
        points = {}
        for b, ms, n, verified in state["verify"]:
            if not (int(b) >= 1 and float(ms) > 0.0 and np.isfinite(float(ms))):
                raise ValueError(f"bad verify point {b}: {ms}")
            points[int(b)] = _Point(float(ms), min(int(n), 3), 0, bool(verified))

        def capped(counts: np.ndarray) -> np.ndarray:  # [..., 2, k]: scale hits and trials alike
            trials = counts[..., 1:2, :]
            return counts * np.minimum(1.0, max_weight / np.maximum(trials, 1e-12))

        self.points, self._curve = points, None  # (the measured curve, `curve`, is the session's, not restored)
        self._memo.clear()
        self._acc, self._fill, self._acc_m, self._fill_m = capped(acc), capped(fill), capped(acc_m), capped(fill_m)
        self._acc_b = {source: capped(counts) for source, counts in acc_b.items()}
        self._draft = draft * min(1.0, max_weight / draft[0]) if draft[0] > 0 else draft

    # ---- estimates

    def measured(self, b: int) -> bool:
        p = self.points.get(b)
        return p is not None and p.last >= 0

    def verified_depth(self, bucket: int, source: str) -> int:
        """Draft positions of `source` verified in `bucket` or a shorter-match bucket (whose acceptance its prior
        inherits)."""
        return _depth(self._acc_b.get(source), bucket)

    def run_depth(self, bucket: int, source: str) -> int:
        """`verified_depth` counting this model's own steps alone (not what `restore` brought)."""
        return _depth(self._acc_b_run.get(source), bucket)

    def largest_verified(self) -> int:
        """The largest batch size a verify step has been timed at (0: none)."""
        return max((b for b, p in self.points.items() if p.verified), default=0)

    def last_seen(self, b: int) -> int:
        """Step index of the last measurement of batch size b (-1: never)."""
        p = self.points.get(b)
        return -1 if p is None else p.last

    def verify_curve(self) -> np.ndarray | None:
        """v(b) for b = 1..k_max + 1: float [k_max + 1] (read-only), or None before any pass was timed and without a
        measured curve. Fitted once per change of the points: a step asks for it several times (next_k, each lookup
        draft's value, trim).

        With a measured curve (`curve`) its shape is kept, tile boundaries and all: v(b) = curve(b) x s, s the
        weighted geometric mean of (timed / measured) over the sizes verify steps have timed (the machine's load
        now), and at each timed size a blend of its own timings (EWMA, weight = passes, at most 50) and the scaled
        curve (weight `CURVE_PRIOR`). Without one, the timed points are interpolated and made monotone (isotonic
        regression: with few points, noise would otherwise invent bumps)."""
        if not self.points and self.curve is None:
            return None
        if self._curve is None:
            self._curve = self._fit_measured() if self.curve is not None else self._fit_curve()
            self._curve.flags.writeable = False
        return self._curve

    def _fit_measured(self) -> np.ndarray:
        curve = self.curve
        assert curve is not None  # (called with a measured curve only)
        if self._base is None or self._base[0] is not curve:  # once per curve, not per step
            self._base = (curve, curve.array(self.k_max + 1))
            self._base[1].flags.writeable = False
        base = self._base[1]  # [k_max + 1] measured v(b), b = 1..k_max + 1 (read-only)
        sizes = np.arange(1, self.k_max + 2)  # [k_max + 1]
        per_pass, per_row = curve.depth_ms  # the curve's own price of the context in use (`VerifyCurve.predict`)
        extra = ((self.context or curve.context) - curve.context) / 1000.0
        priced = (
            base
            if extra == 0.0 or (per_pass, per_row) == (0.0, 0.0)
            else np.maximum(base + (per_pass + per_row * sizes) * extra, 0.5 * base)
        )  # [k_max + 1]
        timed = [(b, p) for b, p in self.points.items() if p.verified and b <= self.k_max + 1]
        if not timed:
            return priced
        w = np.array([min(p.n, 50) for _, p in timed], dtype=np.float64)
        fit = self.attention()
        if fit is not None:  # today's load and the attention of the context in use (docs/design.md, "Long contexts")
            s, a = fit
            out = s * base + a * sizes * max(self.context - curve.context, 0) / 1000.0
        else:  # the curve's price at the context in use, at today's load
            ratio = np.array([p.ms / priced[b - 1] for b, p in timed])
            out = priced * float(np.exp(w @ np.log(ratio) / w.sum()))  # [k_max + 1]
        for (b, p), wb in zip(timed, w, strict=False):
            out[b - 1] = (wb * p.ms + CURVE_PRIOR * out[b - 1]) / (wb + CURVE_PRIOR)
        return out

    def drifted(self) -> bool:
        """The b = 1 passes timed here (8 or more, over at most `verify_curve.WATCH_CONTEXT` tokens of context) cost
        more than `verify_curve.DRIFT` away from the measured curve's v(1) at their depth (`VerifyCurve.predict`): it
        no longer describes this machine (another load, a governor, a rebuilt library)."""
        ratio, n = self._v1
        return self.curve is not None and n >= 8 and not 1.0 - DRIFT <= ratio <= 1.0 + DRIFT

    def _fit_curve(self) -> np.ndarray:
        pts = sorted(self.points.items())
        bs = np.array([b for b, _ in pts], dtype=np.float64)  # [m] observed batch sizes
        vs = _isotonic([p.ms for _, p in pts], [min(p.n, 50) for _, p in pts])  # [m] monotone
        alpha = self.prior.verify_slope
        if len(bs) >= 2:  # least-squares slope through the observed sizes
            db = bs - bs.sum() / len(bs)
            slope = max(float(db @ vs / (db @ db)), 0.0)
        else:  # the prior shape v(b) = v(1) (1 + alpha (b - 1))
            slope = vs[0] * alpha / (1.0 + alpha * (bs[0] - 1.0))
        grid = np.arange(1.0, self.k_max + 2.0)  # [k_max + 1]
        out = np.interp(grid, bs, vs)
        above = grid > bs[-1]
        out[above] = vs[-1] + slope * (grid[above] - bs[-1])
        below = grid < bs[0]  # v(1) not measured yet: the prior shape below the smallest size
        out[below] = vs[0] * (1.0 + alpha * (grid[below] - 1.0)) / (1.0 + alpha * (bs[0] - 1.0))
        return out

    def draft_cost(self) -> tuple[float, float]:
        """(d ms per drafted token, c ms per drafter call)."""
        w, sn, snn, sy, sny = self._draft
        if w < 1e-9:
            return self.prior.draft_ms_per_token, self.prior.draft_ms_per_call
        var = snn / w - (sn / w) ** 2
        if var > 0.1:  # the draft length varied enough to separate c from d
            d = (sny / w - (sn / w) * (sy / w)) / var
            c = sy / w - d * sn / w
            if d >= 0.0 and c >= 0.0:
                return d, c
            if d < 0.0:
                return 0.0, sy / w
            return sny / snn, 0.0  # c < 0: fit through the origin
        if sn < 1e-9:
            return 0.0, sy / w  # every call drafted nothing: all overhead
        return sy / sn, 0.0

    def acceptance(self, bucket: int | None = None, source: str = "") -> np.ndarray:
        """a_i for positions 1..k_max: float [k_max]. (A_i + s m_i) / (N_i + s), m_1 = the prior's acceptance and
        m_i = a_(i-1), so an unseen position borrows from the one before. Pooled over every draft.

        With `bucket`: the acceptance of `source`'s lookup drafts from that match-length bucket. Its prior mean m_i
        is the larger of the chain above (from the pooled a_1, capped by `SHORT_MATCH_PRIOR` for short matches; a
        source in `SOURCE_PRIOR` starts from its own a_1 instead) and
        the bucket below's a_i: a longer match is assumed at least as reliable as a shorter one, so what shorter
        matches taught carries over."""
        key = (bucket, source if bucket is not None else "")
        memo = self._memo.get(key)
        if memo is not None:
            return memo
        s = self.prior.strength
        if bucket is None:
            out = self._chain(self._acc, self.prior.acceptance, None, s)
        else:
            out = self._bucket_chain(self.bucket_counts(source), bucket, source, float(self.acceptance()[0]), source)
        out.flags.writeable = False
        self._memo[key] = out
        return out

    def run_acceptance(self, bucket: int, source: str) -> np.ndarray:
        """`acceptance(bucket, source)` as a fresh model would estimate it: from this model's own steps alone (not
        what `restore` brought) and the prior: float [k_max]. A restored model uses the larger of the two at each
        position (`controller.AdaptiveK`), so what earlier prompts taught never holds a new one below a fresh start."""
        # Kept across steps: bucket b's chain depends on the run counts of buckets 0..b alone (and the prior), and a
        # step changes only its own bucket's (`observe` drops the chains from that bucket up): the same arrays the
        # `_bucket_chain` of these counts gives, without recomputing every bucket below on every step.
        chains = self._run_chains.setdefault(source, [])
        if len(chains) <= bucket:
            counts, s = self._run_counts(source), self.prior.strength
            for b in range(len(chains), bucket + 1):
                m = SOURCE_PRIOR.get(source, min(self.prior.acceptance, float(SHORT_MATCH_PRIOR[b])))
                out = self._chain(counts[b], m, chains[-1] if chains else None, s)
                out.flags.writeable = False
                chains.append(out)
        return chains[bucket]

    def _bucket_chain(
        self, counts: np.ndarray, bucket: int, source: str, pooled: float, memo: str | None = None
    ) -> np.ndarray:
        """a_i of `source`'s drafts in `bucket` from counts float [7, 2, k_max]: each bucket's chain from its prior
        mean (`pooled` a_1 capped by `SHORT_MATCH_PRIOR`, or `SOURCE_PRIOR`), raised to the bucket below's. `memo`:
        the memo's source key under which the lower buckets' chains, computed on the way, are kept too (they are
        what `acceptance` or `run_acceptance` of those buckets would compute)."""
        out: np.ndarray | None = None
        for b in range(bucket + 1):
            m = SOURCE_PRIOR.get(source, min(pooled, float(SHORT_MATCH_PRIOR[b])))
            out = self._chain(counts[b], m, out, self.prior.strength)
            if memo is not None and b < bucket:
                out.flags.writeable = False
                self._memo.setdefault((b, memo), out)
        assert out is not None  # (bucket >= 0)
        return out

    def model_acceptance(self) -> np.ndarray:
        """a_i of drafts without evidence (the draft model's) alone: float [k_max] (the prior where none was seen)."""
        return self._chain(self._acc_m, self.prior.acceptance, None, self.prior.strength)

    @staticmethod
    def _chain(acc: np.ndarray, m: float, floor: np.ndarray | None, s: float) -> np.ndarray:
        """(A_i + s m_i) / (N_i + s) with m_1 = m, m_i = a_(i-1), raised to floor[i] where given: float [k_max].

        Positions past the last one with evidence (A_i = N_i = 0) give (s max(m, f)) / s, which is max(m, f) exactly
        when s is a power of two >= 1 (the default 2): there the chain is a running maximum, not a loop."""
        hits, trials = acc.tolist()
        floors = floor.tolist() if floor is not None else [0.0] * len(hits)
        k = seen = len(hits)
        if s >= 1.0 and math.frexp(s)[0] == 0.5:
            while seen and hits[seen - 1] == 0.0 and trials[seen - 1] == 0.0:
                seen -= 1
        out = []
        for h, t, f in zip(hits[:seen], trials[:seen], floors[:seen], strict=False):
            m = (h + s * max(m, f)) / (t + s)
            out.append(m)
        if seen < k:  # the running maximum of m and the floors (Python's max: the same value as the loop's)
            out.extend(itertools.accumulate(floors[seen:], max, initial=m))
            del out[seen]  # the initial m
        return np.array(out)

    def fill(self) -> np.ndarray:
        """q_i for positions 1..k_max: float [k_max]. (proposed_i + s) / (asked_i + s): an unseen position is
        assumed filled. Of drafts without evidence (the draft model's) once any was seen, else of every draft."""
        s = self.prior.strength
        f = self._fill_m if self._fill_m[1, 0] > 0 else self._fill
        return (f[0] + s) / (f[1] + s)

    def rates(self) -> np.ndarray | None:
        """Expected tokens/s by K = 0..k_max of a drafter without evidence (a draft model; any drafter before its
        first draft with evidence): float [k_max + 1], or None before v(1) can be estimated."""
        v = self.verify_curve()
        if v is None:
            return None
        q = self.fill()
        d, c = self.draft_cost()
        a = self.model_acceptance() if self._acc_m[1, 0] > 0 else self.acceptance()
        return 1000.0 * expected_tokens(a, q) / expected_ms(v, d, c, q)

    def snapshot(self) -> dict[str, Any]:
        v = self.verify_curve()
        d, c = self.draft_cost()
        a, q = self.acceptance(), self.fill()
        rates = self.rates()

        def r(x: float) -> float:
            return round(float(x), 4)

        return {
            "verify_curve": self.curve is not None,
            "context": self.context,  # tokens in the KV cache the next pass is priced at
            "attention_ms_per_row_per_1k": None if (fit := self.attention()) is None else r(fit[1]),
            "verify_ms": [[b, r(p.ms), p.n] for b, p in sorted(self.points.items())],
            "verify_model_ms": None if v is None else [r(x) for x in v],  # b = 1..k_max + 1
            "draft_ms_per_token": r(d),
            "draft_ms_per_call": r(c),
            "acceptance": [r(x) for x in a],  # position 1..k_max
            "acceptance_weight": [r(x) for x in self._acc[1]],
            "fill": [r(x) for x in q],
            "expected_tokens": [r(x) for x in expected_tokens(a, q)],  # K = 0..k_max
            "expected_tok_s": None if rates is None else [r(x) for x in rates],
            "by_source": {k: dict(s) for k, s in self.by_source.items()},
            "model_acceptance": [r(x) for x in self.model_acceptance()],
            # lookup drafts by source and match length (bucket lower edge): a_1, and the decayed number of verified
            # drafts
            "acceptance_by_match": {
                source: {
                    str(int(edge)): [r(self.acceptance(b, source)[0]), r(counts[b, 1, 0])]
                    for b, edge in enumerate(BUCKET_EDGES)
                    if counts[b, 1, 0] > 0
                }
                for source, counts in self._acc_b.items()
            },
        }


def _count(acc: np.ndarray, fill: np.ndarray, step: Step, n: int, k_max: int) -> None:
    """Add one step's draft to decayed [accepted, verified] and [proposed, asked] counts by position (float [2, k])."""
    asked = min(max(step.k, n), k_max)
    proposed = min(n, asked)
    fill[:, :proposed] += 1.0
    if proposed < asked:
        fill[1, proposed] += 1.0
    accepted = min(step.n_accepted, k_max)
    acc[:, :accepted] += 1.0
    if step.rejected and accepted < k_max:
        acc[1, accepted] += 1.0  # the first rejected position


def _depth(counts: np.ndarray | None, bucket: int) -> int:
    """Draft positions verified (decayed trials >= 0.5) in `bucket` or a shorter-match one: counts float [7, 2, k]."""
    return 0 if counts is None else int(np.count_nonzero((counts[: bucket + 1, 1] >= 0.5).any(axis=0)))


def bucket_of(match_len: int) -> int:
    """The match-length bucket (0..6) of a lookup draft whose source matched `match_len` >= 1 context tokens."""
    return int(np.searchsorted(BUCKET_EDGES, match_len, side="right")) - 1
