"""Benchmark the suffix drafter: store build/merge/save/load cost, memory, and µs per propose.

The store is filled with synthetic code-like token streams (~300k tokens by default): a few hundred "templates"
(functions made of lines of Zipf-distributed tokens), each emitted many times with variations (renamed
identifiers, edited, dropped and inserted lines), as an agent loop or a code assistant would produce. The
workload then "generates" fresh variants token by token: propose(context, k) against the store, the target is the
variant itself, and the context advances by the accepted prefix + 1, as in the engine.

Run:
    python benchmarks/bench_suffix.py                 # 300k tokens, k=8
    python benchmarks/bench_suffix.py --tokens 2000000 --k 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_cli.drafters.suffix import SuffixDrafter  # noqa: E402
from specdec_cli.core.sampling import GREEDY  # noqa: E402
from specdec_cli.stores.suffix_store import SuffixStore  # noqa: E402
from specdec_cli.stores.suffix_index import Corpus  # noqa: E402

VOCAB = 32_000
FP = "ab" * 32


def zipf_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return (np.minimum(rng.zipf(1.3, n), VOCAB - 1000) + 999).astype(np.int32)


def make_templates(rng: np.random.Generator, n: int) -> list[list[np.ndarray]]:
    """Templates: lists of 10..60 lines of 3..14 tokens."""
    return [[zipf_tokens(rng, int(rng.integers(3, 15))) for _ in range(int(rng.integers(10, 60)))] for _ in range(n)]


def variant(rng: np.random.Generator, tpl: list[np.ndarray]) -> np.ndarray:
    """One emission of a template: rename 0..3 identifiers, drop/insert/edit ~10% of lines."""
    rename = {int(t): int(rng.integers(1000, VOCAB)) for t in rng.choice(np.concatenate(tpl), 3)}
    lines: list[np.ndarray] = []
    for line in tpl:
        r = rng.random()
        if r < 0.04:
            continue
        if r < 0.08:
            lines.append(zipf_tokens(rng, int(rng.integers(3, 12))))
        line = line.copy()
        if rng.random() < 0.05:
            line[int(rng.integers(len(line)))] = int(rng.integers(1000, VOCAB))
        lines.append(line)
    doc = np.concatenate(lines + [np.array([2], np.int32)])  # 2 = end of turn
    for a, b in rename.items():
        if rng.random() < 0.5:
            doc[doc == a] = b
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300_000, help="store size in tokens")
    ap.add_argument("--k", type=int, default=8, help="draft length asked for")
    ap.add_argument("--queries", type=int, default=20, help="generations simulated")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    templates = make_templates(rng, max(20, args.tokens // 1500))
    docs: list[np.ndarray] = []
    total = 0
    while total < args.tokens:
        docs.append(variant(rng, templates[int(rng.integers(len(templates)))]))
        total += len(docs[-1])
    print(f"store: {len(docs)} documents, {total:,} tokens, {len(templates)} templates")

    tracemalloc.start()
    t0 = time.perf_counter()
    corpus = Corpus.build(docs)
    build_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"build (suffix array, from scratch): {build_s * 1e3:.0f} ms, peak {peak / 2**20:.0f} MiB")

    extra = [variant(rng, templates[int(rng.integers(len(templates)))]) for _ in range(20)]
    t0 = time.perf_counter()
    for d in extra:
        corpus = corpus.with_documents([d], [time.time()])
    print(f"add one document to it (merge, ~{np.mean([len(d) for d in extra]):.0f} tokens): "
          f"{(time.perf_counter() - t0) / len(extra) * 1e3:.1f} ms")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "suffix" / f"{FP[:16]}.npz"
        store = SuffixStore(path, fingerprint=FP, max_tokens=10 * args.tokens)
        store.extend(docs)
        t0 = time.perf_counter()
        assert store.save()
        print(f"first save (builds the array again): {(time.perf_counter() - t0) * 1e3:.0f} ms, "
              f"{path.stat().st_size / 2**20:.1f} MiB on disk")  # fmt: skip
        store = SuffixStore(path, fingerprint=FP, max_tokens=10 * args.tokens)
        t0 = time.perf_counter()
        store.add(extra[0])  # what a run's finish() + close() cost: load, merge one document, write
        assert store.save()
        print(f"end of a run (load + add one document + save): {(time.perf_counter() - t0) * 1e3:.0f} ms")

        t0 = time.perf_counter()
        store = SuffixStore(path, fingerprint=FP)
        drafter = SuffixDrafter(store, preload=False)
        ctor_us = (time.perf_counter() - t0) * 1e6
        t0 = time.perf_counter()
        drafter.propose(extra[0][:50], args.k, GREEDY, rng)
        first_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        drafter.propose(extra[0][:52], args.k, GREEDY, rng)
        second_us = (time.perf_counter() - t0) * 1e6
        print(f"start-up: SuffixStore() + SuffixDrafter() {ctor_us:.0f} µs; first propose (loads {path.name}) "
              f"{first_ms:.1f} ms, the next {second_us:.0f} µs; in memory {store.corpus.nbytes / 2**20:.1f} MiB")  # fmt: skip
        store = SuffixStore(path, fingerprint=FP)
        drafter = SuffixDrafter(store)  # preload=True: a thread reads the file while the models load
        time.sleep(0.5)  # loading a GGUF and evaluating the prompt take longer than this
        t0 = time.perf_counter()
        drafter.begin(extra[0][:50])
        print(f"with preload (the default): the engine's drafter prefill waits {(time.perf_counter() - t0) * 1e3:.1f} ms")

        times: list[float] = []
        cpu: list[float] = []  # thread CPU time: the cost without preemption by other processes
        accepted: list[int] = []
        sources = {"local": 0, "global": 0, "": 0}
        for _ in range(args.queries):
            target = variant(rng, templates[int(rng.integers(len(templates)))])
            n = min(40, len(target) - 1)  # the "prompt"
            drafter.begin(target[:n])
            while n < len(target):
                c0, t0 = time.thread_time(), time.perf_counter()
                draft = drafter.propose(target[:n], args.k, GREEDY, rng)
                times.append((time.perf_counter() - t0) * 1e6)
                cpu.append((time.thread_time() - c0) * 1e6)
                ref = target[n : n + len(draft)]
                acc = int(np.argmin(np.r_[draft.tokens[: len(ref)] == ref, False]))
                accepted.append(acc)
                sources[drafter.last.source if len(draft) else ""] += 1
                n += acc + 1
        for what, t in (("wall", np.array(times)), ("cpu", np.array(cpu))):
            p90, p99 = np.percentile(t, [90, 99])
            print(f"propose (k={args.k}, {len(t)} steps, {what}): median {np.median(t):.0f} µs, "
                  f"p90 {p90:.0f} µs, p99 {p99:.0f} µs, max {t.max():.0f} µs")  # fmt: skip
        print(f"mean accepted per step {statistics.mean(accepted):.2f} (tokens per target pass "
              f"{statistics.mean(accepted) + 1:.2f}); drafts from local {sources['local']}, global "
              f"{sources['global']}, none {sources['']}")  # fmt: skip


if __name__ == "__main__":
    main()
