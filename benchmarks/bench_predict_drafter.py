"""Micro-benchmark of the predicted-outputs drafter: milliseconds per `propose` (pure CPU, no model).

The prediction is a synthetic code-like file of `--tokens` tokens (lines of Zipf-distributed tokens, each piece a
short word, lines ending in a newline token). The output is the prediction with an edit every `--edit-every` lines
(a changed line, a deleted line or an inserted line, in turn), fed as the engine would: a step commits the accepted
prefix of the draft plus one target token. Steps that ran a re-sync search (the output had diverged) are timed as
"re-sync", the others as "aligned".

Run:
    python benchmarks/bench_predict_drafter.py                  # 4,000-token prediction, K = 16
    python benchmarks/bench_predict_drafter.py --tokens 16000 --k 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_cli.drafters.predict import PredictionDrafter  # noqa: E402
from specdec_cli.core.sampling import GREEDY  # noqa: E402

NL = 1
VOCAB = 5000


def piece(t: int) -> bytes:
    return b"\n" if t == NL else f" t{t}".encode()


def make_lines(n_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    lines, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(3, 14))
        line = [int(x) for x in np.minimum(rng.zipf(1.3, n) + 1, VOCAB - 1)] + [NL]
        lines.append(line)
        total += len(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000, help="prediction length in tokens")
    ap.add_argument("--k", type=int, default=16, help="draft length asked per step")
    ap.add_argument("--edit-every", type=int, default=12, help="an edit every this many lines")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lines = make_lines(args.tokens, rng)
    pred = np.array([t for line in lines for t in line], dtype=np.int32)
    out_lines = []
    for i, line in enumerate(lines):
        kind = (i // args.edit_every) % 3 if i % args.edit_every == args.edit_every - 1 else -1
        if kind == 0:  # changed line
            out_lines.append(line[:2] + [VOCAB - 2] + line[3:])
        elif kind == 1:  # deleted line
            continue
        elif kind == 2:  # inserted line
            out_lines.append([VOCAB - 3, VOCAB - 4, NL])
            out_lines.append(line)
        else:
            out_lines.append(line)
    output = np.array([t for line in out_lines for t in line], dtype=np.int32)
    prompt = np.arange(2, 200, dtype=np.int32)
    context = np.concatenate((prompt, output))
    rng_draft = np.random.default_rng(0)

    t0 = time.perf_counter()
    drafter = PredictionDrafter(pred, piece=piece)
    build_ms = (time.perf_counter() - t0) * 1e3
    aligned, resync = [], []
    accepted = steps = 0
    for _ in range(args.repeats):
        drafter.begin(prompt)
        n = 0  # output tokens committed
        while n < len(output):
            before = drafter.n_resyncs
            t = time.perf_counter()
            draft = drafter.propose(context[: len(prompt) + n], args.k, GREEDY, rng_draft)
            ms = (time.perf_counter() - t) * 1e3
            (resync if drafter.n_resyncs > before else aligned).append(ms)
            d = draft.tokens
            truth = output[n : n + len(d)]
            n_acc = int(np.argmin(np.append(d[: len(truth)] == truth, False)))
            accepted += n_acc
            steps += 1
            n += n_acc + 1
    print(f"prediction {len(pred)} tokens, output {len(output)} tokens, K = {args.k}, build {build_ms:.2f} ms")
    print(f"steps {steps // args.repeats} per run, tokens per step {len(output) * args.repeats / steps:.2f}, "
          f"accepted drafts {accepted / (len(output) * args.repeats):.1%} of the output")
    print(f"aligned steps: {len(aligned)}  median propose {statistics.median(aligned):.4f} ms  "
          f"p99 {np.percentile(aligned, 99):.4f} ms")
    if resync:
        print(f"re-sync steps: {len(resync)}  median propose {statistics.median(resync):.4f} ms  "
              f"p99 {np.percentile(resync, 99):.4f} ms  max {max(resync):.4f} ms")


if __name__ == "__main__":
    main()
