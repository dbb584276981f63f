"""Predicted outputs (`--predict`) against prompt lookup and plain decoding, on whole-file edits, in one sitting.

For each packaged edit prompt (`specdec_cli/prompts/predict/`: rename a function, add a parameter, change one line,
each returning a whole 150-250-line file) with its original file as the prediction: specdec `none`, `ngram`, `auto`
without the prediction, `predict` (the prediction alone) and `auto` with it. Then the iterate-on-an-instruction
loop on the first prompt: the prompt slightly changed, with the previous reply as the prediction, beside `suffix`
whose store has learnt that previous reply. Greedy; decode tok/s (prefill excluded); tokens per target pass.

    SPECDEC_HOME=$(mktemp -d) python benchmarks/bench_predict.py            # -n 512 by default
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import generate
from specdec_cli.assemble import Assembler
from specdec_cli.prompts import predict_cases
from specdec_cli.cli.console import RichReporter
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions
from specdec_cli.measure.sweep import NoLearning


def run(assembler: Assembler, method: str, prompt, config: GenerationConfig, *, learn: bool = False):
    spec = SpecOptions(method=method)
    inner = assembler.make_drafter(spec)  # ours to close
    engine = assembler.engine(spec, fresh=True,
                              drafter=NoLearning(inner) if inner is not None and not learn else inner)
    try:
        return generate(engine, prompt, config)
    finally:
        if inner is not None:
            inner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    console = Console(stderr=True)
    t0 = time.perf_counter()
    rows: list[tuple[str, str, float, float, str]] = []
    with open_session(ModelOptions(target=args.target, ctx=args.ctx, prompt_cache=False), method="auto",
                      reporter=RichReporter(console)) as session, Assembler(session) as assembler:
        base = GenerationConfig(max_tokens=args.max_tokens)
        first = None
        for case in predict_cases():
            prompt = session.prompt_tokens(case.prompt)
            pred = session.prediction_tokens(case.prediction)
            run(assembler, "none", prompt, replace(base, max_tokens=4))  # prefill once, untimed
            plain = None
            for label, method, config in (("none", "none", base), ("ngram", "ngram", base),
                                          ("auto", "auto", base),
                                          ("predict", "predict", replace(base, prediction=pred)),
                                          ("auto --predict", "auto", replace(base, prediction=pred))):
                g = run(assembler, method, prompt, config)
                plain = plain or g.stats.tokens_per_s
                s = g.stats
                note = (f"{s.accepted_prediction_tokens} accepted / {s.rejected_prediction_tokens} rejected "
                        f"prediction tokens" if config.prediction else "")
                rows.append((case.name, label, s.tokens_per_s, s.tokens_per_pass, note))
                console.print(f"{case.name:14s} {label:15s} {s.tokens_per_s:6.1f} tok/s ({s.tokens_per_s / plain:.2f}x)"
                              f" {s.n_generated} tokens, {s.tokens_per_pass:.1f} per pass {note}", highlight=False)
                if first is None and label == "none":
                    first = (case, g)
        # iterate on the instruction: a changed prompt, the previous reply as the prediction vs a store that learnt it
        case, previous = first
        changed = session.prompt_tokens(case.prompt.replace("Return the whole file", "Return the complete file", 1)
                                        + "\nKeep every comment as it is.")
        pred = session.prediction_tokens(previous.text)
        run(assembler, "none", changed, replace(base, max_tokens=4))
        run(assembler, "suffix", session.prompt_tokens(case.prompt), base, learn=True)  # the store learns the reply
        plain = None
        for label, method, config in (("none", "none", base), ("suffix (warm store)", "suffix", base),
                                      ("auto (warm store)", "auto", base),
                                      ("auto --predict previous", "auto", replace(base, prediction=pred))):
            g = run(assembler, method, changed, config)
            plain = plain or g.stats.tokens_per_s
            rows.append((f"{case.name}, changed", label, g.stats.tokens_per_s, g.stats.tokens_per_pass, ""))
            console.print(f"changed        {label:24s} {g.stats.tokens_per_s:6.1f} tok/s "
                          f"({g.stats.tokens_per_s / plain:.2f}x) {g.stats.tokens_per_pass:.1f} per pass", highlight=False)
    table = Table(title=f"decode tok/s, {session.target_path.name}, -n {args.max_tokens}; "
                        f"{time.perf_counter() - t0:.0f} s")
    for col in ("prompt", "configuration", "tok/s", "vs none", "tokens/pass", ""):
        table.add_column(col)
    base_of = {}
    for name, label, tps, tpp, note in rows:
        base_of.setdefault(name, tps)
        table.add_row(name, label, f"{tps:.1f}", f"{tps / base_of[name]:.2f}×", f"{tpp:.1f}", note)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
