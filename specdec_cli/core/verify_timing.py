"""Measuring the verify curve (`specdec_cli.core.verify_curve.VerifyCurve`): one target pass over b tokens with logits
for all b rows, b = 1..65, timed through the `Backend` protocol (so a fake backend with a virtual clock measures a
scripted curve exactly)."""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from specdec_cli.core.verify_curve import B_MAX, CONTEXT, DRIFT, LOAD_EXTRA, REPEATS, SPREAD_MAX, VerifyCurve

if TYPE_CHECKING:
    from specdec_cli.models.backend import Backend


def measure(backend: Backend, *, b_max: int = B_MAX, repeats: int = REPEATS, context: int = CONTEXT,
            clock: Callable[[], float] = time.perf_counter,
            progress: Callable[[int, int], None] | None = None,
            load: Callable[[], float | None] | None = None) -> VerifyCurve:
    """Time one pass over b tokens with logits for all b rows, b = 1..b_max, `repeats` times each, after `context`
    tokens in the KV cache (fewer when the context window or one batch cannot hold them).

    The cache is emptied first and left empty (measure before a generation, not in the middle of one). Order: an
    untimed warm-up pass at b_max and at 1, then b ascending, then descending (a slow drift of the machine then
    biases no size), with b = 1 timed `repeats` times before the rounds and again after them. The curve's
    `disturbed` says why the machine disturbed the measurement, "" when it did not (`disturbance`: the fastest b = 1
    pass after the rounds against the fastest before them, since one pass preempted once is not a busy machine; the
    repeats' spread; `load()`, the load average: by default `os.getloadavg`'s 1-minute one with the real clock, none
    with another). `progress(done, total)` is called after every timed pass of the rounds. On this kind of host
    (2 cores, Qwen2.5-Coder-1.5B Q4_K_M) one round takes ~15 s.

    Raises what `Backend.decode` and `truncate` raise; ValueError for b_max or repeats < 1.
    """
    if b_max < 1 or repeats < 1:
        raise ValueError(f"b_max and repeats must be >= 1, got {b_max}, {repeats}")
    b_max = min(b_max, backend.n_batch, backend.n_ctx - 1)
    context = max(1, min(context, backend.n_ctx - b_max))
    vocab = backend.n_vocab
    # ids spread over the vocabulary, away from the first (special) tokens: what they are does not change the cost
    tokens = (np.arange(context + b_max, dtype=np.int64) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1))
    tokens = tokens.astype(np.int32)
    start = clock()
    backend.truncate(0)
    backend.decode(tokens[:context], n_logits=0)
    times: list[list[float]] = [[] for _ in range(b_max)]
    total, done = b_max * repeats, 0
    try:
        for b in (b_max, 1):  # warm-up: weights paged in, buffers at their largest
            backend.decode(tokens[context : context + b], n_logits=b)
            backend.truncate(context)
        first = [_timed_pass(backend, tokens[context : context + 1], 1, clock) for _ in range(repeats)]
        for r in range(repeats):
            for b in range(1, b_max + 1) if r % 2 == 0 else range(b_max, 0, -1):
                times[b - 1].append(_timed_pass(backend, tokens[context : context + b], b, clock))
                done += 1
                if progress is not None:
                    progress(done, total)
        end = [_timed_pass(backend, tokens[context : context + 1], 1, clock) for _ in range(repeats)]
    finally:
        backend.truncate(0)
    ms = tuple(min(t) if len(t) <= 2 else statistics.median(t) for t in times)
    spread = tuple((max(t) - min(t)) / min(t) for t in times)
    if load is None:  # the host's load matters to its own clock, not to a virtual one
        load = _load_average if clock is time.perf_counter else lambda: None
    why = disturbance(min(first), min(end), spread, load())
    return VerifyCurve(ms=ms, spread=spread, repeats=repeats, context=context, seconds=clock() - start,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), disturbed=why)


def disturbance(start_ms: float, end_ms: float, spread: tuple[float, ...], load: float | None) -> str:
    """Why a verify-curve measurement cannot be trusted, in one phrase ("" when it can): b = 1 timed at the start
    (`start_ms`) and again at the end (`end_ms`; the fastest of their repeats each) more than `DRIFT` apart
    (another process came or went), the median of the repeats' spreads (float [b_max]) above `SPREAD_MAX`, or the
    load average `load` (None: unknown) above the usable CPUs + `LOAD_EXTRA`."""
    from specdec_cli.models.machine import usable_cpus

    if not (1.0 - DRIFT) * start_ms <= end_ms <= (1.0 + DRIFT) * start_ms:
        return f"a one-token pass took {start_ms:.1f} ms at the start and {end_ms:.1f} ms at the end"
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


def measure_steady(backend: Backend, *, attempts: int = ATTEMPTS, say: Callable[[str], None] | None = None,
                   measure_fn: Callable[..., VerifyCurve] | None = None, **kw) -> VerifyCurve:
    """`measure` until a measurement is not disturbed, at most `attempts` times; `say` is told why each disturbed
    one is repeated. Returns the last curve (its `disturbed` set when every attempt was disturbed: the caller uses it
    and does not keep it). Keyword arguments go to `measure` (or to `measure_fn`, which measures `backend` with them:
    a caller's progress bar); raises what it raises."""
    once = measure_fn if measure_fn is not None else lambda **a: measure(backend, **a)
    curve = once(**kw)
    for _ in range(attempts - 1):
        if not curve.disturbed:
            break
        if say is not None:
            say(f"verify curve disturbed ({curve.disturbed}): measuring it again")
        curve = once(**kw)
    return curve


def measure_token_ms(backend: Backend, *, passes: int = 8, context: int = 64,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    """ms of one one-token pass (a draft model's cost per drafted token): the median of `passes` passes after
    `context` tokens, after one untimed warm-up pass (a GPU's clocks ramp up). The cache is emptied first and left
    empty. Raises what `Backend.decode` and `truncate` raise; ValueError for passes < 1."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    context = max(1, min(context, backend.n_ctx - 2, backend.n_batch))
    vocab = backend.n_vocab
    tokens = (np.arange(context + 1, dtype=np.int64) * 7919 % max(vocab - 256, 1) + min(256, vocab - 1))
    tokens = tokens.astype(np.int32)
    backend.truncate(0)
    try:
        backend.decode(tokens[:context], n_logits=0)
        _timed_pass(backend, tokens[context:], 1, clock)  # warm-up
        return statistics.median(_timed_pass(backend, tokens[context:], 1, clock) for _ in range(passes))
    finally:
        backend.truncate(0)


def _timed_pass(backend: Backend, tokens: np.ndarray, n_logits: int, clock: Callable[[], float]) -> float:
    """ms of one pass over `tokens` with `n_logits` rows of logits; the cache is cut back to what it held."""
    keep = len(backend.tokens)
    t0 = clock()
    backend.decode(tokens, n_logits=n_logits)
    ms = (clock() - t0) * 1e3
    backend.truncate(keep)
    return ms


def measure_at_depth(backend: Backend, *, depth: int, sizes: tuple[int, ...] = (1, 4, 8, 16), chunk: int = 256,
                     repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
                     progress: Callable[[int, int], None] | None = None) -> dict:
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
    tokens = (np.arange(depth + max(chunk, *sizes), dtype=np.int64) * 7919 % max(vocab - 256, 1)
              + min(256, vocab - 1)).astype(np.int32)
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
                (times[b] if b else chunk_times).append(_timed_pass(backend, tokens[depth : depth + (b or chunk)], b,
                                                                    clock))
                done += 1
                if progress is not None:
                    progress(done, total)
    finally:
        backend.truncate(0)
    return {"depth": depth, "chunk": chunk, "chunk_ms": statistics.median(chunk_times),
            "ms": {b: statistics.median(t) for b, t in times.items()}, "seconds": clock() - start}


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
