"""Paired timing: two sides of a comparison measured in interleaved pairs, after a warm-up, the order alternating.

A single speed ratio measured once on a shared machine is noise: whichever side runs first pays the warm-up (pages
of the weights, caches, the CPU's clock ramping up), and another process waking up slows whichever side is running
then, so plain decoding timed against itself that way lands several per cent either side of 1×. So:

1. `warmup` runs once, untimed, before either side is timed;
2. the sides then run in `n` pairs, A B, B A, A B, ...: the order alternates, so drift and any residual warm-up
   favour neither side;
3. the ratio is computed within each pair (A's rate over B's rate, the two measured back to back), and reported as
   the median over the pairs with its spread, the smallest and largest pair ratio.

Plain decoding against itself (A/A) measured this way shows the noise floor of the sitting: its median should be
within a few per cent of 1×, and its min–max is the band inside which a speedup means nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

A = TypeVar("A")
B = TypeVar("B")

DEFAULT_PAIRS = 3  # `run --compare` without a number


@dataclass(frozen=True, slots=True)
class Pair:
    """One pair: each side's rate (e.g. decode tok/s; any unit, the same for both) and which side ran first."""

    a: float
    b: float
    a_first: bool

    @property
    def ratio(self) -> float:
        """a / b (0.0 when b is 0: nothing measured)."""
        return self.a / self.b if self.b > 0 else 0.0


@dataclass(frozen=True)
class Paired(Generic[A, B]):
    """The pairs in the order they ran, and each side's results (its own return values, in the same order)."""

    pairs: tuple[Pair, ...]
    a_results: tuple[A, ...] = ()
    b_results: tuple[B, ...] = ()

    @property
    def ratios(self) -> list[float]:
        return [p.ratio for p in self.pairs]

    @property
    def median(self) -> float:
        """The median of the per-pair ratios (0.0 without pairs)."""
        return statistics.median(self.ratios) if self.pairs else 0.0

    @property
    def low(self) -> float:
        return min(self.ratios, default=0.0)

    @property
    def high(self) -> float:
        return max(self.ratios, default=0.0)

    @property
    def a_median(self) -> float:
        return statistics.median(p.a for p in self.pairs) if self.pairs else 0.0

    @property
    def b_median(self) -> float:
        return statistics.median(p.b for p in self.pairs) if self.pairs else 0.0

    def to_dict(self, a: str = "a", b: str = "b") -> dict:
        """For --json: the median ratio, its min and max, and every pair (rates named `a` and `b`)."""
        return {
            "pairs": len(self.pairs),
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "each": [{a: p.a, b: p.b, "ratio": p.ratio, "first": a if p.a_first else b} for p in self.pairs],
        }


def measure(
    side_a: Callable[[], tuple[float, A]],
    side_b: Callable[[], tuple[float, B]],
    n: int,
    *,
    warmup: Callable[[], None] | None = None,
) -> Paired[A, B]:
    """Run `warmup` once (untimed), then `n` pairs of the two sides, A first in pairs 1, 3, 5, ..., B first in the
    others. Each side returns (its rate, its result); the rates are paired as measured.

    Raises:
        ValueError: n < 1.
        KeyboardInterrupt: passed on; the pairs measured so far are lost (a partial comparison is not reported).
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if warmup is not None:
        warmup()
    pairs: list[Pair] = []
    a_results: list[A] = []
    b_results: list[B] = []
    for i in range(n):
        a_first = i % 2 == 0
        if a_first:
            (ra, xa), (rb, xb) = side_a(), side_b()
        else:
            (rb, xb), (ra, xa) = side_b(), side_a()
        pairs.append(Pair(ra, rb, a_first))
        a_results.append(xa)
        b_results.append(xb)
    return Paired(tuple(pairs), tuple(a_results), tuple(b_results))
