"""A GPU's flat verify curve used well (docs/gpu.md): `--k auto` drafts as deep as the match allows, a second branch
where it is free, and a draft model only where its measured cost per token pays. Deterministic: the fake backend's
passes advance a virtual clock by a scripted cost, and the curve is measured on it (`verify_timing.measure`)."""

from __future__ import annotations

import numpy as np

from fakes import Clock, FakeBackend
from specdec_cli.core.controller import AdaptiveK, flat
from specdec_cli.core.draft import Draft
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.verify_timing import measure
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.suffix import SuffixDrafter


def gpu_ms(b: int) -> float:
    """A laptop GPU and a 1.5B model: 6 ms a pass, 0.02 ms more a row (v(64) = 1.2 v(1))."""
    return 6.0 + 0.02 * b


def cpu_ms(b: int) -> float:
    """A 2-core CPU: 60 ms a pass, 10 ms more a row."""
    return 60.0 + 10.0 * (b - 1)


COPIED = [int(t) for t in np.random.default_rng(0).permutation(np.arange(2, 700))[:400]]  # distinct tokens


def echo(prefix) -> np.ndarray:
    """The target repeats the prompt: token i of the reply is prompt token i (every prompt-lookup draft is right)."""
    logits = np.zeros(1024, np.float32)
    n = len(prefix) - len(COPIED)
    logits[COPIED[n % len(COPIED)] if n >= 0 else 2] = 5.0
    return logits


def timed(cost) -> tuple[FakeBackend, Clock]:
    clock = Clock()
    return FakeBackend(echo, n_ctx=2048, n_batch=512, vocab=1024, clock=clock, cost=cost), clock


def fast_gpu_ms(b: int) -> float:
    """A small model on a fast GPU: 2 ms a pass, flat."""
    return 2.0 + 0.005 * b


class SlowLookup(AutoDrafter):
    """Prompt lookup whose every call costs `ms` on the virtual clock (Python's work on a host that shares a GPU)."""

    def __init__(self, clock: Clock, ms: float) -> None:
        super().__init__(SuffixDrafter(None))
        self.clock, self.ms = clock, ms

    def lookup(self, context, k, sampling, rng):
        self.clock.advance(self.ms / 1e3)
        return super().lookup(context, k, sampling, rng)


def copy_steps(cost, max_tokens: int = 200, lookup_ms: float = 0.0) -> list[Step]:
    target, clock = timed(cost)
    curve = measure(target, clock=clock)
    engine = SpeculativeEngine(target, SlowLookup(clock, lookup_ms), AdaptiveK(curve=curve), clock=clock, curve=curve)
    records = list(engine.generate(np.asarray(COPIED, np.int32), GenerationConfig(max_tokens=max_tokens)))
    steps = [r for r in records if isinstance(r, Step)]
    assert [t for s in steps for t in s.emitted] == COPIED[:max_tokens]  # lossless
    return steps


def test_the_measured_gpu_curve_is_flat_and_the_cpu_one_is_not() -> None:
    target, clock = timed(gpu_ms)
    assert flat(np.asarray(measure(target, clock=clock).ms))
    target, clock = timed(cpu_ms)
    assert not flat(np.asarray(measure(target, clock=clock).ms))


def test_on_a_flat_curve_auto_drafts_32_or_more_within_5_passes() -> None:
    for cost, lookup_ms in ((gpu_ms, 0.0), (fast_gpu_ms, 0.5)):  # a lookup call a quarter of a pass is still free:
        steps = copy_steps(cost, lookup_ms=lookup_ms)  # it costs the same whatever its length
        assert max(len(s.drafted) for s in steps[:5]) >= 32, [len(s.drafted) for s in steps[:8]]
        assert len(steps) <= 12  # 200 tokens in long passes


def test_on_a_cpu_curve_auto_still_starts_slow() -> None:
    steps = copy_steps(cpu_ms)
    assert max(len(s.drafted) for s in steps[:3]) <= 6, [
        s.k for s in steps[:8]
    ]  # slow start: a failed pass costs dear here


def test_on_a_flat_curve_a_second_branch_is_verified_in_the_free_slots() -> None:
    target, clock = timed(gpu_ms)
    ctrl = AdaptiveK(curve=measure(target, clock=clock))
    a = Draft(tokens=np.arange(10, 18, dtype=np.int32), source="prompt", match_len=4)
    b = Draft(tokens=np.array([10, 11, 99, 98, 97, 96], dtype=np.int32), source="prompt", match_len=4)
    alt = ctrl.branch(a, [b], 64)
    assert alt is not None and list(alt.tokens[:3]) == [10, 11, 99]
    target, clock = timed(cpu_ms)  # on the CPU the same branch costs a token's pass per token: not taken
    assert AdaptiveK(curve=measure(target, clock=clock)).branch(a, [b], 64) is None
