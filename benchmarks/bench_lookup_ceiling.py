"""Benchmark: how close does `--k auto` come to the best any K policy could do with prompt lookup? (issue 5)

On a CPU the verify pass is far from free (a 65-token pass costs ~37 one-token passes on 2 cores), so lookup
drafting pays only where drafts are long *and* right, and the ceiling depends on the prompt and the machine. This
benchmark measures that ceiling instead of guessing it. Per prompt, in one process:

1. plain greedy decoding (the baseline tok/s, and the output every greedy method must reproduce);
2. the target's verify curve v(b): one forward pass over b tokens at the end of that context, median of 3;
3. offline, from the plain output: at every position, the lookup draft (`ngram`, and `suffix` with no store) and
   how many of its tokens the target would accept. From these:
   - *hindsight*: every step verifies exactly the tokens that will be accepted (an oracle: no policy can beat it),
   - *fixed K*: every step verifies min(K, draft) tokens;
4. real runs of the engine with `--k auto` and with K = 4 (decode tok/s measured like the plain run).

Speedups are over the plain run's decode tok/s; the offline rows use the measured v(b) and exclude drafting time
(~0.05 ms a step). Greedy outputs of the real runs may leave the plain output at numerical near-ties (batched
passes; see README "Is the output the same?"), so their token counts can differ slightly.

    python benchmarks/bench_lookup_ceiling.py                      # two built-in edit prompts, 256 tokens
    python benchmarks/bench_lookup_ceiling.py my_prompt.txt -n 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

BATCHES = (1, 2, 3, 5, 9, 17, 33, 65)
EDIT = Path(__file__).resolve().parent.parent / "specdec_cli" / "prompts" / "edit"


def verify_curve(target, tokens: np.ndarray) -> dict[int, float]:
    """ms of one forward pass over b tokens (logits for all b rows) appended to the cache, median of 3: {b: ms}."""
    base = len(target.tokens)
    out = {}
    for b in BATCHES:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            target.decode(tokens[:b], n_logits=b)
            times.append((time.perf_counter() - t0) * 1e3)
            target.truncate(base)
        out[b] = statistics.median(times)
    return out


def walk(rows: list[tuple[int, int]], n: int, v, k: int | None) -> float:
    """ms to produce n tokens when step i verifies min(k, draft) tokens (k None: exactly the accepted ones)."""
    i, ms = 0, 0.0
    while i < n:
        length, right = rows[i]
        verified = right if k is None else min(k, length)
        ms += v(verified + 1)
        i += min(verified, right) + 1
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", type=Path)
    ap.add_argument("-t", "--target")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from specdec_cli.cli.console import RichReporter
    from specdec_cli.core.controller import AdaptiveK, FixedK
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.core.sampling import GREEDY
    from specdec_cli.drafters.ngram import NgramDrafter
    from specdec_cli.drafters.suffix import SuffixDrafter
    from specdec_cli.driver import generate
    from specdec_cli.session import open_session
    from specdec_cli.spec import ModelOptions

    paths = args.prompts or [EDIT / "textwrap_rename.txt", EDIT / "colorsys_type_hints.txt"]
    console = Console(stderr=True)
    config = GenerationConfig(max_tokens=args.max_tokens)
    rng = np.random.default_rng(0)
    table = Table(title=f"Prompt lookup against its ceiling: speedup over plain decoding, {args.max_tokens} tokens")
    for col in ("prompt", "drafter", "oracle", "K=4", "K=16", "auto, real", "K=4, real"):
        table.add_column(col, justify="left" if col in ("prompt", "drafter") else "right")
    with open_session(ModelOptions(target=args.target), need_draft=False, reporter=RichReporter(console)) as session:
        target = session.target
        for path in paths:
            prompt = session.prompt_tokens(path.read_text(encoding="utf-8"))
            generate(SpeculativeEngine(target, None), prompt, GenerationConfig(max_tokens=4))  # warm-up, prefill
            plain = generate(SpeculativeEngine(target, None), prompt, config)
            out = np.asarray(plain.tokens, dtype=np.int32)
            curve = verify_curve(target, np.resize(out, max(BATCHES)))
            bs, ms = np.array(list(curve), dtype=np.float64), np.array(list(curve.values()))

            def v(b: int, bs: np.ndarray = bs, ms: np.ndarray = ms) -> float:
                return float(np.interp(b, bs, ms))

            plain_ms = len(out) * v(1)
            full = np.concatenate((prompt, out))
            for drafter in (NgramDrafter(2, 4), SuffixDrafter(None, preload=False)):
                drafter.begin(prompt)
                rows = []
                for i in range(len(out)):
                    d = drafter.propose(full[: len(prompt) + i], 64, GREEDY, rng)
                    truth = out[i : i + len(d)]
                    wrong = np.flatnonzero(d.tokens[: len(truth)] != truth)
                    rows.append((len(d), int(wrong[0]) if len(wrong) else len(truth)))
                real = {}
                for label, ctrl in (("auto", AdaptiveK()), ("4", FixedK(4))):
                    name = drafter.name
                    engine_drafter = NgramDrafter(2, 4) if name == "ngram" else SuffixDrafter(None, preload=False)
                    g = generate(SpeculativeEngine(target, engine_drafter, ctrl), prompt, config)
                    real[label] = g.stats.tokens_per_s / plain.stats.tokens_per_s
                table.add_row(
                    path.stem,
                    drafter.name,
                    *(f"{plain_ms / walk(rows, len(out), v, k):.2f}×" for k in (None, 4, 16)),
                    f"{real['auto']:.2f}×",
                    f"{real['4']:.2f}×",
                )
            console.print(
                f"{path.stem}: plain {plain.stats.tokens_per_s:.1f} tok/s; v(b) ms: "
                + ", ".join(f"{b}: {m:.0f}" for b, m in curve.items()),
                highlight=False,
            )
    Console(width=max(100, Console().width)).print(table)
    print("oracle, K=4, K=16: offline from the plain output and the measured v(b); real: measured runs of the engine")


if __name__ == "__main__":
    main()
