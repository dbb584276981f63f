"""Benchmark the per-step overhead of the sampling math at Qwen2.5's vocabulary (V = 151,936).

Measures `process` on one row, and one whole `verify_stochastic` step, against a naive implementation (a full
float64 sort of every row, dense [V] distributions, every row processed up front), both in the same run, and
prints the median of the repeats in microseconds and the ratio naive / ours. Times are CPU time of this process
(`time.process_time`), so that other jobs on a busy machine do not inflate them; on an idle machine they equal
wall time (numpy runs these operations on one thread).

The verify step is the worst case for the lazy path: the draft is the target itself (q_i = p_i), so all k draft
tokens are accepted and all k+1 rows are processed. Logits are synthetic: N(0, 3²) over the vocabulary plus a few
peaked tokens, like a confident LM position. Sampling: temperature 0.8, top-p 0.95, min-p 0.05, top-k 40 or 0 (off).

Run:
    python benchmarks/bench_sampling.py                # 15 repeats
    python benchmarks/bench_sampling.py --repeats 50
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_cli.core.sampling import Dist, SamplingParams, make_rng, process, sample, verify_stochastic  # noqa: E402

VOCAB = 151_936


def naive_process(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The obvious version: full sort, then top-k → top-p → min-p → temperature. Returns float64 [V]."""
    l = logits.astype(np.float64)  # noqa: E741
    order = np.argsort(-l)  # [V]: the full sort
    ls = l[order]
    n = len(ls) if params.top_k <= 0 else min(params.top_k, len(ls))
    if params.top_p < 1.0:
        p = np.exp(ls[:n] - ls[0])
        n = min(int(np.searchsorted(np.cumsum(p / p.sum()), params.top_p)) + 1, n)
    if params.min_p > 0.0:
        n = int(np.count_nonzero(ls[:n] >= ls[0] + math.log(params.min_p)))
    out = np.zeros(len(ls))
    z = np.exp((ls[:n] - ls[0]) / params.temperature)
    out[order[:n]] = z / z.sum()
    return out


def naive_verify(draft: np.ndarray, q: list[np.ndarray], logits: np.ndarray, params: SamplingParams, rng) -> tuple:
    """Rejection sampling on dense [V] distributions, every row processed first."""
    ps = [naive_process(row, params) for row in logits]  # [k+1] × [V]
    for i, d in enumerate(draft):
        if rng.random() < min(1.0, ps[i][d] / q[i][d]):
            continue
        r = np.maximum(ps[i] - q[i], 0.0)
        return i, int(rng.choice(len(r), p=r / r.sum()))
    return len(draft), int(rng.choice(len(ps[-1]), p=ps[-1]))


def median_us(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e6


def synthetic_logits(rows: int, seed: int) -> np.ndarray:
    """float32 [rows, V]: N(0, 3²) plus +12 on 4 random tokens per row, read-only like llama.cpp's buffer."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((rows, VOCAB)) * 3.0).astype(np.float32)
    for row in logits:
        row[rng.choice(VOCAB, 4, replace=False)] += 12.0
    logits.setflags(write=False)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    print(f"V = {VOCAB:,}; median CPU time of {args.repeats} repeats; temperature 0.8, top-p 0.95, min-p 0.05")
    print(f"{'case':<44}{'ours µs':>10}{'naive µs':>11}{'naive/ours':>12}")
    for top_k in (40, 0):
        params = SamplingParams(temperature=0.8, top_k=top_k, top_p=0.95, min_p=0.05)
        row = synthetic_logits(1, seed=top_k)[0]
        # same answer, or the comparison means nothing
        assert np.allclose(np.bincount(process(row, params).ids, process(row, params).probs, VOCAB),
                           naive_process(row, params), atol=1e-12)
        ours = median_us(lambda: process(row, params), args.repeats)
        naive = median_us(lambda: naive_process(row, params), args.repeats)
        print(f"{f'process, top-k {top_k}':<44}{ours:>10.0f}{naive:>11.0f}{naive / ours:>12.1f}")
        for k in (4, 8):
            logits = synthetic_logits(k + 1, seed=100 + k)
            rng = make_rng(0)
            p = [process(r, params) for r in logits[:k]]
            dists: tuple[Dist, ...] = tuple(p)  # draft = target: every token accepted, all k+1 rows processed
            draft = np.array([sample(d, rng) for d in p], dtype=np.int32)
            dense_q = [np.bincount(d.ids, d.probs, VOCAB) for d in p]
            assert verify_stochastic(draft, dists, logits, params, make_rng(1))[0] == k
            ours = median_us(lambda: verify_stochastic(draft, dists, logits, params, rng), args.repeats)
            naive = median_us(lambda: naive_verify(draft, dense_q, logits, params, rng), args.repeats)
            case = f"verify_stochastic, k={k}, top-k {top_k} ({k + 1} rows)"
            print(f"{case:<44}{ours:>10.0f}{naive:>11.0f}{naive / ours:>12.1f}")


if __name__ == "__main__":
    main()
