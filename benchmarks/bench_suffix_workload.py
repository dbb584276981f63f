"""Benchmark: does the suffix drafter get faster with use? (issue 6; SuffixDecoding, Oliaro et al. 2024)

A repetitive workload: the same edit instruction over 8 functions of one real module (CPython's posixpath.py,
PSF licence), run twice, in one process, on one loaded target. Configurations, interleaved per prompt:
    none           plain decoding (the baseline)
    ngram          prompt lookup
    suffix (cold)  first pass: the global store starts empty and learns from each finished output
    suffix (warm)  second pass over the same prompts: the store has seen every output once, and `--k auto` has
                   learnt across the session's generations (one `AdaptiveK` per method, as in `specdec chat`);
                   compared with plain decoding run again, interleaved, in the second pass
    suffix (warm store, fresh auto)  the same, with a new `AdaptiveK` per prompt (what one `specdec run` process
                   gets: it learns the costs and acceptance anew)

Prints tok/s (total tokens / total decode time), speedup over `none`, mean accepted length and tokens per target
pass per configuration. The suffix store lives in a temporary SPECDEC_HOME, so your own store is untouched.

    python benchmarks/bench_suffix_workload.py                       # default pair (Qwen2.5-Coder 1.5B target)
    python benchmarks/bench_suffix_workload.py -t smollm2-135m -n 48   # quick smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import tempfile

INSTRUCTION = ("Add Python type hints to this function and keep everything else exactly as it is, including the "
               "docstring and comments. Reply with the complete function only.")
FUNCTIONS = ["normcase", "isabs", "join", "split", "splitext", "basename", "dirname", "expanduser"]


def prompts() -> list[tuple[str, str]]:
    """(name, prompt) per function; the source is read from the stdlib file (posixpath is frozen in 3.11)."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "posixpath.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    funcs = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    out = []
    for name in FUNCTIONS:
        src = ast.get_source_segment(source, funcs[name])
        out.append((name, f"{INSTRUCTION}\n\n```python\n{src}\n```"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--target", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=160)
    ap.add_argument("--k", default="auto")
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()

    home = tempfile.mkdtemp(prefix="specdec-bench-suffix-")
    os.environ["SPECDEC_HOME"] = home  # a fresh, empty suffix store

    from rich.console import Console
    from rich.table import Table

    from specdec_cli.assemble import Assembler
    from specdec_cli.driver import generate
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.cli.console import RichReporter
    from specdec_cli.session import open_session
    from specdec_cli.spec import ModelOptions, SpecOptions

    console = Console(stderr=True)
    config = GenerationConfig(max_tokens=args.max_tokens)
    rows: list[dict] = []
    with open_session(ModelOptions(target=args.target, ctx=4096), need_draft=False,
                      reporter=RichReporter(console)) as session:
        assembler = Assembler(session)
        suffix = assembler.make_drafter(SpecOptions(method="suffix", k=args.k))
        ngram = assembler.make_drafter(SpecOptions(method="ngram", k=args.k))
        cases = [(n, session.prompt_tokens(t)) for n, t in prompts()]
        # warm-up (untimed): llama.cpp's first passes allocate buffers
        generate(SpeculativeEngine(session.target, None), cases[0][1][:32], GenerationConfig(max_tokens=8))
        for pass_no in (1, 2):
            for name, prompt in cases:
                # plain decoding runs in both passes, so the warm pass is compared with plain decoding measured
                # beside it (the machine's speed drifts by 10-15 % over the minutes between the passes)
                plan = [("none", None), ("ngram", ngram), ("suffix", suffix)] if pass_no == 1 else [
                    ("none", None), ("suffix", suffix), ("suffix-fresh", suffix)]
                for label, drafter in plan:
                    spec = SpecOptions(method=label.removesuffix("-fresh"), k=args.k)
                    controller = assembler.make_controller(spec, fresh=label.endswith("-fresh")) if drafter else None
                    g = generate(SpeculativeEngine(session.target, drafter, controller), prompt, config)
                    s = g.stats
                    rows.append({"pass": pass_no, "prompt": name, "method": label, "tokens": s.n_generated,
                                 "decode_ms": s.decode_ms, "tokens_per_s": s.tokens_per_s, "passes": s.n_target_passes,
                                 "drafted": s.n_drafted, "accepted": s.n_accepted,
                                 "spec_steps": sum(1 for st in g.steps if st.drafted),
                                 "mean_accepted_length": s.mean_accepted_length, "text_head": g.text[:60]})
                    console.print(f"pass {pass_no} {name:9s} {label:7s} {s.tokens_per_s:6.1f} tok/s  "
                                  f"{s.n_generated / max(1, s.n_target_passes):.2f} tok/pass", highlight=False)
        suffix.close()
        assembler.close()

    def agg(method: str, pass_no: int) -> dict:
        rs = [r for r in rows if r["method"] == method and r["pass"] == pass_no]
        toks, ms = sum(r["tokens"] for r in rs), sum(r["decode_ms"] for r in rs)
        passes = sum(r["passes"] for r in rs)
        return {"tok_s": toks / (ms / 1e3), "tok_per_pass": toks / passes, "accepted": sum(r["accepted"] for r in rs),
                "drafted": sum(r["drafted"] for r in rs),
                "mal": sum(r["accepted"] for r in rs) / max(1, sum(r["spec_steps"] for r in rs))}

    bases = {1: agg("none", 1), 2: agg("none", 2)}
    table = Table(title=f"Suffix drafter on a repeated workload: 8 edit prompts (posixpath), {args.max_tokens} tokens max")
    for col in ("configuration", "tok/s", "speedup vs none", "acceptance", "mean accepted length",
                "tokens per target pass"):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    for label, method, pass_no in (("none", "none", 1), ("ngram", "ngram", 1), ("suffix (cold store, pass 1)", "suffix", 1),
                                   ("suffix (warm store, pass 2)", "suffix", 2),
                                   ("suffix (warm store, fresh auto per prompt)", "suffix-fresh", 2)):
        a = agg(method, pass_no)
        acc = f"{a['accepted'] / a['drafted']:.0%}" if a["drafted"] else "–"
        base = bases[pass_no]
        mal = f"{a['mal']:.2f}" if a["drafted"] else "–"
        table.add_row(label, f"{a['tok_s']:.1f}", f"{a['tok_s'] / base['tok_s']:.2f}×", acc, mal, f"{a['tok_per_pass']:.2f}")
    Console(width=max(110, Console().width)).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "max_tokens": args.max_tokens, "k": args.k}, f, indent=2)


if __name__ == "__main__":
    main()
