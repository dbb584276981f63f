"""Editor autocomplete through `specdec serve`: time to first token and completion time of fill-in-the-middle requests
(`POST /infill`, as llama.vim and llama.vscode send them), with speculation (the default method) against
`--method none`, in one sitting.

Both servers run at once (same model, same flags but the method; fresh SPECDEC_HOME each); each repeat sends every
case to both, alternating which goes first, so load drifts hit both alike. Each repeat renames the cases' identifiers
(`fib` → `fib1`, ...) so that no server answers a repeat from the exact reply it learnt before (the suffix store
learns across requests, as it would in an editor: the `sources` column shows where accepted drafts came from).
Greedy (temperature 0), so both servers write the same text (checked). Prints one row per case and method: medians
with min-max over the repeats.

    python benchmarks/bench_fim.py                                  # Qwen2.5-Coder-1.5B, 5 repeats
    python benchmarks/bench_fim.py -t qwen2.5-coder-0.5b --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from urllib.parse import urlparse

from bench_serve import launch, stop_server  # benchmarks/ is on sys.path when a script in it runs

CASES = {
    # the missing line of a small function
    "fib line": ("def fib(n):\n    if n < 2:\n        return n\n", "\n\nprint(fib(10))\n", []),
    # a method whose twin is in the suffix: prompt lookup copies it
    "twin method": (
        "class Vec:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def add(self, other):\n",
        "\n\n    def sub(self, other):\n        if not isinstance(other, Vec):\n            raise TypeError(other)\n"
        "        return Vec(self.x - other.x, self.y - other.y)\n", []),
    # a call site whose definition is in another file (input_extra)
    "extra file": (
        "from shapes import area\n\n\ndef report(rects):\n    total = 0\n    for r in rects:\n",
        "\n    return total\n",
        [{"filename": "shapes.py", "text": "def area(width: float, height: float) -> float:\n"
                                          "    \"\"\"The area of a width x height rectangle.\"\"\"\n"
                                          "    return width * height\n"}]),
    # a dict entry between similar entries
    "config entry": (
        "DEFAULTS = {\n    \"host\": \"127.0.0.1\",\n    \"port\": 8000,\n",
        "\n    \"timeout_s\": 30,\n    \"retries\": 3,\n}\n", []),
}
RENAMES = ("fib", "Vec", "report", "DEFAULTS", "area")


def renamed(case: tuple, rep: int) -> tuple:
    prefix, suffix, extra = case
    if rep == 0:
        return case
    sub = lambda s: _rename(s, rep)  # noqa: E731
    return sub(prefix), sub(suffix), [{"filename": e["filename"], "text": sub(e["text"])} for e in extra]


def _rename(text: str, rep: int) -> str:
    for name in RENAMES:
        text = text.replace(name, f"{name}{rep}")
    return text


def infill(url: str, prefix: str, suffix: str, extra: list, n_predict: int) -> dict:
    """One streamed /infill request: {"ttft_s", "total_s", "text", "specdec"}."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "n_predict": n_predict,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    conn.request("POST", "/infill", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, text, last = None, [], {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            raise SystemExit(f"/infill failed: {obj}")
        if obj.get("content"):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(obj["content"])
        if obj.get("stop"):
            last = obj
    total = time.perf_counter() - t0
    conn.close()
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "text": "".join(text),
            "specdec": last.get("specdec", {}), "tokens": last.get("tokens_predicted", 0)}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: dict, method: str) -> str:
    """The markdown table: one row per case and method, medians (min-max) over the repeats so far."""
    out = ["| case | method | tokens | time to first token, s | completion time, s | tokens/pass | accepted/drafted |",
           "|---|---|---|---|---|---|---|"]
    for (name, m), rs in rows.items():
        tpp = statistics.median(r["specdec"].get("tokens_per_pass", 1.0) for r in rs)
        sources = {}
        for r in rs:
            for src, v in r["specdec"].get("sources", {}).items():
                acc = sources.setdefault(src, [0, 0])
                acc[0] += v["accepted"]
                acc[1] += v["drafted"]
        shown = ", ".join(f"{s} {a}/{d}" for s, (a, d) in sorted(sources.items())) or "-"
        tokens = statistics.median(r["tokens"] for r in rs)
        out.append(f"| {name} | {m} | {tokens:g} | {spread([r['ttft_s'] for r in rs])} | "
                   f"{spread([r['total_s'] for r in rs])} | {tpp:.2f} | {shown} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="auto", help="the speculative method measured against none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    print(host.describe_build(system_info()), file=sys.stderr)  # which build both servers run (this venv's)
    servers = {}
    for method in (args.method, "none"):
        cmd = [sys.executable, "-m", "specdec_cli", "serve", "-t", args.target, "--method", method, "--port", "0",
               "--ctx", str(args.ctx)] + (["--threads", str(args.threads)] if args.threads else [])
        servers[method] = launch(cmd, tempfile.mkdtemp(prefix=f"bench-fim-{method}-"))
    rows: dict[tuple[str, str], list[dict]] = {}
    try:
        for rep in range(args.repeats):
            order = (args.method, "none") if rep % 2 == 0 else ("none", args.method)
            for name, case in CASES.items():
                prefix, suffix, extra = renamed(case, rep)
                texts = {}
                for method in order:
                    r = infill(servers[method][1], prefix, suffix, extra, args.n_predict)
                    rows.setdefault((name, method), []).append(r)
                    texts[method] = r["text"]
                if len(set(texts.values())) != 1:
                    print(f"note: {name} rep {rep}: the texts differ (near-tie?): {texts}", file=sys.stderr)
                print(f"rep {rep + 1}/{args.repeats} {name}: {texts[args.method]!r}", file=sys.stderr, flush=True)
            print(f"after {rep + 1} repeats:\n{table(rows, args.method)}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(table(rows, args.method))
    return 0


if __name__ == "__main__":
    sys.exit(main())
