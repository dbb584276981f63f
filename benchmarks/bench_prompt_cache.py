"""Benchmark: time to first token of a long prompt, cold vs restored from the prompt cache (issue 17).

Every run is a fresh process (as every `specdec run` is): load the model, then either evaluate the whole prompt
(cold) or restore the longest saved prefix from `specdec_cli.stores.prompt_cache.PromptCache` and evaluate the rest,
then the first token's logits. The prompt is a real source file cut to ~1,800 tokens, then an instruction (file first,
instruction last, as an edit prompt is). Runs, in order, on one empty temporary cache:

    cold             no cache at all (the baseline)
    first (saves)    cold, then the KV state is saved (its cost is the "save ms" column)
    second           the same prompt again: everything but the last token restored
    new instruction  the same file, another instruction: only the tokens after the shared prefix evaluated

Columns: tokens restored / evaluated, restore ms, TTFT ms (model loaded -> first token's logits: restore + prefill +
last token), process ms (process start -> first token, model load included), peak RSS at the first token
(ru_maxrss, before any save), save ms. Then the cache's size on disk.

    python benchmarks/bench_prompt_cache.py                  # the catalog's default target (Qwen2.5-Coder 1.5B)
    python benchmarks/bench_prompt_cache.py smollm2-135m     # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = {
    "a": "\n\n# Task: add type hints to every function above. Reply with the complete code only.\n",
    "b": "\n\n# Task: rename `width` to `line_width` everywhere above. Reply with the complete code only.\n",
}


def child(args: argparse.Namespace) -> None:
    """One run in this (fresh) process; prints one JSON line."""
    import numpy as np

    from specdec_cli.models.backend import sync
    from specdec_cli.models.llama import LlamaBackend
    from specdec_cli.stores.prompt_cache import PromptCache

    t_load = time.perf_counter()
    backend = LlamaBackend(args.model, n_ctx=args.ctx, n_batch=512)
    load_ms = (time.perf_counter() - t_load) * 1e3
    source = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text(encoding="utf-8")
    code = backend.tokenize(source, add_special=True)[: args.tokens]
    prompt = np.array(code + backend.tokenize(INSTRUCTIONS[args.instruction], add_special=False), np.int32)
    context, last = prompt[:-1], int(prompt[-1])

    t0 = time.perf_counter()
    n_restored, restore_ms = 0, 0.0
    cache = PromptCache(args.cache) if args.cache else None
    if cache is not None:
        n_restored, restore_ms = cache.restore(backend, context)
    n_eval = sync(backend, context)
    backend.decode([last], n_logits=1)
    ttft_ms = (time.perf_counter() - t0) * 1e3
    first_token_at = time.time()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    save_ms = None
    if cache is not None and args.save:
        t1 = time.perf_counter()
        backend.truncate(len(context))
        cache.save(backend)
        save_ms = (time.perf_counter() - t1) * 1e3
    print(json.dumps({"n_prompt": len(prompt), "restored": n_restored, "evaluated": n_eval + 1,
                      "restore_ms": restore_ms, "ttft_ms": ttft_ms, "load_ms": load_ms, "rss_mb": rss_mb,
                      "first_token_at": first_token_at, "save_ms": save_ms}))  # fmt: skip


def run(model: Path, cache: str | None, instruction: str, save: bool, ns: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--instruction", instruction,
           "--tokens", str(ns.tokens), "--ctx", str(ns.ctx)]  # fmt: skip
    if cache:
        cmd += ["--cache", cache]
    if save:
        cmd.append("--save")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.time()
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["process_ms"] = (row.pop("first_token_at") - started) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="catalog name or .gguf path (default: catalog target)")
    ap.add_argument("--tokens", type=int, default=1780, help="tokens of the source file in the prompt")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", dest="model_path", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--instruction", default="a", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        ns.model = ns.model_path
        child(ns)
        return

    sys.path.insert(0, str(ROOT))
    from specdec_cli.config import load_catalog
    from specdec_cli.models.resolver import resolve

    catalog = load_catalog()
    name = ns.model or catalog.default_target
    model = resolve(name, catalog)
    with tempfile.TemporaryDirectory(prefix="specdec-pcache-") as tmp:
        cache = str(Path(tmp) / "prompts")
        rows = [
            ("cold", run(model, None, "a", False, ns)),
            ("first (saves)", run(model, cache, "a", True, ns)),
            ("second", run(model, cache, "a", False, ns)),
            ("new instruction", run(model, cache, "b", True, ns)),
        ]
        files = sorted(Path(cache).iterdir())
        on_disk = sum(p.stat().st_size for p in files)
        n_entries = sum(p.suffix == ".state" for p in files)

    print(f"model {model.name}, prompt {rows[0][1]['n_prompt']} tokens, n_ctx {ns.ctx}, "
          f"{os.cpu_count()} CPUs, each run a fresh process")  # fmt: skip
    head = f"{'run':<16} {'restored':>8} {'evaluated':>9} {'restore ms':>10} {'TTFT ms':>9} {'process ms':>10} " \
           f"{'peak RSS MB':>11} {'save ms':>8}"  # fmt: skip
    print(head)
    print("-" * len(head))
    for label, r in rows:
        save = f"{r['save_ms']:.0f}" if r["save_ms"] is not None else "-"
        print(f"{label:<16} {r['restored']:>8} {r['evaluated']:>9} {r['restore_ms']:>10.0f} {r['ttft_ms']:>9.0f} "
              f"{r['process_ms']:>10.0f} {r['rss_mb']:>11.0f} {save:>8}")  # fmt: skip
    cold = rows[0][1]["ttft_ms"]
    print(f"second run TTFT = {rows[2][1]['ttft_ms'] / cold:.1%} of cold; new instruction = "
          f"{rows[3][1]['ttft_ms'] / cold:.1%} of cold")  # fmt: skip
    print(f"cache on disk: {on_disk / 1e6:.1f} MB in {n_entries} entries")


if __name__ == "__main__":
    main()
