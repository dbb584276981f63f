"""Benchmark: `specdec serve` under an editor-like session, through the official `openai` client (issue 18).

The session: 10 chat requests about one file (five functions of CPython's posixpath.py, PSF licence), each a
different edit instruction; the chat history is resent every time, as editors' assistants do (the first user turn
carries the file, later turns only the instruction, every earlier reply is in the history). The same script runs
against one `specdec serve` per method (each its own process, a fresh SPECDEC_HOME: the suffix store and `--k auto`
start from nothing and learn during the session), greedy, loopback.

Prints, per method: the total time, tok/s per request (client side: completion tokens / request wall time, prefill
included; and the server's decode tok/s), acceptance, and learning: requests 6-10 against 1-5. Then the speedup of
each method over `--method none` on total time, and the HTTP layer's overhead: the same prompt (the first request,
`--overhead-tokens` tokens) through the server and through the engine directly in this process (the service the
server uses, same method `none`), medians of 3 warm runs, overhead as a share of the decode time.

    python benchmarks/bench_serve.py                                    # default pair: none vs the default method
    python benchmarks/bench_serve.py --methods none,suffix,auto --json serve.json
    python benchmarks/bench_serve.py -t smollm2-135m --methods none,suffix -n 48 --overhead-tokens 48   # smoke run

Needs `pip install 'specdec-cli[serve]' openai`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = ["join", "split", "splitext", "basename", "dirname"]
SYSTEM = "You are a coding assistant inside an editor. Reply with the complete code only, in one Python code block."
INSTRUCTIONS = [
    "Add Python type hints to every function.",
    "Add a one-line docstring to every function that has none.",
    "Rename the local variable `sep` to `separator` everywhere.",
    "Replace the string concatenations with f-strings where possible.",
    "Add a comment above each return statement saying what is returned.",
    "Make `basename` and `dirname` reuse `split` instead of repeating its logic.",
    "Sort the functions alphabetically by name.",
    "Add `assert isinstance(p, str)` at the start of every function that takes `p`.",
    "Rename `splitext` to `split_extension` and keep an alias with the old name.",
    "Remove every docstring.",
]
DEFAULT_METHOD = "auto"  # the default of specdec serve


def source_file() -> str:
    path = os.path.join(sysconfig.get_paths()["stdlib"], "posixpath.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    funcs = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    return "\n\n\n".join(ast.get_source_segment(source, funcs[name]) for name in FUNCTIONS)


def first_messages(code: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is my file:\n\n```python\n{code}\n```\n\n{INSTRUCTIONS[0]}"}]


def start_server(args, method: str, home: str) -> tuple[subprocess.Popen, str]:
    """`specdec serve` on a free loopback port with a fresh SPECDEC_HOME; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "specdec_cli", "serve", "--method", method, "--port", "0", "--ctx", str(args.ctx)]
    for flag, value in (("-t", args.target), ("-d", args.draft), ("--threads", args.threads), ("--k", args.k)):
        if value is not None:
            cmd += [flag, str(value)]
    return launch(cmd, home)


def launch(cmd: list[str], home: str) -> tuple[subprocess.Popen, str]:
    """Run `cmd` (a `specdec serve --port 0 ...` command line) with SPECDEC_HOME=`home`, its prompt cache in
    `home`/prompts (servers measured side by side must not restore each other's KV states: the shared default
    directory let the second server of a pair skip the prefill the first had just saved) and this checkout first on
    PYTHONPATH; wait (at most 600 s) for the base URL it prints on stderr. Returns (process, base URL); exits with
    what it printed when it does not start."""
    env = {**os.environ, "SPECDEC_HOME": home, "SPECDEC_PROMPT_CACHE": str(Path(home) / "prompts"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(http://[\d.]+:\d+/v1)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit(f"specdec serve did not start:\n{''.join(lines)}")


def stop_server(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        print(err, file=sys.stderr)
        raise SystemExit(f"specdec serve exited with {proc.returncode}")
    return err


def editor_session(client, code: str, max_tokens: int) -> list[dict]:
    """The 10 requests; returns one row per request."""
    messages = first_messages(code)
    rows = []
    for i, instruction in enumerate(INSTRUCTIONS):
        if i:
            messages.append({"role": "user", "content": f"On the original file: {instruction}"})
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model="specdec", messages=messages, max_tokens=max_tokens, temperature=0)
        wall = time.perf_counter() - t0
        reply = resp.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        spec = resp.model_extra["specdec"]
        rows.append({"request": i + 1, "wall_s": wall, "tokens": resp.usage.completion_tokens,
                     "prompt_tokens": resp.usage.prompt_tokens,
                     "cached_tokens": resp.usage.prompt_tokens_details.cached_tokens,
                     "client_tok_s": resp.usage.completion_tokens / wall, "decode_tok_s": spec["tokens_per_s"],
                     "drafted": spec["drafted"], "accepted": spec["accepted"], "tokens_per_pass": spec["tokens_per_pass"]})
        print(f"  request {i + 1:2d}: {rows[-1]['tokens']:4d} tokens in {wall:6.2f} s  "
              f"{rows[-1]['client_tok_s']:6.1f} tok/s (decode {spec['tokens_per_s']:.1f})  "
              f"acceptance {spec['acceptance_rate']:.0%}  cached {rows[-1]['cached_tokens']}/{rows[-1]['prompt_tokens']}",
              file=sys.stderr)
    return rows


def http_runs(client, messages: list[dict], max_tokens: int, repeats: int) -> list[dict]:
    out = []
    for _ in range(repeats + 1):  # the first run is a warm-up (it fills the KV cache)
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model="specdec", messages=messages, max_tokens=max_tokens, temperature=0)
        out.append({"wall_s": time.perf_counter() - t0, "tokens": resp.usage.completion_tokens,
                    "decode_ms": resp.model_extra["specdec"]["decode_ms"]})
    return out[1:]


def direct_runs(args, messages: list[dict], max_tokens: int, repeats: int) -> list[dict]:
    """The same prompt through the engine in this process (the service `specdec serve` uses, method none)."""
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.server.request import Message, Request
    from specdec_cli.server.service import GenerationService
    from specdec_cli.session import open_session
    from specdec_cli.spec import ModelOptions, SpecOptions

    session = open_session(ModelOptions(target=args.target, ctx=args.ctx, threads=args.threads), need_draft=False)
    service = GenerationService(session, SpecOptions(method="none"))
    out = []
    try:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            request = Request(GenerationConfig(max_tokens=max_tokens),
                              messages=tuple(Message(m["role"], m["content"]) for m in messages))
            drive = service.stream(request, service.prompt_tokens(request))
            try:
                for _record in drive:
                    pass
            finally:
                drive.close()
            stats = drive.stats
            out.append({"wall_s": time.perf_counter() - t0, "tokens": stats.n_generated, "decode_ms": stats.decode_ms})
    finally:
        service.close()
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--target", default=None)
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--methods", default=f"none,{DEFAULT_METHOD}", help="comma-separated; none is the baseline")
    ap.add_argument("-n", "--max-tokens", type=int, default=160, help="max tokens per request of the session")
    ap.add_argument("--overhead-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the overhead comparison (median)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", default=None)
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "none" not in methods:
        methods.insert(0, "none")

    import openai

    code = source_file()
    results: dict = {"methods": {}, "overhead": None, "args": vars(args)}
    for method in methods:
        print(f"--method {method}", file=sys.stderr)
        home = tempfile.mkdtemp(prefix="specdec-bench-serve-")
        proc, url = start_server(args, method, home)
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
            t0 = time.perf_counter()
            rows = editor_session(client, code, args.max_tokens)
            total = time.perf_counter() - t0
            overhead = http_runs(client, first_messages(code), args.overhead_tokens, args.repeats) \
                if method == "none" else None
        finally:
            stop_server(proc)
        results["methods"][method] = {"rows": rows, "total_s": total}
        if overhead is not None:
            results["overhead"] = {"http": overhead}
    print("direct (in process, method none) for the overhead comparison", file=sys.stderr)
    results["overhead"]["direct"] = direct_runs(args, first_messages(code), args.overhead_tokens, args.repeats)

    from rich.console import Console
    from rich.table import Table

    def tok_s(rows: list[dict]) -> float:
        return sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows)

    base = results["methods"]["none"]["total_s"]
    table = Table(title=f"specdec serve, editor-like session: 10 requests, history resent, {args.max_tokens} tokens max")
    for col in ("method", "total s", "speedup vs none", "tok/s 1-5", "tok/s 6-10", "learning (6-10 / 1-5)",
                "acceptance", "tokens per pass"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, res in results["methods"].items():
        rows = res["rows"]
        drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
        early, late = tok_s(rows[:5]), tok_s(rows[5:])
        table.add_row(method, f"{res['total_s']:.1f}", f"{base / res['total_s']:.2f}×", f"{early:.1f}", f"{late:.1f}",
                      f"{late / early:.2f}×", f"{accepted / drafted:.0%}" if drafted else "–",
                      f"{statistics.mean(r['tokens_per_pass'] for r in rows):.2f}")
    per_request = Table(title="tok/s per request (client side, prefill included)")
    per_request.add_column("method")
    for i in range(len(INSTRUCTIONS)):
        per_request.add_column(str(i + 1), justify="right")
    for method, res in results["methods"].items():
        per_request.add_row(method, *(f"{r['client_tok_s']:.1f}" for r in res["rows"]))
    out = Console(width=max(120, Console().width))
    out.print(table)
    out.print(per_request)

    http, direct = results["overhead"]["http"], results["overhead"]["direct"]
    http_s = statistics.median(r["wall_s"] for r in http)
    direct_s = statistics.median(r["wall_s"] for r in direct)
    decode_s = statistics.median(r["decode_ms"] for r in direct) / 1e3
    share = (http_s - direct_s) / decode_s if decode_s else float("nan")
    results["overhead"].update({"http_median_s": http_s, "direct_median_s": direct_s, "decode_median_s": decode_s,
                                "overhead_share_of_decode": share})
    out.print(f"HTTP overhead, {http[0]['tokens']}-token reply (method none, median of {args.repeats} warm runs): "
              f"server {http_s * 1e3:.0f} ms vs engine in process {direct_s * 1e3:.0f} ms "
              f"(decode {decode_s * 1e3:.0f} ms): {share:+.1%} of decode time", highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
