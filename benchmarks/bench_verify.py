"""Issue 28's benchmark: the default (`--method auto`, `--k auto` on this machine's measured verify curve) against
plain decoding (`none`) and native llama.cpp speculation, in one sitting.

Prompts: every copy-heavy edit in `specdec_cli/prompts/edit` (256 tokens each) and the two free-text prompts of
`specdec_cli/prompts/write` (128 tokens). Configurations, all greedy, on the same chat-templated prompt, budget, threads
and context:

* `auto`: the default, what `specdec run` does (its controller keeps learning from prompt to prompt, as learnt.json
  carries it from run to run; the suffix store learns nothing from the benchmark's own replies);
* `none`: plain decoding through the same engine, the baseline of every speedup;
* `native ngram-simple`, `native ngram-mod`: `llama-speculative-simple --spec-type ...` built from the vendored
  llama.cpp (`--llama-cpp DIR`), with its own decode timing (prefill excluded, like ours).

Every repeat runs each prompt's configurations in a rotated order (interleaved: a slow minute of the machine hits
every configuration alike). Reported per prompt: decode tok/s, median over repeats with its min-max; the speedup is
the median over repeats of the ratio to `none` in the same repeat. Per class: the median over prompts. Also: tokens
per pass, ms per pass and the share of passes at cheap sizes of the curve (ours), and whether `auto`'s greedy output
equals `none`'s. The machine's load (`os.getloadavg`) is printed before and after: run it on a quiet machine.

    SPECDEC_HOME=$(mktemp -d) python benchmarks/bench_verify.py --llama-cpp /path/to/llama.cpp/build/bin --repeats 3
    python benchmarks/bench_verify.py -t smollm2-135m -n 32 --repeats 1      # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec_cli.assemble import Assembler
from specdec_cli.cli.console import RichReporter
from specdec_cli.core.engine import GenerationConfig
from specdec_cli.driver import generate
from specdec_cli.measure.sweep import NoLearning
from specdec_cli.prompts import builtin
from specdec_cli.session import open_session
from specdec_cli.spec import ModelOptions, SpecOptions

OURS = ("auto", "none")
NATIVE = ("ngram-simple", "ngram-mod")
BUDGET = {"edit": 256, "write": 128}


def run_ours(assembler: Assembler, method: str, prompt, budget: int, drafters: dict) -> dict:
    spec = SpecOptions(method=method)
    engine = assembler.engine(spec, drafter=drafters.get(method))
    g = generate(engine, prompt, GenerationConfig(max_tokens=budget))
    s = g.stats
    return {"tok_s": s.tokens_per_s, "n": s.n_generated, "passes": s.n_target_passes,
            "tokens_per_pass": s.tokens_per_pass, "ms_per_pass": s.ms_per_pass,
            "cheap": s.cheap_passes / s.curve_passes if s.curve_passes else None, "branches": s.branch_passes,
            "branch_won": s.branch_won, "tokens": list(g.tokens), "k_hist": dict(s.k_histogram)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target", default=None)
    ap.add_argument("-n", "--max-tokens", type=int, default=None, help="override every prompt's budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp build dir with llama-speculative-simple")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    console = Console(stderr=True, highlight=False)
    tools = None
    if args.llama_cpp:
        from specdec_cli.measure.native import find_tools

        tools = find_tools(args.llama_cpp)
    cases = builtin(("edit", "write"))
    load0 = os.getloadavg()
    console.print(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    runs: list[dict] = []
    t_start = time.perf_counter()
    with open_session(ModelOptions(target=args.target, ctx=args.ctx, threads=args.threads, prompt_cache=False),
                      method="auto", reporter=RichReporter(console)) as session, Assembler(session) as assembler:
        threads = session.target.n_threads
        curve = session.verify_curve()  # measured now when this machine has none (a few seconds)
        inner = assembler.make_drafter(SpecOptions(method="auto"))
        drafters = {"auto": NoLearning(inner), "none": None}
        prompts = {c.name: session.prompt_tokens(c.text) for c in cases}
        rendered = {c.name: session.chat_prompt([{"role": "user", "content": c.text}]) for c in cases}
        configs = [*OURS, *(f"native {t}" for t in NATIVE if tools is not None)]
        for c in cases:  # prefill each prompt once, untimed (ours reuse the KV cache of consecutive runs)
            run_ours(assembler, "none", prompts[c.name], 4, drafters)
        for r in range(args.repeats):
            for i, c in enumerate(cases):
                budget = args.max_tokens or BUDGET[c.kind]
                order = configs[(r + i) % len(configs):] + configs[: (r + i) % len(configs)]
                for label in order:
                    if label.startswith("native"):
                        from specdec_cli.measure.native import run_speculative

                        res = run_speculative(tools, session.target_path, rendered[c.name], budget, threads, args.ctx,
                                              spec_type=label.split()[1])
                        row = {"tok_s": res.decode_tok_s, "n": res.n_decoded, "acc": res.acceptance}
                    else:
                        row = run_ours(assembler, label, prompts[c.name], budget, drafters)
                    runs.append({"repeat": r, "prompt": c.name, "kind": c.kind, "config": label, **row})
                    console.print(f"repeat {r + 1} {c.name:22s} {label:20s} {row['tok_s']:6.1f} tok/s")
        inner.close()
    load1 = os.getloadavg()
    elapsed = time.perf_counter() - t_start
    report(console, runs, cases, configs, curve, session.target_path.name, threads, load0, load1, elapsed)
    if args.json:
        for r in runs:
            r.pop("tokens", None)
        Path(args.json).write_text(json.dumps({"runs": runs, "curve": curve.to_dict() if curve else None,
                                               "load": [load0, load1], "seconds": elapsed}, indent=1))


def report(console, runs, cases, configs, curve, target, threads, load0, load1, elapsed) -> None:
    out = Console(width=220, highlight=False)
    def rows(prompt, config):
        return [r for r in runs if r["prompt"] == prompt and r["config"] == config]

    def ratio(prompt, config):
        base = {r["repeat"]: r["tok_s"] for r in rows(prompt, "none")}
        return [r["tok_s"] / base[r["repeat"]] for r in rows(prompt, config) if base.get(r["repeat"])]

    table = Table(title=f"decode tok/s, median (min-max) of {max(r['repeat'] for r in runs) + 1} interleaved repeats;"
                        f" speedup over none: median of the per-repeat ratios. {target}, {threads} threads; "
                        f"load {load0[0]:.2f} before, {load1[0]:.2f} after; {elapsed:.0f} s")
    table.add_column("prompt")
    for c in configs:
        table.add_column(c, justify="right")
    table.add_column("auto: tok/pass, ms/pass, cheap, branches", justify="right")
    table.add_column("auto = none", justify="right")
    by_class: dict[str, dict[str, list[float]]] = {}
    for case in cases:
        cells = []
        for c in configs:
            tps = [r["tok_s"] for r in rows(case.name, c)]
            cell = f"{statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})"
            if c != "none":
                q = ratio(case.name, c)
                cell += f" {statistics.median(q):.2f}×"
                by_class.setdefault(case.kind, {}).setdefault(c, []).append(statistics.median(q))
            cells.append(cell)
        a = rows(case.name, "auto")
        same = all(x["tokens"] == y["tokens"] for x, y in zip(a, rows(case.name, "none")))
        cheap = [x["cheap"] for x in a if x["cheap"] is not None]
        cells.append(f"{statistics.median(x['tokens_per_pass'] for x in a):.2f}, "
                     f"{statistics.median(x['ms_per_pass'] for x in a):.0f} ms, "
                     f"{statistics.median(cheap):.0%}" if cheap else "–")
        cells[-1] += f", {sum(x['branches'] for x in a)} ({sum(x['branch_won'] for x in a)} won)"
        cells.append("yes" if same else "no")
        table.add_row(f"{case.name} ({case.kind})", *cells)
    out.print(table)
    for kind, per in by_class.items():
        line = ", ".join(f"{c} {statistics.median(v):.2f}× (prompts {min(v):.2f}-{max(v):.2f})"
                         for c, v in per.items())
        out.print(f"{kind}: median over prompts of the speedup over none: {line}")
        if "auto" in per:
            natives = [statistics.median(v) for c, v in per.items() if c.startswith("native")]
            if natives:
                out.print(f"{kind}: auto / best native = {statistics.median(per['auto']) / max(natives):.2f}×")
    if curve is not None:
        out.print("verify curve (ms by b): " + " ".join(f"{b}:{curve.at(b):.0f}{'*' if curve.cheap(b) else ''}"
                                                        for b in range(1, curve.b_max + 1)))


if __name__ == "__main__":
    main()
