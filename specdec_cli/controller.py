"""How many tokens to draft per step: `--k N` (`FixedK`) and the cost-aware `--k auto` (`AdaptiveK`, the default).

Speculation pays only when the tokens a step commits outweigh what drafting and the wider verify pass cost, and
both costs depend on the machine. On a 2-core CPU a target pass over b tokens costs about 58, 105, 180, 340 ms for
b = 1, 2, 4, 8, so a 0.5B draft model at 28 ms per token loses to plain decoding even at 90 % acceptance; on a GPU
the same pass is nearly flat in b and long drafts win. So `AdaptiveK` learns the costs in this process, from the
`Step` records the engine yields, and re-chooses K before every step. K = 0 is a plain decoding step.

The model
---------
For a request of K draft tokens (verify batch b = K + 1 when the drafter fills it):

    v(b)   ms of one target pass over b tokens
    d, c   ms per drafted token, ms per drafter call
    a_i    P(draft token i accepted | tokens 1..i-1 accepted)
    q_i    P(the drafter proposes token i | it proposed token i-1 and was asked for >= i): 1 for a draft model,
           lower for lookup drafters, which propose fewer tokens than asked or none
    P_j  = q_1 ... q_j                     P(the draft has >= j tokens);   L = the draft's length

    E[tokens | K] = 1 + sum_{j=1..K} prod_{i<=j} q_i a_i        the target's own token + the accepted prefix
                    (i.i.d. a, q = 1: (1 - a^(K+1)) / (1 - a))
    E[ms | K]     = c + d sum_{j=1..K} P_j + sum_{l=0..K} P(L = l) v(l + 1)      (E[ms | 0] = v(1))
                    P(L = l) = P_l (1 - q_{l+1}) for l < K,  P(L = K) = P_K
    rate(K)       = 1000 E[tokens | K] / E[ms | K]               tokens/s

    K* = argmax_{K in 0..k_max} rate(K), and K* = 0 unless rate(K*) > (1 + margin) rate(0)   (hysteresis, 3 %)

With q = 1 this is the textbook E[tokens | K] / (d K + v(K + 1)). With several drafter sources (a hybrid drafter)
the estimates are pooled: K is chosen before the drafter picks a source, and pooled conditionals a_i are exact for a
stationary mix by the chain rule.

The estimates
-------------
- v(b): an EWMA of `verify_ms` per observed batch size (`Step.batch_size`), made monotone by isotonic regression,
  interpolated piecewise-linearly between observed sizes and extrapolated beyond them with the least-squares slope
  through the observed points (clamped >= 0). With one observed size the prior shape v(b) = v(1)(1 + alpha (b - 1))
  (alpha = 0.5) fills in, so a flat curve is never assumed without two measurements. The first step is plain (K = 0)
  so that v(1) is measured; steps whose drafter proposed nothing are batch-1 measurements too.
- d, c: an exponentially weighted least-squares fit of `draft_ms` = c + d len(drafted) over steps with k > 0; when
  the draft length never varies, c = 0 and d = mean(draft_ms) / mean(len).
- a_i, q_i: counts decayed every step (half-life `half_life` steps, so evidence fades while nothing is drafted),
  with pseudo-counts (`CostPrior.strength`, 2) of a prior mean. For a_i the prior mean is a_(i-1), and 0.7 for a_1,
  so unseen positions borrow from earlier ones; for q_i it is 1 (an unseen position is assumed filled). From each
  step: positions 1..n_accepted are accepted; position n_accepted + 1 is rejected if the target verified it (a step
  that stopped inside the accepted prefix verified nothing after it); positions 1..len(drafted) were proposed and
  position len(drafted) + 1 <= k was not. A step that drafted nothing says nothing about acceptance.

Probing and exploring
---------------------
At K* = 0 nothing is learnt about drafts, so every `probe_every` steps the controller takes one probe step at K = 3,
unless the measured costs say that even drafts accepted in full could not beat plain decoding (a draft model whose
per-token cost matches the target's per-token verify cost on a CPU): then better acceptance cannot help, and probes
would only cost time (a probe of a draft model also pays for its catching up on the tokens decoded since).
Probes come in bursts: while the pooled tokens/s of the burst's probes beat plain decoding, the next probe follows
2 steps later, so evidence builds up quickly once drafts improve; when they don't, the burst ends and the interval
doubles, up to 4 x `probe_every` (so the controller notices better drafts within about two intervals: <= ~130
steps by default, typically ~50). A probe whose drafter proposed nothing is a plain step and changes nothing.
At K* > 0, every `probe_every` steps it measures a batch size it has never timed, K* + 1 first, then the grid
K = 2, 4, 8, 16, ... up to k_max, one step each (a CPU's verify curve is concave, even bumpy: 340 ms at b = 8 but
500 at b = 16, so extrapolating from small b is pessimistic and the best K can lie past a local dip), and
refreshes v(1) with a plain step once it is 8 x `probe_every` steps old.

Drafts with evidence: trimming a lookup draft by its match
----------------------------------------------------------
A lookup drafter (prompt lookup, suffix tree) knows how much of the recent context matched where its draft comes
from (`Draft.match_len`), and that predicts acceptance far better than the draft position alone: inside a copy run
(an edit that keeps most lines) the match is long and the next 30 tokens are right; after a changed line it is
short and the draft is a guess. Its drafts also cost ~0 ms, so the controller asks such a drafter for up to
`lookup_k_max` tokens (64) and then `trim`s the draft to the K with the highest expected tokens/s for *its* match:

    bucket = the match length's bucket (1, 2, 3-4, 5-8, 9-16, 17-32, 33+ tokens)
    a_i^bucket from the steps whose draft came from that bucket (decayed per observation, half-life `half_life`
           observations of the bucket, and halved by a rejection: after many right drafts of a repeated workload,
           a reply that leaves it must not pay for long failed passes while the evidence turns; prior mean: below)
    K = argmax_{K in 0..len(draft)} E[tokens | K, a^bucket] / v(K + 1)      (the draft is already paid for)

with the same 3 % hysteresis against K = 0, and K at most twice the positions the bucket has been verified at (a
slow start: unseen positions borrow their acceptance from earlier ones, and a long pass costs too much to risk on
that borrowing), and at most the bucket's window: a rejection after m accepted tokens cuts it to max(3, 2m), a draft
accepted whole doubles it (TCP's congestion window; the per-position estimates alone turn too slowly when a reply
leaves a workload that was right for a long time, as each position after the break keeps its good record).

While every verified position of a bucket accepts >= 90 % and the whole draft is expected to be >= 90 % accepted, K
is that whole allowance (it doubles, to learn the positions and batch sizes beyond), even where the fitted curve
prefers a shorter K: beyond the largest batch a verify step has timed, v(b) is extrapolated, and a CPU's bumpy curve
(b = 5 to 9 costs a plain step per token, b = 33 to 65 a third of one) would otherwise hold K at 2 to 4 under drafts
that are always right. A drafter that counts continuations (the suffix drafter) also gives each token's empirical
probability (`Draft.probs`); a_i is multiplied by it, so K stops where past outputs that match the context part
ways. The cut depends only on the draft and on past steps, never on the target's logits, so verification (greedy
or rejection sampling) stays lossless.

A bucket whose trim is 0 is probed (K = 3) every `probe_every` drafts it produced (the interval doubles, up to 4 x,
while its probes do not pay); buckets of matches of 5+ tokens are also probed on their first draft. A bucket's prior
for a_1 is the pooled a_1 or, per position, the bucket below's a_i when higher (acceptance is taken to be
non-decreasing in match length, so what shorter matches taught, including how far K has grown, carries over to
longer ones). Drafters without evidence (a draft model; hybrid steps that fell back to it) are not trimmed.

What is learnt lasts: a `Session` keeps one `AdaptiveK` per method across its generations (chat turns), and
`specdec_cli.learnt` carries its state to the next process with the same models, method and machine, as a prior
whose evidence is capped (`AdaptiveK.restore`).

Trims do not explore batch sizes blindly (only under drafts expected to be accepted, above): the verify curve also
learns from prefill, which is a forward pass over m tokens (m <= n_batch; a longer prefill counts as n_batch-token
chunks at its mean cost), a measurement of v(m) that costs nothing extra. Interpolating between it and the small
batches measured is optimistic where the curve is concave (a CPU's), so a long draft is tried when the acceptance
makes it look worth it, and its measured cost corrects the curve; exploring long batches blindly cost more than it
found (a 65-token pass is ~37 plain steps on a 2-core CPU).

Per-step overheads outside `draft_ms` and `verify_ms` (sampling, detokenising, rendering) are not modelled; they
are the same for every K, so the model slightly underrates long drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from specdec_cli.drafters.base import Draft
    from specdec_cli.records import Step

K_LIMIT = 64  # largest K accepted anywhere (--k, tune, k_max)
DEFAULT_K_MAX = 16
PROBE_K = 3  # K of a probe step taken from K = 0
MARGIN = 0.03  # hysteresis: K > 0 must beat plain decoding by this fraction
MAX_BACKOFF = 4  # failed probes stretch the probe interval to at most probe_every x this
EXPLORE_K = (1, 2, 4, 8, 16, 32, 64)  # at K* > 0, each of these above K* is tried once to measure v(K + 1)
LOOKUP_K_MAX = 64  # longest draft a lookup drafter is asked for under --k auto (then trimmed by its match)
BUCKET_EDGES = np.array([1, 2, 3, 5, 9, 17, 33])  # lower edges of the match-length buckets
FRONTIER_ACCEPTANCE = 0.9  # a bucket whose verified positions all accept this often grows its K (slow start)
REJECTION_DECAY = 0.5  # a rejected draft halves its bucket's evidence before it is counted
EARLY_PROBE_MATCH = 5  # buckets of matches this long are probed on their first draft
CHEAP_DRAFT = 0.1  # a lookup drafter is "free" when one call costs < this x v(1)
GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the values a `k_values` range keeps


# --------------------------------------------------------------------------------------------------------------
# --k parsing


def parse_k(text: str) -> int | None:
    """`--k`: "auto" → None (the adaptive controller), "0".."64" → that fixed K. Raises ValueError otherwise."""
    s = text.strip().lower()
    if s == "auto":
        return None
    try:
        k = int(s)
    except ValueError:
        raise ValueError(f"--k must be 'auto' or a whole number 0..{K_LIMIT}, got {text!r}.") from None
    if not 0 <= k <= K_LIMIT:
        raise ValueError(f"--k must be between 0 and {K_LIMIT} (0 = plain decoding), got {k}.")
    return k


def k_values(spec: str) -> list[int]:
    """The K values `specdec tune --k SPEC` measures, sorted and without duplicates.

    SPEC is a comma-separated list of values ("2,4,8") and ranges ("4..16"). A range keeps its two ends and the
    values of the grid 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64 between them, because every K costs a full tune
    run and throughput changes slowly with K: "4..16" → [4, 6, 8, 12, 16], "0..4" → [0, 1, 2, 3, 4]. List the
    values to measure all of them ("4,5,6,7,8"). Every value must be 0..64. Raises ValueError otherwise.
    """
    out: set[int] = set()
    items = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in items):
        raise ValueError(f"--k needs values like '8', '2,4,8' or '4..16', got {spec!r}.")
    for item in items:
        if ".." in item:
            lo_s, _, hi_s = item.partition("..")
            lo, hi = _k_value(lo_s, spec), _k_value(hi_s, spec)
            if lo > hi:
                raise ValueError(f"--k range {item!r} runs backwards; write it as '{hi}..{lo}'.")
            out.update({lo, hi}, (g for g in GRID if lo <= g <= hi))
        else:
            out.add(_k_value(item, spec))
    return sorted(out)


def _k_value(text: str, spec: str) -> int:
    try:
        k = int(text.strip())
    except ValueError:
        raise ValueError(f"--k needs whole numbers like '8', '2,4,8' or '4..16', got {spec!r}.") from None
    if not 0 <= k <= K_LIMIT:
        raise ValueError(f"--k values must be between 0 and {K_LIMIT}, got {k} in {spec!r}.")
    return k


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


# --------------------------------------------------------------------------------------------------------------
# The learnt cost model


@dataclass(frozen=True, slots=True)
class CostPrior:
    """What the model assumes before measuring (or what a previous run measured: `CostPrior.from_snapshot`).

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

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> CostPrior:
        """A prior from `AdaptiveK.snapshot()` (e.g. saved by `specdec tune`)."""
        acc = snap.get("acceptance") or [cls.acceptance]
        return cls(
            acceptance=float(acc[0]),
            draft_ms_per_token=float(snap.get("draft_ms_per_token", 0.0)),
            draft_ms_per_call=float(snap.get("draft_ms_per_call", 0.0)),
            verify_ms=tuple((int(b), float(ms)) for b, ms, _n in snap.get("verify_ms", ())),
        )


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

    def __post_init__(self) -> None:
        self.decay = 0.5 ** (1.0 / self.half_life)
        self.steps = 0
        self.points: dict[int, _Point] = {b: _Point(ms, 1, -1) for b, ms in self.prior.verify_ms if b >= 1}
        self._draft = np.zeros(5)  # decayed sums over draft calls: w, w n, w n^2, w ms, w n ms
        self._acc = np.zeros((2, self.k_max))  # [accepted, verified] by position
        self._fill = np.zeros((2, self.k_max))  # [proposed, asked] by position
        self._acc_b = np.zeros((len(BUCKET_EDGES), 2, self.k_max))  # [bucket, accepted/verified, position]
        self.by_source: dict[str, dict[str, float]] = {}

    # ---- learning

    def observe(self, step: Step, bucket: int | None = None) -> None:
        """Learn from one step. `bucket`: the match-length bucket of its draft (`bucket_of`), None without evidence."""
        n = len(step.drafted)
        self.steps += 1
        self._acc *= self.decay
        self._fill *= self.decay
        if bucket is not None and n:
            acc = self._acc_b[bucket]
            acc *= self.decay  # per observation of this bucket: rare buckets keep their evidence
            m = min(step.n_accepted, self.k_max)
            if step.n_accepted < n and step.target_token is not None and m < self.k_max:
                acc *= REJECTION_DECAY  # multiplicative decrease: a rejection weighs more than a long good run
                acc[1, m] += 1.0
            acc[:, :m] += 1.0
        if step.finish_reason != "interrupted":  # an interrupted pass was not timed to its end
            self._observe_verify(step.batch_size, step.verify_ms)
            if step.k > 0:
                self._draft = self._draft * self.decay + np.array(
                    [1.0, n, n * n, step.draft_ms, n * step.draft_ms]
                )
        asked = min(max(step.k, n), self.k_max)
        proposed = min(n, asked)
        self._fill[:, :proposed] += 1.0
        if proposed < asked:
            self._fill[1, proposed] += 1.0
        accepted = min(step.n_accepted, self.k_max)
        self._acc[:, :accepted] += 1.0
        if step.n_accepted < n and step.target_token is not None and accepted < self.k_max:
            self._acc[1, accepted] += 1.0  # the first rejected position
        if step.k > 0:
            src = self.by_source.setdefault(step.source or "?", {"steps": 0, "drafted": 0, "accepted": 0, "ms": 0.0})
            src["steps"] += 1
            src["drafted"] += n
            src["accepted"] += step.n_accepted
            src["ms"] += step.draft_ms

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        """A prefill of `n_evaluated` tokens in `ms` milliseconds, evaluated in chunks of at most `n_batch`: one
        measurement of v(min(n_evaluated, n_batch)) (a longer prefill: its mean cost per chunk)."""
        if n_evaluated < 2 or ms <= 0.0:
            return
        b = min(n_evaluated, n_batch)
        self._observe_verify(b, ms * b / n_evaluated, verified=False)

    def _observe_verify(self, b: int, ms: float, verified: bool = True) -> None:
        if ms <= 0.0:
            return
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

    # ---- carrying what was learnt to a later process (`specdec_cli.learnt`)

    def state(self) -> dict[str, Any]:
        """Everything learnt, JSON-serialisable: the verify points, the draft-cost sums and the decayed acceptance and
        fill counts (float [2, k_max]; by match-length bucket float [7, 2, k_max])."""
        return {
            "k_max": self.k_max,
            "verify": [[b, p.ms, p.n, p.verified] for b, p in sorted(self.points.items())],
            "draft": self._draft.tolist(),
            "acc": self._acc.tolist(),
            "fill": self._fill.tolist(),
            "acc_by_match": self._acc_b.tolist(),
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
        acc_b, draft = np.asarray(state["acc_by_match"], float), np.asarray(state["draft"], float)
        if acc.shape != self._acc.shape or fill.shape != self._fill.shape or acc_b.shape != self._acc_b.shape \
                or draft.shape != self._draft.shape:
            raise ValueError("learnt arrays of another shape")
        for a in (acc, fill, acc_b, draft):
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

        self.points = points
        self._acc, self._fill, self._acc_b = capped(acc), capped(fill), capped(acc_b)
        self._draft = draft * min(1.0, max_weight / draft[0]) if draft[0] > 0 else draft

    # ---- estimates

    def measured(self, b: int) -> bool:
        p = self.points.get(b)
        return p is not None and p.last >= 0

    def verified_depth(self, bucket: int) -> int:
        """Draft positions verified in `bucket` or a shorter-match bucket (whose acceptance its prior inherits)."""
        return int(np.count_nonzero((self._acc_b[: bucket + 1, 1] >= 0.5).any(axis=0)))

    def largest_verified(self) -> int:
        """The largest batch size a verify step has been timed at (0: none)."""
        return max((b for b, p in self.points.items() if p.verified), default=0)

    def last_seen(self, b: int) -> int:
        """Step index of the last measurement of batch size b (-1: never)."""
        p = self.points.get(b)
        return -1 if p is None else p.last

    def verify_curve(self) -> np.ndarray | None:
        """v(b) for b = 1..k_max + 1: float [k_max + 1], or None before any pass was timed."""
        if not self.points:
            return None
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

    def acceptance(self, bucket: int | None = None) -> np.ndarray:
        """a_i for positions 1..k_max: float [k_max]. (A_i + s m_i) / (N_i + s), m_1 = the prior's acceptance and
        m_i = a_(i-1), so an unseen position borrows from the one before.

        With `bucket`: the acceptance of drafts from that match-length bucket. Its prior mean m_i is the larger of
        the chain above (from the pooled a_1) and the bucket below's a_i: a longer match is assumed at least as
        reliable as a shorter one, so what shorter matches taught carries over."""
        s = self.prior.strength
        if bucket is None:
            return self._chain(self._acc, self.prior.acceptance, None, s)
        pooled = float(self.acceptance()[0])
        below = None
        for b in range(bucket + 1):
            below = self._chain(self._acc_b[b], pooled, below, s)
        return below

    @staticmethod
    def _chain(acc: np.ndarray, m: float, floor: np.ndarray | None, s: float) -> np.ndarray:
        """(A_i + s m_i) / (N_i + s) with m_1 = m, m_i = a_(i-1), raised to floor[i] where given: float [k_max]."""
        hits, trials = acc.tolist()
        floors = floor.tolist() if floor is not None else [0.0] * len(hits)
        out = []
        for h, t, f in zip(hits, trials, floors, strict=True):
            m = (h + s * max(m, f)) / (t + s)
            out.append(m)
        return np.array(out)

    def fill(self) -> np.ndarray:
        """q_i for positions 1..k_max: float [k_max]. (proposed_i + s) / (asked_i + s): an unseen position is
        assumed filled."""
        s = self.prior.strength
        return (self._fill[0] + s) / (self._fill[1] + s)

    def rates(self) -> np.ndarray | None:
        """Expected tokens/s by K = 0..k_max: float [k_max + 1], or None before v(1) can be estimated."""
        v = self.verify_curve()
        if v is None:
            return None
        q = self.fill()
        d, c = self.draft_cost()
        return 1000.0 * expected_tokens(self.acceptance(), q) / expected_ms(v, d, c, q)

    def snapshot(self) -> dict[str, Any]:
        v = self.verify_curve()
        d, c = self.draft_cost()
        a, q = self.acceptance(), self.fill()
        rates = self.rates()

        def r(x: float) -> float:
            return round(float(x), 4)

        return {
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
            # lookup drafts by match length (bucket lower edge): a_1, and the decayed number of verified drafts
            "acceptance_by_match": {
                str(int(edge)): [r(self.acceptance(b)[0]), r(self._acc_b[b, 1, 0])]
                for b, edge in enumerate(BUCKET_EDGES) if self._acc_b[b, 1, 0] > 0
            },
        }


# --------------------------------------------------------------------------------------------------------------
# Controllers


def bucket_of(match_len: int) -> int:
    """The match-length bucket (0..6) of a lookup draft whose source matched `match_len` >= 1 context tokens."""
    return int(np.searchsorted(BUCKET_EDGES, match_len, side="right")) - 1


class KController(Protocol):
    def next_k(self) -> int:
        """K for the next step, 0..k_max (0 = a plain decoding step): how many tokens to ask the drafter for."""
        ...

    def trim(self, draft: Draft) -> int:
        """How many of the draft's tokens to verify (0..len(draft)), decided from the draft alone (never from the
        target's logits, so verification stays lossless)."""
        ...

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        """Learn from a prefill of `n_evaluated` tokens that took `ms` milliseconds."""
        ...

    def observe(self, step: Step) -> None:
        """Learn from the step just taken."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """The current cost model and choice, JSON-serialisable (stats, tune, --json)."""
        ...


class FixedK:
    """`--k N`: always N. Still learns the cost model, so stats and tune can show what auto would have expected."""

    def __init__(self, k: int) -> None:
        if not 0 <= k <= K_LIMIT:
            raise ValueError(f"K must be between 0 and {K_LIMIT}, got {k}.")
        self.k = k
        self.model = CostModel(max(k, DEFAULT_K_MAX))

    def next_k(self) -> int:
        return self.k

    def trim(self, draft: Draft) -> int:
        return len(draft)  # a forced K is verified as drafted

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        self.model.observe_prefill(n_evaluated, ms, n_batch)

    def observe(self, step: Step) -> None:
        self.model.observe(step)

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "fixed", "k": self.k} | self.model.snapshot()


class AdaptiveK:
    """`--k auto`: the K with the highest expected tokens/s under the learnt `CostModel` (see the module docstring)."""

    def __init__(
        self,
        k_max: int = DEFAULT_K_MAX,
        *,
        lookup_k_max: int = LOOKUP_K_MAX,
        probe_every: int = 16,
        half_life: float = 32.0,
        prior: CostPrior | None = None,
        margin: float = MARGIN,
    ) -> None:
        if not 1 <= k_max <= K_LIMIT:
            raise ValueError(f"k_max must be between 1 and {K_LIMIT}, got {k_max}.")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}.")
        if not half_life > 0.0:
            raise ValueError(f"half_life must be > 0 steps, got {half_life}.")
        if not 1 <= lookup_k_max <= K_LIMIT:
            raise ValueError(f"lookup_k_max must be between 1 and {K_LIMIT}, got {lookup_k_max}.")
        self.k_max = k_max
        self.lookup_k_max = max(k_max, lookup_k_max)
        self.probe_every = probe_every
        self.margin = margin
        self.model = CostModel(self.lookup_k_max, half_life, prior or CostPrior())
        # Trimming drafts with evidence (lookup drafters), per match-length bucket:
        self.evidence = False  # a draft with a match length was seen: ask for lookup_k_max, then trim
        self.asked_all = False  # the last next_k was such an ask (an empty draft then makes a plain step, K = 0)
        self._evidence_ms: list[float] = []  # draft_ms of the last 8 steps whose draft had evidence
        self._bucket: int | None = None  # bucket of the draft being verified
        self._bucket_probe = False  # that verification is a probe of a bucket whose trim was 0
        # drafts since the bucket's last probe; a match of 5+ tokens is probed on its first draft (a copy run is
        # worth finding early: once found, its drafts are long and right)
        self._since_bucket = np.where(BUCKET_EDGES >= EARLY_PROBE_MATCH, probe_every - 1, 0).astype(np.int64)
        self._bucket_interval = np.full(len(BUCKET_EDGES), probe_every, dtype=np.int64)
        # per bucket, the longest K allowed now: cut to twice the accepted length by a rejection, doubled by a draft
        # accepted whole (the window of TCP's congestion control)
        self._window = np.full(len(BUCKET_EDGES), K_LIMIT, dtype=np.int64)
        self.k = 0  # the last K handed out
        self.best = 0  # the model's choice at that time
        self.failures = 0  # probes in a row that did not pay
        self._since = 0  # steps since the last probe / exploration
        self._probing = False
        self._interval = probe_every
        self._burst = [0, 0.0]  # tokens and ms of the current burst of probes

    def next_k(self) -> int:
        self.asked_all = False  # True: K is an ask for the whole lookup draft, which `trim` cuts
        if not self.model.measured(1):  # a plain step measures v(1) first
            self.k = self.best = 0
            return 0
        self.asked_all = self.evidence and self._free_drafts()
        if self.asked_all:
            self.k = self.lookup_k_max  # a free lookup draft, as long as it goes: `trim` chooses K
            return self.k
        rates = self.model.rates()[: self.k_max + 1]
        best = best_k(rates, self.margin)
        if (best > 0) != (self.best > 0):
            self._since = 0  # a regime change: no probe right away
        self.best = best
        self._since += 1
        k = best
        if best == 0:
            if self._since >= self._interval and self._could_pay():
                k, self._since, self._probing = min(PROBE_K, self.k_max), 0, True
        else:
            self.failures, self._interval, self._burst = 0, self.probe_every, [0, 0.0]
            if self._since >= self.probe_every:
                self._since = 0
                grid = (best + 1, *EXPLORE_K)
                unmeasured = [j for j in grid if best < j <= self.k_max and not self.model.measured(j + 1)]
                if unmeasured:
                    k = unmeasured[0]  # the next batch size up, then the grid: a CPU's curve is concave
                elif self.model.steps - self.model.last_seen(1) >= 8 * self.probe_every:
                    k = 0  # refresh v(1)
        self.k = k
        return k

    def _could_pay(self) -> bool:
        """Would drafting beat plain decoding if every draft token were accepted, at the measured costs? When not
        (a draft model as slow as the target's per-token verify cost), probing for better acceptance is futile."""
        v = self.model.verify_curve()
        if v is None:
            return True
        # Only K whose verify batch lies within the sizes verify steps have timed: beyond them the curve is
        # interpolated towards the prefill's point, which is optimistic on a CPU and would keep futile probes alive.
        k_top = min(self.k_max, max(PROBE_K, self.model.largest_verified() - 1))
        d, c = self.model.draft_cost()
        ms = expected_ms(v[: k_top + 1], d, c, np.ones(k_top))  # [k_top + 1]
        perfect = np.arange(1, k_top + 2) / ms  # tokens per ms by K, all accepted
        return bool(perfect[1:].max() > (1.0 + self.margin) * perfect[0])

    def _free_drafts(self) -> bool:
        """Lookup drafts cost the same per call whatever their length; the fastest of the last 8 calls (the first
        call of a process can be 40 x slower while numpy and the store warm up) decides whether they are free."""
        if not self._evidence_ms:
            return False
        return min(self._evidence_ms) < CHEAP_DRAFT * float(self.model.verify_curve()[0])

    def trim(self, draft: Draft) -> int:
        """K for a draft with evidence (`Draft.match_len` > 0): the best K <= len(draft) for its match-length
        bucket (see the module docstring); drafts without evidence are verified whole."""
        n = len(draft)
        self._bucket, self._bucket_probe = None, False
        if n == 0 or draft.match_len <= 0:
            return n
        self.evidence = True
        b = self._bucket = bucket_of(draft.match_len)
        # Slow start: at most twice the positions this bucket has been verified at, so a few lucky drafts do not
        # send a 64-token pass on the strength of the prior alone (one failed pass costs ~37 plain steps on a CPU).
        seen = self.model.verified_depth(b)
        n = min(n, self.model.k_max, max(PROBE_K, 2 * seen), int(self._window[b]))
        v = self.model.verify_curve()
        if v is None:
            return n
        accept = self.model.acceptance(b)[:n]  # [n]
        if draft.probs is not None:  # where past continuations part ways, the draft is a guess from there on
            accept = accept * draft.probs[:n]
        expected = expected_tokens(accept)  # [n + 1] tokens by K
        k = best_k(expected / v[: n + 1], self.margin)  # tokens per ms by K
        if seen and k < n and accept[:seen].min() >= FRONTIER_ACCEPTANCE \
                and expected[n] >= FRONTIER_ACCEPTANCE * (n + 1):
            # Every verified position is nearly always right, and so is the whole draft expected to be: verify all
            # of it (at most twice the verified depth: slow start), to learn the positions and batch sizes beyond.
            # Without this the verify curve traps K: beyond the largest batch a verify step has timed, v(b) is
            # extrapolated, and a CPU's bumpy curve (b = 5 to 9 costs a plain step per token, b = 33 to 65 a third
            # of one) makes a local optimum (K = 2..4) look best, while a pass over tokens that will nearly all be
            # accepted costs little even where b turns out slow.
            k = n
        self._since_bucket[b] += 1
        if k == 0:
            if self._since_bucket[b] >= self._bucket_interval[b]:
                k, self._since_bucket[b], self._bucket_probe = min(n, PROBE_K), 0, True
        else:
            self._bucket_interval[b] = self.probe_every
        self.k = k
        return k

    def observe_prefill(self, n_evaluated: int, ms: float, n_batch: int) -> None:
        self.model.observe_prefill(n_evaluated, ms, n_batch)

    def observe(self, step: Step) -> None:
        if self._bucket is not None:  # the step drafted with evidence (possibly trimmed to nothing)
            self._evidence_ms = [*self._evidence_ms[-7:], step.draft_ms]
        bucket = self._bucket if step.drafted else None
        self.model.observe(step, bucket)
        if bucket is not None:
            if step.n_accepted < len(step.drafted) and step.target_token is not None:
                self._window[bucket] = max(PROBE_K, 2 * step.n_accepted)
            elif step.n_accepted == len(step.drafted):
                self._window[bucket] = max(int(self._window[bucket]), 2 * len(step.drafted))
        if self._bucket_probe and bucket is not None:
            # A bucket's probe that did not beat plain decoding stretches that bucket's probe interval.
            v1 = self.model.verify_curve()
            paid = v1 is not None and (step.n_accepted + 1) * float(v1[0]) >= step.verify_ms
            self._bucket_interval[bucket] = (
                self.probe_every if paid else min(2 * self._bucket_interval[bucket], MAX_BACKOFF * self.probe_every))
        self._bucket, self._bucket_probe = None, False
        if not self._probing:
            return
        self._probing = False
        if not step.drafted:  # the drafter had nothing: a plain step, no evidence either way
            return
        # A burst of probes continues (next probe 2 steps later) while its pooled tokens/s beat plain decoding;
        # pooling keeps one unlucky probe from ending a burst once drafts have improved.
        self._burst[0] += step.n_accepted + 1
        self._burst[1] += step.draft_ms + step.verify_ms
        v1 = self.model.verify_curve()
        plain_ms = float(v1[0]) if v1 is not None else 0.0
        if self._burst[0] * plain_ms >= self._burst[1]:
            self.failures, self._interval = 0, max(1, self.probe_every // 8)
        else:
            self._burst = [0, 0.0]
            self.failures += 1
            self._interval = self.probe_every * min(2**self.failures, MAX_BACKOFF)

    def state(self) -> dict[str, Any]:
        """What this controller learnt, for a later process (`specdec_cli.learnt`): the cost model and whether its
        drafter's drafts are free lookup drafts with evidence."""
        return {"model": self.model.state(), "evidence": self.evidence, "evidence_ms": list(self._evidence_ms)}

    def restore(self, state: dict[str, Any], max_weight: float = 8.0) -> None:
        """Continue from `state()` of an earlier run (see `CostModel.restore`). Raises ValueError, TypeError or
        KeyError when `state` does not fit this controller; it is then unchanged."""
        evidence = bool(state["evidence"])
        evidence_ms = [float(x) for x in state["evidence_ms"]][-8:]
        model = CostModel(self.model.k_max, self.model.half_life, self.model.prior)
        model.restore(state["model"], max_weight)
        self.model, self.evidence, self._evidence_ms = model, evidence, evidence_ms

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": "auto",
            "k": self.k,
            "best_k": self.best,
            "k_max": self.k_max,
            "probe_interval": self._interval,
            "failed_probes": self.failures,
            "steps": self.model.steps,
            "lookup_k_max": self.lookup_k_max,
            "trims_by_evidence": self.evidence,
        } | self.model.snapshot()


def make_controller(k: int | None, k_max: int = DEFAULT_K_MAX) -> KController:
    """The controller for a parsed `--k`: None → AdaptiveK(k_max), N → FixedK(N)."""
    return AdaptiveK(k_max) if k is None else FixedK(k)


__all__ = [
    "K_LIMIT",
    "AdaptiveK",
    "CostModel",
    "CostPrior",
    "FixedK",
    "KController",
    "best_k",
    "bucket_of",
    "expected_ms",
    "expected_tokens",
    "k_values",
    "make_controller",
    "parse_k",
]
