"""Issue 34's sitting: the default (`--method auto --k auto`) on copy-heavy edits, from a fresh home and from a shared
one, against `--method none` and native llama.cpp n-gram speculation, in one sitting.

Every specdec row is a new `specdec run` process, as a user runs it (`--no-prompt-cache`, greedy, the default target):
- "fresh": a new SPECDEC_HOME that holds only this machine's verify curve (measured once, in the first home, and copied:
  a fresh *controller*, not 75 s of curve measuring in every row);
- "shared": one home per repeat, first warmed by three prompts that are not measured (a summary, an essay, a long
  rewrite whose copies break at every renamed call), then each prompt in turn: every prompt runs after the others of its repeat
  (never after itself: the suffix store never holds the prompt's own reply), the order rotated per repeat;
- "none": plain decoding through the same engine;
- native `llama-speculative-simple --spec-type ngram-simple` and `ngram-mod` (with `--llama-cpp DIR`, a build of the
  llama.cpp vendored in the pinned llama-cpp-python sdist, with the same kernels: on an AMX CPU, the AMX patch).
Decode tok/s excludes the prefill everywhere (ours: the decode loop; native: its own decode timing). The rows of one
prompt run back to back, their order rotated per repeat (interleaved); the table shows medians with min-max.

    python benchmarks/bench_edits.py --llama-cpp /path/to/llama.cpp/build/bin --repeats 3
    python benchmarks/bench_edits.py -t smollm2-135m -n 32 --repeats 1 --prompts textwrap_rename,story  # a check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specdec_cli" / "prompts"
EDITS = ["textwrap_rename", "colorsys_type_hints", "bisect_rename", "heapq_type_hints", "posixpath_rename",
         "genericpath_type_hints"]
FREE = {"story": "write/lighthouse_story.txt", "explain": "explain/shlex_quote.txt"}
# the shared homes' warm-up: prompts that are not measured (the suffix store must never hold a measured prompt's reply)
WARM = [("summarize/python_history.txt", 96), ("write/tests_essay.txt", 96), ("rewrite/sched_rename_method.txt", 384)]


def prompt_file(name: str) -> Path:
    return ROOT / (FREE.get(name) or f"edit/{name}.txt")


def specdec(home: Path, args: list[str], out: Path) -> dict:
    env = {**os.environ, "SPECDEC_HOME": str(home), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "specdec_cli", "run", *args, "--no-prompt-cache", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def seed_home(home: Path, curves: dict) -> Path:
    """A home whose learnt.json holds only the measured verify curve(s)."""
    (home / "data").mkdir(parents=True, exist_ok=True)
    (home / "data" / "learnt.json").write_text(json.dumps({"version": 1, "entries": {}, "curves": curves}))
    return home


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "–"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--target", default=None, help="default: the catalog's default target")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default=",".join(EDITS + list(FREE)))
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp build dir with llama-speculative-simple")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()
    names = args.prompts.split(",")
    target = ["-t", args.target] if args.target else []
    base = Path(tempfile.mkdtemp(prefix="bench-edits-"))
    t0 = time.perf_counter()

    # 0. which llama.cpp build runs (with AMX: whether its kernels are in use; the patched build's trial decode passes)
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    print(host.describe_build(system_info()), file=sys.stderr)

    # 1. the curve, measured once (the first run of a new home measures it), then copied into every home
    first = base / "measure"
    specdec(first, [str(prompt_file(names[0])), *target, "-n", "8", "--ctx", str(args.ctx)], base / "m.json")
    curves = json.loads((first / "data" / "learnt.json").read_text())["curves"]
    print(f"verify curve measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    # 2. the shared homes' starting point: three other prompts
    warm0 = seed_home(base / "warm0", curves)
    for file, n in WARM:
        specdec(warm0, [str(ROOT / file), *target, "-n", str(n), "--ctx", str(args.ctx)], base / "w.json")

    tools = rendered = model_path = threads = None
    if args.llama_cpp:
        from specdec_cli.measure.native import find_tools
        from specdec_cli.session import open_session
        from specdec_cli.spec import ModelOptions

        tools = find_tools(args.llama_cpp)
        with open_session(ModelOptions(target=args.target, ctx=args.ctx, prompt_cache=False), method="none") as s:
            rendered = {n: s.target.format_chat([{"role": "user", "content": prompt_file(n).read_text()}])
                        for n in names}
            model_path, threads = s.target_path, s.target.n_threads

    rows: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
    configs = ["fresh", "shared", "none"] + (["ngram-simple", "ngram-mod"] if tools else [])
    for r in range(args.repeats):
        shared = base / f"shared{r}"
        shutil.copytree(warm0, shared)
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for c in configs[r % len(configs):] + configs[: r % len(configs)]:
                out = base / f"{name}-{c}-{r}.json"
                if c in ("fresh", "shared", "none"):
                    home = shared if c == "shared" else seed_home(base / f"{name}-{c}-{r}", curves)
                    method = ["--method", "none"] if c == "none" else []
                    d = specdec(home, [str(prompt_file(name)), *target, *method, "-n", str(args.max_tokens),
                                       "--ctx", str(args.ctx)], out)
                    st = d["stats"]
                    m = {"tok_s": st["tokens_per_s"], "tok_pass": st["tokens_per_pass"], "text": d["text"],
                         "k_max": max((s["k"] for s in d["steps"]), default=0), "passes": st["n_target_passes"]}
                else:
                    from specdec_cli.measure.native import run_speculative

                    res = run_speculative(tools, model_path, rendered[name], args.max_tokens, threads, args.ctx,
                                          spec_type=c)
                    m = {"tok_s": res.decode_tok_s, "acc": res.acceptance}
                rows[name].setdefault(c, []).append(m)
                print(f"repeat {r + 1} {name:24s} {c:13s} {m['tok_s']:6.1f} tok/s"
                      + (f"  {m['tok_pass']:.2f} tok/pass, K max {m['k_max']}" if "tok_pass" in m else ""),
                      file=sys.stderr, flush=True)

    # 3. the tables: per prompt, then by class
    ratio = lambda a, b: [x["tok_s"] / y["tok_s"] for x, y in zip(a, b)]  # noqa: E731 (paired by repeat)
    print(f"\n{args.max_tokens} tokens, greedy, {args.repeats} interleaved repeats, medians (min-max); "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    head = "| prompt | none tok/s | fresh tok/s | shared tok/s | fresh / none | shared / none |"
    head += " native simple | native mod | fresh / best native | shared / best native |" if tools else ""
    head += " tok/pass fresh | shared | shared / fresh | output = none |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    summary: dict[str, dict[str, list[float]]] = {"edits": {}, "free text": {}}
    for name in names:
        c = rows[name]
        cells = [name, med([x["tok_s"] for x in c["none"]]), med([x["tok_s"] for x in c["fresh"]]),
                 med([x["tok_s"] for x in c["shared"]]), med(ratio(c["fresh"], c["none"])),
                 med(ratio(c["shared"], c["none"]))]
        cls = summary["free text" if name in FREE else "edits"]
        cls.setdefault("fresh/none", []).append(statistics.median(ratio(c["fresh"], c["none"])))
        cls.setdefault("shared/none", []).append(statistics.median(ratio(c["shared"], c["none"])))
        if tools:
            best = [max(a["tok_s"], b["tok_s"]) for a, b in zip(c["ngram-simple"], c["ngram-mod"])]
            bests = [{"tok_s": x} for x in best]
            cells += [med([x["tok_s"] for x in c["ngram-simple"]]), med([x["tok_s"] for x in c["ngram-mod"]]),
                      med(ratio(c["fresh"], bests)), med(ratio(c["shared"], bests))]
            cls.setdefault("fresh/native", []).append(statistics.median(ratio(c["fresh"], bests)))
            cls.setdefault("shared/native", []).append(statistics.median(ratio(c["shared"], bests)))
        tp_f = [x["tok_pass"] for x in c["fresh"]]
        tp_s = [x["tok_pass"] for x in c["shared"]]
        cls.setdefault("tok/pass shared/fresh", []).append(statistics.median(tp_s) / statistics.median(tp_f))
        same = all(x["text"] == c["none"][0]["text"] for x in c["fresh"] + c["shared"] + c["none"])
        cells += [med(tp_f), med(tp_s), f"{statistics.median(tp_s) / statistics.median(tp_f):.2f}",
                  "yes" if same else "NO"]
        print("| " + " | ".join(cells) + " |")
    print("\n| class | " + " | ".join(summary["edits"]) + " |")
    print("|---|" + "---|" * len(summary["edits"]))
    for cls, d in summary.items():
        if d:
            print(f"| {cls} (median over prompts, min-max) | " + " | ".join(med(v) for v in d.values()) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
