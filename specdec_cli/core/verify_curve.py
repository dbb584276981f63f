"""The measured verify curve: v(b), the ms of one target pass over b tokens with logits for every row, b = 1..65,
and what each row costs per token of context the pass attends to.

On a CPU, v(b) is not monotone: llama.cpp's repacked kernels multiply in tiles of rows, and a batch one token past a
tile boundary pays for a slow remainder path. Other machines have other tiles, and a GPU is flat, so nothing about
the shape is assumed: every size the K controller uses by default (b = 1..`SMALL`) is timed, and beyond it a spaced
set (`SPACED`) interpolated between, once per (model file, machine, threads, llama.cpp build, device and layers
offloaded: `specdec_cli.core.verify_timing.measure`); `specdec_cli.stores.learnt` keeps the curve with the other
learnt state. A pass also pays attention over the context in the KV cache, so a few sizes are timed again at a
second depth and the curve prices a pass at the depth it runs at (`predict`). The K controller prices drafts on it
(`cost_model.CostModel`), the stats say where each pass's b fell on it (`cheap`, `waste_ms`), and `CurveWatch`
compares the passes a run times with `predict` at their depth.

A size b is *cheap* when no larger size costs less (within `TOLERANCE`): adding tokens up to the next cheap size is
free, while a pass at a size that is not cheap pays for tokens it could have had for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

B_MAX = 65  # the largest verify batch: K = 64 (`cost_model.K_LIMIT`) drafts + the pending token
CONTEXT = 256  # tokens in the KV cache while timing (a short prompt's worth: attention costs little at this length)
DEEP = 640  # tokens in the KV cache for the second depth (where a short session's passes run)
SMALL = 17  # every size 1..SMALL is timed: K <= 16 (`cost_model.DEFAULT_K_MAX`) drafts + the pending token
SPACED = (24, 32, 40, 48, 56, 64)  # the sizes timed beyond SMALL (multiples of 8: a CPU's tile boundaries)
DEEP_SIZES = (1, 8, 16)  # the sizes timed again at `DEEP`, for the cost of a token of context
REPEATS = 2  # passes per size; the curve takes the fastest (interference only ever adds time)
TOLERANCE = 0.02  # a size is cheap when no larger size is more than 2 % cheaper
DRIFT = 0.25  # real passes this far from the curve's prediction at their depth (either way): the curve is stale
# A measurement the machine disturbed (`VerifyCurve.disturbed`, `verify_timing.measure`): b = 1 timed again at the end
# this far from its start (either way), the median spread of the repeats above SPREAD_MAX (a quiet machine: 1-5 %),
# or the load average above the usable CPUs + LOAD_EXTRA (this process's own threads are up to the CPUs).
SPREAD_MAX = 0.25
LOAD_EXTRA = 1.0
PASSES_OFF = "passes off the curve's prediction"  # how a curve marked stale by the passes of a run says why
WATCH_MIN = 8  # passes `CurveWatch` needs before it says a curve drifted
WATCH_CONTEXT = 1024  # passes over a longer context are left out (`predict` extrapolates the depth cost beyond it)


@dataclass(frozen=True, slots=True)
class VerifyCurve:
    """v(b) for b = 1..len(ms), measured on one machine for one model file, and its cost per token of context.

    Attributes:
        ms: float ms of one pass over b tokens (logits for all b rows), b = 1..b_max, after `context` tokens: the
            fastest of `repeats` at the sizes timed, linearly interpolated between them (and extrapolated past the
            largest).
        spread: (slowest - fastest) / fastest per size timed (in the order of `sizes`; 0 with one repeat).
        repeats: passes timed per size. context: tokens in the KV cache while timing. seconds: wall time it took.
        measured_at: UTC time stamp ("2026-...Z").
        sizes: the batch sizes timed, ascending (empty: every b = 1..b_max, as an older specdec measured).
        depth: the deeper context a few sizes were timed at again (0: one depth only, `depth_ms` unknown).
        depth_ms: (per pass, per row) ms per 1,000 tokens of context past `context` (`predict`).
        stale: real passes disagreed with `predict` (`CurveWatch`): measure it again; `stale_why` says how.
        disturbed: why the machine disturbed the measurement ("" when it did not).
        provisional: kept though `disturbed`: the next session measures it again, once (`Session.verify_curve`).
        measured_for: why it was measured (a first measurement, another build, passes that disagreed, ...).
    """

    ms: tuple[float, ...]
    spread: tuple[float, ...] = ()
    repeats: int = 1
    context: int = CONTEXT
    seconds: float = 0.0
    measured_at: str = ""
    stale: bool = False
    disturbed: str = ""
    sizes: tuple[int, ...] = ()
    depth: int = 0
    depth_ms: tuple[float, float] = (0.0, 0.0)
    stale_why: str = ""
    provisional: bool = False
    measured_for: str = ""
    _floor: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.ms or any(not (np.isfinite(x) and x > 0.0) for x in self.ms):
            raise ValueError("a verify curve needs a finite, positive ms for every b >= 1")
        floor = np.minimum.accumulate(np.asarray(self.ms, dtype=np.float64)[::-1])[::-1]  # min over b' >= b
        object.__setattr__(self, "_floor", tuple(float(x) for x in floor))

    @property
    def b_max(self) -> int:
        return len(self.ms)

    def at(self, b: int) -> float:
        """v(b) in ms; b beyond the measured sizes: extrapolated with the slope of the last quarter (b >= 1)."""
        if b <= self.b_max:
            return self.ms[b - 1]
        lo = max(0, 3 * self.b_max // 4 - 1)
        slope = max((self.ms[-1] - self.ms[lo]) / max(self.b_max - 1 - lo, 1), 0.0)
        return self.ms[-1] + slope * (b - self.b_max)

    def array(self, b_max: int) -> np.ndarray:
        """float64 [b_max]: v(b) for b = 1..b_max."""
        return np.array([self.at(b) for b in range(1, b_max + 1)])

    def floor(self, b: int) -> float:
        """The cheapest pass of any size >= b, in ms (b <= b_max; beyond it v(b))."""
        return self._floor[b - 1] if b <= self.b_max else self.at(b)

    def waste_ms(self, b: int) -> float:
        """ms a pass of b tokens paid over the cheapest size >= b: what tokens up to that size would have cost."""
        return self.at(b) - self.floor(b)

    def cheap(self, b: int) -> bool:
        """No larger size costs less than v(b), within `TOLERANCE`."""
        return self.waste_ms(b) <= TOLERANCE * self.at(b)

    def cheap_sizes(self) -> list[int]:
        """Every cheap b, ascending."""
        return [b for b in range(1, self.b_max + 1) if self.cheap(b)]

    def predict(self, b: int, depth: int) -> float:
        """ms of a pass over b tokens after `depth` tokens of context: v(b) + (per pass + b x per row) x (depth -
        `context`) / 1000 (`depth_ms`; a shallower depth costs less), at least half of v(b). Without a second depth
        (`depth` 0, an older curve) v(b) at every depth."""
        base = self.at(b)
        per_pass, per_row = self.depth_ms
        return max(base + (per_pass + per_row * b) * (depth - self.context) / 1000.0, 0.5 * base)

    def drifted(self, v1_ms: float, depth: int | None = None) -> bool:
        """A real b = 1 cost `v1_ms` (after `depth` tokens of context; None: the curve's own) this far (`DRIFT`) from
        the curve's prediction: the machine or its load changed."""
        v1 = self.predict(1, self.context if depth is None else depth)
        return not (1.0 - DRIFT) * v1 <= v1_ms <= (1.0 + DRIFT) * v1

    def to_dict(self) -> dict[str, Any]:
        return {
            "ms": [round(x, 3) for x in self.ms],
            "spread": [round(x, 4) for x in self.spread],
            "repeats": self.repeats,
            "context": self.context,
            "seconds": round(self.seconds, 2),
            "measured_at": self.measured_at,
            "stale": self.stale,
            "disturbed": self.disturbed,
            "sizes": list(self.sizes),
            "depth": self.depth,
            "depth_ms": [round(x, 4) for x in self.depth_ms],
            "stale_why": self.stale_why,
            "provisional": self.provisional,
            "measured_for": self.measured_for,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyCurve:
        """Raises ValueError, TypeError or KeyError for a dict that is not a `to_dict()` (an older one, without the
        sizes and depth, reads as one timed at every size and one depth)."""
        per_pass, per_row = (float(x) for x in d.get("depth_ms", (0.0, 0.0)))
        return cls(
            ms=tuple(float(x) for x in d["ms"]),
            spread=tuple(float(x) for x in d.get("spread", ())),
            repeats=int(d.get("repeats", 1)),
            context=int(d.get("context", CONTEXT)),
            seconds=float(d.get("seconds", 0.0)),
            measured_at=str(d.get("measured_at", "")),
            stale=bool(d.get("stale", False)),
            disturbed=str(d.get("disturbed", "")),
            sizes=tuple(int(b) for b in d.get("sizes", ())),
            depth=int(d.get("depth", 0)),
            depth_ms=(per_pass, per_row),
            stale_why=str(d.get("stale_why", "")),
            provisional=bool(d.get("provisional", False)),
            measured_for=str(d.get("measured_for", "")),
        )


class CurveWatch:
    """The passes a session times, against the measured curve's prediction at their depth (`VerifyCurve.predict`):
    has the machine drifted from it?

    Fed every `Step` a front end drives (`driver.Drive`: run, chat, serve, tune, bench, plain decoding included).
    A pass is compared with the curve's price of its size at the context it ran over (a run's passes at 600-800
    tokens pay attention a curve timed at 256 does not hold, and compared with the shallow curve every ordinary run
    marked a true curve stale). Only passes over at most `WATCH_CONTEXT` tokens count (beyond it `predict` would
    extrapolate the depth cost a long way). The ratio is the median of timed / predicted over the b = 1 passes (the
    cleanest), or, while fewer than `WATCH_MIN` of those were timed (a fixed K's passes), over the passes of every
    size. Drifted: that ratio more than `DRIFT` from 1 (either way). Only the last 256 ratios of each kind are kept."""

    __slots__ = ("curve", "b1", "every", "depths")

    def __init__(self, curve: VerifyCurve) -> None:
        self.curve = curve
        self.b1: list[float] = []  # timed / predicted, b = 1 passes
        self.every: list[float] = []  # timed / predicted, passes of every size
        self.depths: list[int] = []  # the context of each pass in `every`

    def observe(self, batch_size: int, verify_ms: float, n_past: int = 0) -> None:
        """One pass over `batch_size` tokens that took `verify_ms` ms after `n_past` tokens of context (0: unknown,
        priced at the curve's own context)."""
        if verify_ms <= 0.0 or batch_size < 1 or batch_size > self.curve.b_max or n_past > WATCH_CONTEXT:
            return
        depth = n_past if n_past > 0 else self.curve.context
        ratio = verify_ms / self.curve.predict(batch_size, depth)
        if batch_size == 1:
            self.b1 = [*self.b1[-255:], ratio]
        self.every = [*self.every[-255:], ratio]
        self.depths = [*self.depths[-255:], depth]

    def ratio(self) -> float | None:
        """Median timed / predicted (1.0: the curve holds), None before `WATCH_MIN` passes were timed."""
        for xs in (self.b1, self.every):
            if len(xs) >= WATCH_MIN:
                return float(np.median(xs))
        return None

    def depth(self) -> int:
        """The median context of the passes compared (0: none)."""
        return int(np.median(self.depths)) if self.depths else 0

    def drifted(self) -> bool:
        """The passes timed cost more than `DRIFT` away from the curve's prediction (either way): it no longer
        describes this machine (another load, a governor, a rebuilt library)."""
        r = self.ratio()
        return r is not None and not 1.0 - DRIFT <= r <= 1.0 + DRIFT

    def why(self) -> str:
        """How the passes compared, one phrase beginning with `PASSES_OFF` ("" before `WATCH_MIN` passes)."""
        r = self.ratio()
        n = len(self.b1) if len(self.b1) >= WATCH_MIN else len(self.every)
        return (
            ""
            if r is None
            else (f"{PASSES_OFF}: {n} passes cost {r:.2f}x it at depth {self.depth()} (more than {DRIFT:.0%} off)")
        )
