"""`--method auto` against every fixed method and native llama.cpp, on the same prompts, in one sitting.

For each prompt (copy-heavy edits, a code explanation, a story, a full-file rewrite): specdec `none` (plain decoding
through the same engine), `ngram`, `suffix` (an empty store that learns nothing during the benchmark) and `auto`
with a cold controller (what a first `specdec run` gets) and with the session's controller after the previous
prompts (what later runs get through learnt.json); then, with `--llama-cpp DIR`, native `llama-completion` (plain)
and `llama-speculative-simple --spec-type ngram-simple` on the same chat-templated text, budget, threads and
context. Greedy. Decode tok/s excludes the prefill everywhere (ours: the decode loop; native: the tools' own
decode timings). Speedups are against specdec `none` measured beside them.

    SPECDEC_HOME=$(mktemp -d) python benchmarks/bench_auto.py --llama-cpp /path/to/llama.cpp/build/bin
    python benchmarks/bench_auto.py -t smollm2-135m -n 32 --prompts edit_a   # a quick check
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import generate
from specdec_cli.assemble import Assembler
from specdec_cli.cli.console import RichReporter
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions
from specdec_cli.measure.sweep import NoLearning

ROOT = Path(__file__).resolve().parent.parent / "specdec_cli" / "prompts"
PROMPTS = {  # name: (file, token budget)
    "edit_a": ("edit/textwrap_rename.txt", 128),
    "edit_b": ("edit/colorsys_type_hints.txt", 128),
    "explain": ("explain/shlex_quote.txt", 128),
    "story": ("write/lighthouse_story.txt", 128),
    "rewrite": ("rewrite/sched_rename_method.txt", 512),
}
OURS = ("none", "ngram", "suffix", "auto", "auto warm")


def run_ours(assembler: Assembler, method: str, prompt, budget: int, warm: bool) -> dict:
    spec = SpecOptions(method=method)
    drafter = assembler.make_drafter(spec)  # ours to close; the store learns nothing from the benchmark's own outputs
    engine = assembler.engine(spec, fresh=not warm, drafter=NoLearning(drafter) if drafter is not None else None)
    try:
        gen = generate(engine, prompt, GenerationConfig(max_tokens=budget))
    finally:
        if drafter is not None:
            drafter.close()
    s = gen.stats
    return {"tok_s": s.tokens_per_s, "n": s.n_generated, "passes": s.n_target_passes, "acc": s.acceptance_rate,
            "tokens": gen.tokens, "sources": {k: v["accepted"] for k, v in s.by_source.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=None, help="override every prompt's budget")
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp build dir with llama-completion and "
                    "llama-speculative-simple")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = args.prompts.split(",")
    console = Console(stderr=True)
    tools = None
    if args.llama_cpp:
        from specdec_cli.measure.native import find_tools

        tools = find_tools(args.llama_cpp)
    results: dict[str, dict[str, dict]] = {}
    t_start = time.perf_counter()
    with open_session(ModelOptions(target=args.target, ctx=args.ctx, threads=args.threads, prompt_cache=False),
                      method="auto", reporter=RichReporter(console)) as session, Assembler(session) as assembler:
        threads = session.target.n_threads
        for name in names:
            file, budget = PROMPTS[name]
            budget = args.max_tokens or budget
            text = (ROOT / file).read_text(encoding="utf-8")
            prompt = session.prompt_tokens(text)
            row: dict[str, dict] = {}
            run_ours(assembler, "none", prompt, 8, False)  # prefill once (not timed in any row), warm the caches
            for label in OURS:
                method, warm = label.split()[0], label.endswith("warm")
                row[label] = run_ours(assembler, method, prompt, budget, warm)
                console.print(f"{name:8s} {label:10s} {row[label]['tok_s']:6.1f} tok/s  {row[label]['n']} tokens "
                              f"in {row[label]['passes']} passes", highlight=False)
            if tools is not None:
                from specdec_cli.measure.native import run_plain, run_speculative

                rendered = session.target.format_chat([{"role": "user", "content": text}])
                for label, fn in (("native plain", lambda: run_plain(tools, session.target_path, rendered, budget,
                                                                      threads, args.ctx)),
                                  ("native ngram-simple", lambda: run_speculative(
                                      tools, session.target_path, rendered, budget, threads, args.ctx))):
                    r = fn()
                    row[label] = {"tok_s": r.decode_tok_s, "n": r.n_decoded, "acc": r.acceptance}
                    console.print(f"{name:8s} {label:20s} {r.decode_tok_s:6.1f} tok/s", highlight=False)
            same = {k: v["tokens"] == row["none"]["tokens"] for k, v in row.items() if "tokens" in v}
            row["_same_as_none"] = same
            results[name] = row
    table = Table(title=f"decode tok/s (speedup over specdec none), {session.target_path.name}, {threads} threads; "
                        f"{time.perf_counter() - t_start:.0f} s in all")
    table.add_column("configuration")
    for name in names:
        table.add_column(f"{name} ({args.max_tokens or PROMPTS[name][1]})", justify="right")
    labels = list(OURS) + (["native plain", "native ngram-simple"] if tools is not None else [])
    for label in labels:
        cells = []
        for name in names:
            r, base = results[name][label], results[name]["none"]["tok_s"]
            cells.append(f"{r['tok_s']:.1f} ({r['tok_s'] / base:.2f}×)")
        table.add_row(label, *cells)
    Console(width=200).print(table)
    for name in names:
        print(f"{name}: greedy output identical to none: {results[name]['_same_as_none']}; auto sources "
              f"{results[name]['auto']['sources']}")
    if args.json:
        for row in results.values():
            for v in row.values():
                if isinstance(v, dict):
                    v.pop("tokens", None)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
