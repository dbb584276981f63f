"""Measuring the verify curve (`specdec_cli.core.verify_curve.VerifyCurve`): target passes over b tokens with logits
for all b rows, at the sizes `plan` names, after `CONTEXT` tokens of context and a few of them again after `DEEP`,
timed through the `Backend` protocol (so a fake backend with a virtual clock measures a scripted curve exactly)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.core.verify_curve import (
    B_MAX,
    CONTEXT,
    DEEP,
    DEEP_SIZES,
    DRIFT,
    LOAD_EXTRA,
    REPEATS,
    SMALL,
    SPACED,
    SPREAD_MAX,
    VerifyCurve,
)

if TYPE_CHECKING:
    from specdec_cli.models.backend import Backend

EXTRA_MAX = 6  # sizes whose repeats differ by more than `SPREAD_MAX` are timed once more, at most this many
DEEP_MIN = 128  # the second depth is timed only this many tokens or more past the first (else the curve has one)


def plan(b_max: int = B_MAX) -> tuple[int, ...]:
    """The batch sizes `measure` times for a curve of b = 1..b_max, ascending: every size up to `SMALL` (what the
    K controller uses by default), then the `SPACED` sizes up to b_max (interpolated between)."""
    return tuple(range(1, min(SMALL, b_max) + 1)) + tuple(b for b in SPACED if SMALL < b <= b_max)


def plan_passes(b_max: int = B_MAX, repeats: int = REPEATS, deep: bool = True) -> int:
    """The progress steps of `measure` on a quiet machine: `repeats` timed passes at each size of `plan` and at each
    of `DEEP_SIZES` (with `deep`), the b = 1 passes around them, and the one-pass fills of each context."""
    sizes = plan(b_max)
    deep_sizes = [b for b in DEEP_SIZES if b <= sizes[-1]] if deep else []
    return (
        repeats * len(sizes)
        + 2 * repeats
        + (repeats - 1 > 0)
        + 1
        + (1 + repeats * len(deep_sizes) if deep_sizes else 0)
    )


def measure(
    backend: Backend,
    *,
    b_max: int = B_MAX,
    repeats: int = REPEATS,
    context: int = CONTEXT,
    deep: int = DEEP,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int], None] | None = None,
    load: Callable[[], float | None] | None = None,
) -> VerifyCurve:
    """Time one pass over b tokens with logits for all b rows at each b of `plan(b_max)`, `repeats` times each
    (ascending, then descending: a slow drift of the machine then biases no size), after `context` tokens in the KV
    cache (fewer when the context window or one batch cannot hold them); then `DEEP_SIZES` again after `deep`
    tokens, for the cost of a token of context (`VerifyCurve.depth_ms`: least squares of the extra ms over
    (1, b), at least 0; no second depth where the window holds less than `DEEP_MIN` tokens past `context`).

    The cache is emptied first and left empty (measure before a generation, not in the middle of one). The context
    is evaluated with logits for as many rows as the largest size, so no timed pass grows a buffer; one untimed
    b = 1 pass follows. b = 1 is timed `repeats` times before the rounds, once between them and `repeats` times
    after: where the pass between the rounds already disagrees with the start (`DRIFT`), the measurement stops there
    (a busy machine is not measured for a minute more) and the curve says why (`disturbed`). Sizes whose repeats
    differ by more than `SPREAD_MAX` are timed once more (the most spread first, at most `EXTRA_MAX`). Each timed
    pass waits for the device (`Backend.synchronize`) before its clock stops. `disturbed`: as `disturbance` says,
    with `load()` the load average (by default `os.getloadavg`'s 1-minute one with the real clock, none with
    another). `progress(done, total)` is called after every pass (`plan_passes` of them on a quiet machine).

    Raises what `Backend.decode` and `truncate` raise; ValueError for b_max or repeats < 1.
    """
    if b_max < 1 or repeats < 1:
        raise ValueError(f"b_max and repeats must be >= 1, got {b_max}, {repeats}")
    b_max = min(b_max, backend.n_batch, backend.n_ctx - 1)
    context = max(1, min(context, backend.n_ctx - b_max))
    sizes = plan(b_max)
    top = sizes[-1]
    deep_sizes = tuple(b for b in DEEP_SIZES if b <= top)
    deep = min(deep, backend.n_ctx - max(deep_sizes))
    if deep < context + DEEP_MIN:
        deep, deep_sizes = 0, ()
    tokens = _tokens(backend.n_vocab, max(context + top, deep + max(deep_sizes, default=0)))
    total, done = plan_passes(b_max, repeats, bool(deep_sizes)), 0

    def timed(b: int, at: int) -> float:
        nonlocal done
        ms = _timed_pass(backend, tokens[at : at + b], b, clock)
        done += 1
        if progress is not None:
            progress(done, max(total, done))
        return ms

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, max(total, done))

    start = clock()
    times: dict[int, list[float]] = {b: [] for b in sizes}
    deep_times: dict[int, list[float]] = {b: [] for b in deep_sizes}
    busy = ""
    backend.truncate(0)
    try:
        last = context - (context - 1) // backend.n_batch * backend.n_batch  # tokens in the context's last batch
        backend.decode(tokens[:context], n_logits=min(top, last))  # the output buffer at its largest
        step()
        _timed_pass(backend, tokens[context : context + 1], 1, clock)  # warm-up
        first = [timed(1, context) for _ in range(repeats)]
        end = first
        for r in range(repeats):
            for b in sizes if r % 2 == 0 else sizes[::-1]:
                times[b].append(timed(b, context))
            if r < repeats - 1:  # between the rounds: has the machine changed since the start?
                mid = timed(1, context)
                if not _near(min(first), mid):
                    busy = _moved(min(first), mid)
                    break
        if not busy:
            noisy = sorted((b for b in sizes if _spread(times[b]) > SPREAD_MAX), key=lambda b: -_spread(times[b]))
            for b in noisy[:EXTRA_MAX]:
                times[b].append(timed(b, context))
            end = [timed(1, context) for _ in range(repeats)]
            if deep_sizes:
                for i in range(context, deep, backend.n_batch):  # the deeper context, one batch at a time
                    backend.decode(tokens[i : min(deep, i + backend.n_batch)], n_logits=0)
                step()
                _timed_pass(backend, tokens[deep : deep + 1], 1, clock)  # warm-up
                for _ in range(repeats):
                    for b in deep_sizes:
                        deep_times[b].append(timed(b, deep))
    finally:
        backend.truncate(0)
    fast = {b: _fastest(t) for b, t in times.items() if t}
    spread = tuple(_spread(times[b]) for b in sizes)
    depth_ms = (
        _depth_ms(
            {b: fast[b] for b in deep_sizes}, {b: _fastest(t) for b, t in deep_times.items() if t}, deep - context
        )
        if deep_sizes and not busy
        else (0.0, 0.0)
    )
    if load is None:  # the host's load matters to its own clock, not to a virtual one
        load = _load_average if clock is time.perf_counter else lambda: None
    why = busy or disturbance(min(first), min(end), spread, load())
    done_rounds = min(len(t) for t in times.values())  # (fewer than `repeats` where a busy machine stopped it)
    return VerifyCurve(
        ms=_interpolate(fast, b_max),
        spread=spread,
        repeats=done_rounds,
        context=context,
        seconds=clock() - start,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        disturbed=why,
        sizes=sizes,
        depth=deep if deep_sizes and not busy else 0,
        depth_ms=depth_ms,
    )


def _tokens(vocab: int, n: int) -> np.ndarray:
    """int32 [n]: ids spread over the vocabulary, away from the first (special) tokens: what they are does not
    change the cost."""
    return (np.arange(n, dtype=np.int64) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1)).astype(np.int32)


def _fastest(t: list[float]) -> float:
    """The curve's figure of a size's timings: the fastest of two (interference only ever adds time), the median of
    more."""
    return min(t) if len(t) <= 2 else statistics.median(t)


def _spread(t: list[float]) -> float:
    return (max(t) - min(t)) / min(t) if len(t) > 1 else 0.0


def _near(start_ms: float, now_ms: float) -> bool:
    return (1.0 - DRIFT) * start_ms <= now_ms <= (1.0 + DRIFT) * start_ms


def _moved(start_ms: float, end_ms: float) -> str:
    return f"a one-token pass took {start_ms:.1f} ms at the start and {end_ms:.1f} ms at the end"


def _interpolate(fast: dict[int, float], b_max: int) -> tuple[float, ...]:
    """v(b) for b = 1..b_max from the sizes timed (`fast`: {b: ms}): linear between them, and past the largest
    with the slope of the last two (at least flat)."""
    bs = np.array(sorted(fast), dtype=np.float64)  # [m]
    vs = np.array([fast[int(b)] for b in bs])  # [m]
    grid = np.arange(1, b_max + 1, dtype=np.float64)  # [b_max]
    out = np.interp(grid, bs, vs)
    if len(bs) >= 2:
        slope = max((vs[-1] - vs[-2]) / (bs[-1] - bs[-2]), 0.0)
        past = grid > bs[-1]
        out[past] = vs[-1] + slope * (grid[past] - bs[-1])
    return tuple(float(x) for x in out)


def _depth_ms(shallow: dict[int, float], deep: dict[int, float], extra: int) -> tuple[float, float]:
    """(per pass, per row) ms per 1,000 tokens of context, fitted by least squares to what `extra` more tokens of
    context added to each size (`deep[b] - shallow[b]`), neither below 0."""
    bs = np.array(sorted(deep), dtype=np.float64)  # [m]
    if not len(bs) or extra <= 0:
        return 0.0, 0.0
    y = np.array([deep[int(b)] - shallow[int(b)] for b in bs]) * 1000.0 / extra  # [m] ms per 1k tokens
    if len(bs) >= 2:
        (per_pass, per_row), *_ = np.linalg.lstsq(np.stack([np.ones_like(bs), bs], axis=1), y, rcond=None)
    else:
        per_pass, per_row = float(y[0]), 0.0
    if per_row < 0.0:
        per_pass, per_row = float(y.mean()), 0.0
    elif per_pass < 0.0:
        per_pass, per_row = 0.0, float(bs @ y / (bs @ bs))
    return max(float(per_pass), 0.0), max(float(per_row), 0.0)


def disturbance(start_ms: float, end_ms: float, spread: tuple[float, ...], load: float | None) -> str:
    """Why a verify-curve measurement cannot be trusted, in one phrase ("" when it can): b = 1 timed at the start
    (`start_ms`) and again at the end (`end_ms`; the fastest of their repeats each) more than `DRIFT` apart
    (another process came or went), the median of the repeats' spreads (float [b_max]) above `SPREAD_MAX`, or the
    load average `load` (None: unknown) above the usable CPUs + `LOAD_EXTRA`."""
    from specdec_cli.models.machine import usable_cpus

    if not _near(start_ms, end_ms):
        return _moved(start_ms, end_ms)
    mid = statistics.median(spread) if spread else 0.0
    if mid > SPREAD_MAX:
        return f"repeated passes differed by {mid:.0%} (a quiet machine: under {SPREAD_MAX:.0%})"
    cpus = usable_cpus()
    if load is not None and load > cpus + LOAD_EXTRA:
        return f"the load average was {load:.1f} on {cpus} CPUs"
    return ""


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows, or a host that hides it
        return None


ATTEMPTS = 2  # measurements `measure_steady` makes before it gives up on a quiet machine
WAIT_S = 10.0  # seconds `measure_steady` waits for a busy machine to settle before it measures again


def measure_steady(
    backend: Backend,
    *,
    attempts: int = ATTEMPTS,
    say: Callable[[str], None] | None = None,
    measure_fn: Callable[..., VerifyCurve] | None = None,
    wait: Callable[[float], None] | None = None,
    **kw,
) -> VerifyCurve:
    """`measure` until a measurement is not disturbed, at most `attempts` times, calling `wait(WAIT_S)` (e.g.
    `time.sleep`; None: no wait) before each repeat; `say` is told why each disturbed one is repeated. Returns the
    last curve (its `disturbed` set when every attempt was disturbed: the caller keeps it as provisional). Keyword
    arguments go to `measure` (or to `measure_fn`, which measures `backend` with them: a caller's progress bar);
    raises what it raises."""
    once = measure_fn if measure_fn is not None else lambda **a: measure(backend, **a)
    curve = once(**kw)
    for _ in range(attempts - 1):
        if not curve.disturbed:
            break
        if say is not None:
            say(f"verify curve disturbed ({curve.disturbed}): waiting {WAIT_S:.0f} s and measuring it again")
        if wait is not None:
            wait(WAIT_S)
        curve = once(**kw)
    return curve


def measure_token_ms(
    backend: Backend, *, passes: int = 8, context: int = 64, clock: Callable[[], float] = time.perf_counter
) -> float:
    """ms of one one-token pass (a draft model's cost per drafted token): the median of `passes` passes after
    `context` tokens, after one untimed warm-up pass (a GPU's clocks ramp up). The cache is emptied first and left
    empty. Raises what `Backend.decode` and `truncate` raise; ValueError for passes < 1."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    context = max(1, min(context, backend.n_ctx - 2, backend.n_batch))
    vocab = backend.n_vocab
    tokens = np.arange(context + 1, dtype=np.int64) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1)
    tokens = tokens.astype(np.int32)
    backend.truncate(0)
    try:
        backend.decode(tokens[:context], n_logits=0)
        _timed_pass(backend, tokens[context:], 1, clock)  # warm-up
        return statistics.median(_timed_pass(backend, tokens[context:], 1, clock) for _ in range(passes))
    finally:
        backend.truncate(0)


def _timed_pass(backend: Backend, tokens: np.ndarray, n_logits: int, clock: Callable[[], float]) -> float:
    """ms of one pass over `tokens` with `n_logits` rows of logits, the device waited for (`Backend.synchronize`: a
    pass that reads no logits returns before a GPU finished it); the cache is cut back to what it held."""
    keep = len(backend.tokens)
    t0 = clock()
    backend.decode(tokens, n_logits=n_logits)
    backend.synchronize()
    ms = (clock() - t0) * 1e3
    backend.truncate(keep)
    return ms


def measure_at_depth(
    backend: Backend,
    *,
    depth: int,
    sizes: tuple[int, ...] = (1, 4, 8, 16),
    chunk: int = 256,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """What a long context costs: after `depth` tokens in the KV cache, the ms of one prefill chunk of `chunk` tokens
    (no logits) and of one verify pass over b tokens (logits for all b rows), b in `sizes`; median of `repeats`.

    Returns {"depth", "chunk", "chunk_ms", "ms": {b: ms}, "seconds"} (depth cut to what the context window and one
    batch allow). The cache is emptied first and left empty. Raises what `Backend.decode` and `truncate` raise;
    ValueError for depth < 1 or repeats < 1.
    """
    if depth < 1 or repeats < 1:
        raise ValueError(f"depth and repeats must be >= 1, got {depth}, {repeats}")
    chunk = min(chunk, backend.n_batch)
    depth = max(1, min(depth, backend.n_ctx - max(chunk, *sizes)))
    vocab = backend.n_vocab
    tokens = (
        np.arange(depth + max(chunk, *sizes), dtype=np.int64) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1)
    ).astype(np.int32)
    start = clock()
    backend.truncate(0)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    chunk_times: list[float] = []
    total, done = (len(sizes) + 1) * repeats, 0
    try:
        for i in range(0, depth, backend.n_batch):  # the context, one batch at a time
            backend.decode(tokens[i : min(depth, i + backend.n_batch)], n_logits=0)
        backend.decode(tokens[depth : depth + 1], n_logits=1)  # warm-up
        backend.truncate(depth)
        for _ in range(repeats):
            for b in (*sizes, 0):  # 0: the prefill chunk
                (times[b] if b else chunk_times).append(
                    _timed_pass(backend, tokens[depth : depth + (b or chunk)], b, clock)
                )
                done += 1
                if progress is not None:
                    progress(done, total)
    finally:
        backend.truncate(0)
    return {
        "depth": depth,
        "chunk": chunk,
        "chunk_ms": statistics.median(chunk_times),
        "ms": {b: statistics.median(t) for b, t in times.items()},
        "seconds": clock() - start,
    }


OFF_MARGIN = 0.10  # flash attention off must make a turn this much cheaper (a fraction of on's) to be chosen


def prefers_phased(turn_ms: dict[str, float]) -> bool:
    """Flash attention phased (on for prefill chunks, off for verify passes: `models.llama.PHASED`) was timed
    (`turn_ms["phased"]`) and its turn costs no more than on's."""
    return "phased" in turn_ms and float(turn_ms["phased"]) <= float(turn_ms["on"])


def prefers_on(turn_ms: dict[str, float]) -> bool:
    """Flash attention on unless off's turn (`turn_ms["off"]`, ms of a prompt token plus an output token at a long
    context) is cheaper than on's (`turn_ms["on"]`) by at least `OFF_MARGIN` of on's (`measure/flash_attn.py` says
    why). Raises KeyError/TypeError for a dict without both."""
    return float(turn_ms["off"]) > float(turn_ms["on"]) * (1 - OFF_MARGIN)
