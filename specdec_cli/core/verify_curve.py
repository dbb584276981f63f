"""The measured verify curve: v(b), the ms of one target pass over b tokens with logits for every row, b = 1..65.

On a CPU, v(b) is not monotone: llama.cpp's repacked kernels multiply in tiles of rows, and a batch one token past a
tile boundary pays for a slow remainder path (measured on a 2-core Zen 5: 185 ms at b = 15, 146 ms at b = 16). Other
machines have other tiles, and a GPU is flat, so nothing about the shape is assumed: every b is timed once per
(model file, machine, threads, llama.cpp build), in seconds (`specdec_cli.core.verify_timing.measure`), and
`specdec_cli.stores.learnt` keeps the curve with the other learnt state. The K controller prices drafts on it
(`cost_model.CostModel`), and the stats say where each pass's b fell on it (`cheap`, `waste_ms`).

A size b is *cheap* when no larger size costs less (within `TOLERANCE`): adding tokens up to the next cheap size is
free, while a pass at a size that is not cheap pays for tokens it could have had for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

B_MAX = 65  # the largest verify batch: K = 64 (`cost_model.K_LIMIT`) drafts + the pending token
CONTEXT = 256  # tokens in the KV cache while timing (a short prompt's worth: attention costs little at this length)
REPEATS = 2  # passes per size; the curve takes the fastest (interference only ever adds time)
TOLERANCE = 0.02  # a size is cheap when no larger size is more than 2 % cheaper
DRIFT = 0.25  # v(1) measured by real passes this far from the curve's (either way): the curve is stale
# A measurement the machine disturbed (`VerifyCurve.disturbed`, `verify_timing.measure`): b = 1 timed again at the end
# this far from its start (either way), the median spread of the repeats above SPREAD_MAX (a quiet machine: 1-5 %),
# or the load average above the usable CPUs + LOAD_EXTRA (this process's own threads are up to the CPUs).
SPREAD_MAX = 0.25
LOAD_EXTRA = 1.0
WATCH_MIN = 8  # passes `CurveWatch` needs before it says a curve drifted
WATCH_CONTEXT = 1024  # passes over a longer context are left out of the all-sizes ratio (attention adds to them)


@dataclass(frozen=True, slots=True)
class VerifyCurve:
    """v(b) for b = 1..len(ms), measured on one machine for one model file.

    Attributes:
        ms: float ms of one pass over b tokens (logits for all b rows), b = 1..b_max: the fastest of `repeats`.
        spread: (slowest - fastest) / fastest per b, over the repeats (0 with one repeat).
        repeats: passes timed per size. context: tokens in the KV cache while timing. seconds: wall time it took.
        measured_at: UTC time stamp ("2026-...Z").
        stale: the b = 1 cost of real passes drifted more than `DRIFT` from it (`drifted`): measure it again.
        disturbed: why the machine disturbed the measurement ("" when it did not): such a curve is used by the
            session that measured it and not kept (`Session.verify_curve`).
    """

    ms: tuple[float, ...]
    spread: tuple[float, ...] = ()
    repeats: int = 1
    context: int = CONTEXT
    seconds: float = 0.0
    measured_at: str = ""
    stale: bool = False
    disturbed: str = ""
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

    def drifted(self, v1_ms: float) -> bool:
        """A real b = 1 cost `v1_ms` this far (`DRIFT`) from the curve's: the machine or its load changed."""
        return not (1.0 - DRIFT) * self.ms[0] <= v1_ms <= (1.0 + DRIFT) * self.ms[0]

    def to_dict(self) -> dict[str, Any]:
        return {"ms": [round(x, 3) for x in self.ms], "spread": [round(x, 4) for x in self.spread],
                "repeats": self.repeats, "context": self.context, "seconds": round(self.seconds, 2),
                "measured_at": self.measured_at, "stale": self.stale, "disturbed": self.disturbed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyCurve:
        """Raises ValueError, TypeError or KeyError for a dict that is not a `to_dict()`."""
        return cls(ms=tuple(float(x) for x in d["ms"]), spread=tuple(float(x) for x in d.get("spread", ())),
                   repeats=int(d.get("repeats", 1)), context=int(d.get("context", CONTEXT)),
                   seconds=float(d.get("seconds", 0.0)), measured_at=str(d.get("measured_at", "")),
                   stale=bool(d.get("stale", False)), disturbed=str(d.get("disturbed", "")))


class CurveWatch:
    """The passes a session times, against the measured curve they were placed on: has the machine drifted from it?

    Fed every `Step` a front end drives (`driver.Drive`: run, chat, serve, tune, bench, plain decoding included).
    Only passes over at most `WATCH_CONTEXT` tokens of context count (a deeper pass pays attention the curve, timed
    over `VerifyCurve.context` tokens, does not hold: an agent's 1-token passes over 6k tokens cost ~1.3x v(1) on a
    CPU, and counting them made every long session mark a true curve stale). The ratio is the median of timed / curve
    over the b = 1 passes (the cleanest), or, while fewer than `WATCH_MIN` of those were timed (a fixed K's passes),
    over the passes of every size. Drifted: that ratio more than `DRIFT` from 1 (either way). Only the last 256
    ratios of each kind are kept."""

    __slots__ = ("curve", "b1", "every")

    def __init__(self, curve: VerifyCurve) -> None:
        self.curve = curve
        self.b1: list[float] = []  # timed / curve, b = 1 passes
        self.every: list[float] = []  # timed / curve, passes of every size at short contexts

    def observe(self, batch_size: int, verify_ms: float, n_past: int = 0) -> None:
        """One pass over `batch_size` tokens that took `verify_ms` ms after `n_past` tokens of context."""
        if verify_ms <= 0.0 or batch_size < 1 or batch_size > self.curve.b_max:
            return
        ratio = verify_ms / self.curve.at(batch_size)
        if n_past > WATCH_CONTEXT:
            return  # attention over a long context adds to every size, b = 1 too: not the curve's business
        if batch_size == 1:
            self.b1 = [*self.b1[-255:], ratio]
        self.every = [*self.every[-255:], ratio]

    def ratio(self) -> float | None:
        """Median timed / curve (1.0: the curve holds), None before `WATCH_MIN` passes were timed."""
        for xs in (self.b1, self.every):
            if len(xs) >= WATCH_MIN:
                return float(np.median(xs))
        return None

    def drifted(self) -> bool:
        """The passes timed cost more than `DRIFT` away from the curve (either way): it no longer describes this
        machine (another load, a governor, a rebuilt library)."""
        r = self.ratio()
        return r is not None and not 1.0 - DRIFT <= r <= 1.0 + DRIFT
