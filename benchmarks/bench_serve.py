"""`specdec serve` under clients' traffic: every serving workload in one script, one sitting each.

    python benchmarks/bench_serve.py --workload chat [options]                 # an editor's chat session (openai)
    python benchmarks/bench_serve.py --workload fim [options]                  # editor autocomplete, /infill
    python benchmarks/bench_serve.py --workload editor-during-agent,chats      # several clients on one server
    python benchmarks/bench_serve.py --workload replay import|run [options]    # captured agent sessions
    python benchmarks/bench_serve.py --workload W --help                       # a workload's own options

`editor-during-agent` and `chats` are the two scenarios that benchmarks/bench_concurrency.py ran (`--scenarios
editor,chats`, still accepted with those two workloads: `--workload chats --scenarios chats` is the same sitting);
their tables are unchanged. The pieces every workload shares sit at the top: starting a server on a fresh home
(`Server`, `launch`, `serve_env`), one `post`, one `spread`, one home seeding (`seed_home`, `harvest`).

## --workload chat (was bench_serve.py)

Benchmark: `specdec serve` under an editor-like session, through the official `openai` client (issue 18).

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

    python benchmarks/bench_serve.py --workload chat         # default pair: none vs the default method
    python benchmarks/bench_serve.py --workload chat --methods none,suffix,auto --json serve.json
    python benchmarks/bench_serve.py --workload chat -t smollm2-135m --methods none,suffix -n 48 --overhead-tokens 48

Needs `pip install 'specdec-cli[serve]' openai`.
## --workload fim (was bench_fim.py)

Editor autocomplete through `specdec serve`: time to first token and completion time of fill-in-the-middle requests
(`POST /infill`, as llama.vim and llama.vscode send them), with speculation (the default method) against
`--method none`, in one sitting.

Both servers run at once (same model, same flags but the method; fresh SPECDEC_HOME each); each repeat sends every
case to both, alternating which goes first, so load drifts hit both alike. Each repeat renames the cases' identifiers
(`fib` → `fib1`, ...) so that no server answers a repeat from the exact reply it learnt before (the suffix store
learns across requests, as it would in an editor: the `sources` column shows where accepted drafts came from).
Greedy (temperature 0), so both servers write the same text (checked). Prints one row per case and method: medians
with min-max over the repeats.

    python benchmarks/bench_serve.py --workload fim                                  # Qwen2.5-Coder-1.5B, 5 repeats
    python benchmarks/bench_serve.py --workload fim -t qwen2.5-coder-0.5b --repeats 3 --threads 2
## --workload editor-during-agent,chats (was bench_concurrency.py)

Several clients on one `specdec serve` (issue 44): an editor during an agent's cold long request, and four greedy
chats at once. One sitting; prints the command, the host and the build first, then Markdown tables with medians over
interleaved repeats and their spread (min-max).

1. **An editor during an agent's cold 8k-token request.** The agent: one Anthropic Messages request in Claude Code's
   shape (streamed, tools, greedy, `--agent-tokens` max tokens): a system prompt and, in the user turn, specdec's own
   source files at the pinned commit `SOURCE_COMMIT` (`git show`, so the text is the same whatever the checkout) up
   to about `--agent-prompt` tokens, and a question about them; or the first request of a capture (`--agent-body
   FILE`: a JSON body, or an agent_capture.py NNN-POST-*.json file). The editor: `/infill` requests in llama.vim's
   shape (input_prefix 256 lines, input_suffix 64 lines, input_extra: 3 ring-buffer chunks of 64 lines of other files,
   the current line typed one more character each time, n_predict, t_max_prompt_ms 500, t_max_predict_ms 1000,
   cache_prompt, response_fields; temperature 0 added so each run writes the same tokens), one every 2 s, each sent
   2 s after the previous one was sent or as soon as it was answered (an editor has one completion in flight), after
   llama.vim's `n_predict: 0` warm-up, so its prefix is cached. Three cells, each on a fresh server: FIM alone, the
   agent alone, and both at once with an Anthropic `count_tokens` of the agent's request 5 s in. Reported: FIM latency
   p50/p95 alone and during, the agent's time alone and during, the FIMs' own service time during it (their
   `timings`; those answered before the agent's end), count_tokens' latency, against the targets: FIM p95 during <=
   p95 alone + 1.5 s; agent during <= 1.1 x (alone + the FIMs' service time); count_tokens <= 0.1 s.
2. **Four greedy chats at once.** Four chat requests (`/v1/chat/completions`, streamed, temperature 0) with prompts of
   0.6-2k tokens (a source file to rewrite) and 128-256 tokens each: served one after another, then (the next cell,
   a fresh server) sent at once. Reported: aggregate tok/s (all output tokens over the wall time from the first send
   to the last reply's end) at once vs one after another; the decode phase's aggregate tok/s apart (output tokens
   after each reply's first, over the union of the replies' first-token-to-end intervals); each reply at once
   compared with its reply one after another (equal, or where it diverges); the ceiling of at once / one after
   another on this machine, the target's: each decode pass the chats made one after another (the server's
   SPECDEC_PASS_LOG) shared by four lanes at its own rows, saving what such a pass saves as timed after the cells on
   four KV streams holding the chats' prompts (`stream_gain`, whose attention spans the deepest stream's cells), the
   prefills and the rest as long as they were (`passes_ceiling`); and, for comparison, decoding at once at most as
   much faster as the most one pass shared by four lanes saves on the verify curve (`sharing_gain`), as timed at
   one size (`stream_gain`'s largest ratio), and as the most rows per ms shared over the most apart, each at its own
   best size (what decoding at once gains when every draft is right) (`ceiling`); with `--llama-server PATH`, the
   same on llama-server `-np N -kvu --spec-type ngram-mod --jinja` with the same threads and model file, and specdec
   at once against it.

Every cell runs on a fresh server (a fresh SPECDEC_HOME holding only this machine's verify curve and flash-attention
choice, copied from the user's learnt.json or measured by the first cell; no prompt cache): nothing one cell's
requests taught (the suffix store, `--k auto`, cached prompts) helps the next. Repeats alternate the cells' order.
`specdec serve --parallel N` is passed only when the server's --help lists it, so the same script measures today's
one-at-a-time server (the baseline) and the concurrent one; `--baseline DIR` also runs the specdec of another
checkout (e.g. a worktree at the last release) in the same sitting.

    python benchmarks/bench_serve.py --workload editor-during-agent,chats    # both, the default model, 3 repeats
    python benchmarks/bench_serve.py --workload chats --llama-server /path/to/llama-server
    python benchmarks/bench_serve.py --workload editor-during-agent,chats --quick --repeats 1   # a smoke test

The first cell measures this machine's verify curve when the user's learnt.json has none (minutes on 2 cores; a
server has 600 s to start); SPECDEC_VERIFY_CURVE=off skips it (a smoke test, not a measurement). Timings on a shared
machine are noise: run it alone on the host.
## --workload replay (was agents_replay.py)

Speed on coding agents' traffic: replay captured multi-turn agent sessions against `specdec serve` and llama-server.

    # once: capture a session (clients/agent_capture.py: the agent against a scripted stub) and import it
    python clients/agent_capture.py claude --out captures/claude-code --import claude-code
    python clients/agent_capture.py codex --out captures/codex-catalog --import codex
    # or import a capture directory made earlier: its POST bodies in order
    python benchmarks/bench_serve.py --workload replay import captures/claude-code --name claude-code
    # the benchmark (llama-server built from the same vendored llama.cpp)
    python benchmarks/bench_serve.py --workload replay run --session claude-code \\
        --llama-server /path/to/llama.cpp/build/bin/llama-server

A session is the agent's requests of one task, each the previous one's conversation plus the reply and the tool's
result (the captures' replies were a stub's, so both servers get byte-identical prompts); it is stored under
~/.cache/specdec/agent-sessions/NAME/ (never in the repository: Claude Code's system prompt is Anthropic's). Each
turn is sent as captured, in the agent's dialect (/v1/messages for Claude Code, /v1/responses for Codex), not
streamed, greedy (temperature 0) and with the same max tokens on both servers.

Both servers run on this host, loopback only, one after the other: specdec serve (default method, --ctx 32768, a
fresh SPECDEC_HOME and prompt cache) and llama-server with its best speculation (`--jinja --spec-type ngram-mod -c
32768 -t 2`). Each replays the session once from a cold start, then is restarted and replays it again: specdec then
has its saved prompt cache and its suffix store of the first session's replies; llama-server starts empty. Per turn:
the server's prefill and decode seconds (specdec's `specdec.prefill_ms` / `decode_ms`; llama-server's "prompt eval
time" / "eval time" log lines), the client's wall seconds, prompt and output tokens. Targets (issue 29): a first
session at most 1.0x llama-server's total with decode faster; after the restart at most 0.5x.
"""

from __future__ import annotations

import argparse
import ast
import http.client
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("chat", "fim", "editor-during-agent", "chats", "replay")

CHAT_DOC, FIM_DOC, CONCURRENCY_DOC, REPLAY_DOC = (part.split("\n\n", 1)[1] for part in __doc__.split("\n## ")[1:])


# -- shared: servers, requests, statistics, homes ------------------------------------------------------------
# -- servers --------------------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess with its stderr in `log`; `new_log()` is what it wrote since the last call."""

    def __init__(self, kind: str, cmd: list[str], url: str, log: Path, env: dict | None = None) -> None:
        self.kind, self.url, self.log = kind, url, log
        self._file = open(log, "a")
        self._offset = log.stat().st_size
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT, env=env or os.environ)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{kind} exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200 and json.loads(r.read() or b"{}").get("status") in ("ok", None):
                        break
            except Exception:
                pass
            time.sleep(1)
        else:
            self.stop()
            raise SystemExit(f"{kind} did not start:\n{log.read_text()[-3000:]}")
        self.new_log()

    def new_log(self) -> str:
        with open(self.log) as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._file.close()


def serve_env(home: Path, checkout: Path = ROOT) -> dict[str, str]:
    """The environment of a `specdec serve` on a fresh home: SPECDEC_HOME=`home`, its prompt cache in `home`/prompts
    (servers measured side by side must not restore each other's KV states) and `checkout` first on PYTHONPATH."""
    return {
        **os.environ,
        "SPECDEC_HOME": str(home),
        "SPECDEC_PROMPT_CACHE": str(Path(home) / "prompts"),
        "PYTHONPATH": str(checkout) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def launch(cmd: list[str], home: str | Path) -> tuple[Server, str]:
    """`cmd` (a `specdec serve --port 0 ...` command line: the 0 becomes a free port) as a `Server` on `home`
    (`serve_env`), its log in `home`/serve.log. Returns (server, its OpenAI base URL ending in /v1); exits with what
    it printed when it does not start."""
    port = free_port()
    cmd = [str(port) if a == "0" and i and cmd[i - 1] == "--port" else a for i, a in enumerate(cmd)]
    server = Server("specdec", cmd, f"http://127.0.0.1:{port}", Path(home) / "serve.log", serve_env(Path(home)))
    return server, server.url + "/v1"


def stop_server(server: Server) -> str:
    """Stop a `launch`ed server; returns its log. Exits when it did not exit cleanly."""
    server.stop()
    log = server.log.read_text()
    if server.proc.returncode != 0:
        print(log, file=sys.stderr)
        raise SystemExit(f"specdec serve exited with {server.proc.returncode}")
    return log


def model_path(target: str | None) -> Path:
    """The GGUF file specdec resolves `target` to (default: the catalog's default target)."""
    sys.path.insert(0, str(ROOT))
    from specdec_cli.config import load_catalog  # noqa: PLC0415
    from specdec_cli.models.resolver import resolve  # noqa: PLC0415

    catalog = load_catalog()
    return Path(resolve(target or catalog.default_target, catalog))


# -- HTTP ---------------------------------------------------------------------------------------------------------
HEADERS = {
    "Content-Type": "application/json",
    "x-api-key": "unused",
    "Authorization": "Bearer unused",
    "anthropic-version": "2023-06-01",
}


def post(url: str, path: str, body: dict, timeout: float = 3600) -> tuple[int, dict, float]:
    """(status, JSON, seconds) of one unstreamed POST."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body), headers=HEADERS)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data or b"{}"), time.perf_counter() - t0
    finally:
        conn.close()


@dataclass
class Streamed:
    """One streamed reply, client-side times (time.perf_counter()): sent, first text, end."""

    sent: float
    first: float | None = None
    end: float = 0.0
    text: str = ""
    tokens: int = 0
    prompt: int = 0
    error: str = ""

    @property
    def wall(self) -> float:
        return self.end - self.sent


def stream(url: str, path: str, body: dict, timeout: float = 3600) -> Streamed:
    """POST a streamed chat completion or Anthropic message; collect its text, token counts and times."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    out = Streamed(time.perf_counter())
    text: list[str] = []
    try:
        conn.request("POST", path, body=json.dumps(body), headers=HEADERS)
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            piece, usage = _piece(obj)
            if piece:
                out.first = out.first or time.perf_counter()
                text.append(piece)
            if usage:
                out.tokens = usage.get("completion_tokens") or usage.get("output_tokens") or out.tokens
                out.prompt = usage.get("prompt_tokens") or usage.get("input_tokens") or out.prompt
            if obj.get("type") == "error" or "error" in obj:
                out.error = json.dumps(obj)[:300]
    except OSError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.end = time.perf_counter()
        conn.close()
    out.text = "".join(text)
    return out


def _piece(obj: dict) -> tuple[str, dict | None]:
    """(text, usage or None) of one SSE event of either API."""
    if "choices" in obj:  # Chat Completions
        text = "".join((c.get("delta") or {}).get("content") or "" for c in obj["choices"])
        usage = obj.get("usage")
        if usage is None and obj.get("timings"):  # llama-server's last chunk
            usage = {"completion_tokens": obj["timings"].get("predicted_n")}
        return text, usage
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        return delta.get("text") or delta.get("partial_json") or "", None
    if kind == "message_start":
        u = (obj.get("message") or {}).get("usage") or {}
        return "", {"input_tokens": (u.get("input_tokens") or 0) + (u.get("cache_read_input_tokens") or 0)}
    if kind == "message_delta":
        return "", obj.get("usage")
    return "", None


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0-1) of `values`, linear between ranks (nan for none)."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def spread(values: list[float], digits: int = 2) -> str:
    """ "median (min-max)" of `values`."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def seed_home(work: Path) -> Path:
    """A SPECDEC_HOME holding only the user's verify curves and flash-attention choices (learnt.json without the
    controllers' "entries") and tuned.json: what every cell's fresh home starts from."""
    from specdec_cli.config import data_dir

    seed = work / "seed-home"
    seed.mkdir()
    user = data_dir()
    learnt = user / "learnt.json"
    if learnt.is_file():
        try:
            doc = json.loads(learnt.read_text())
            doc["entries"] = {}
            (seed / "learnt.json").write_text(json.dumps(doc))
        except (OSError, ValueError):
            pass
    if (user / "tuned.json").is_file():
        shutil.copy(user / "tuned.json", seed / "tuned.json")
    return seed


def harvest(seed: Path, home: Path) -> None:
    """Keep in `seed` the curves a cell measured (in `home`'s data_dir, $SPECDEC_HOME/data) where the seed had none or a
    stale one (the user's learnt.json marked it for measuring again): the next cells do not measure again."""
    learnt = home / "data" / "learnt.json"
    if not learnt.is_file():
        return
    try:
        doc = json.loads(learnt.read_text())
        kept = json.loads((seed / "learnt.json").read_text()) if (seed / "learnt.json").is_file() else {}
    except (OSError, ValueError):
        return
    curves = kept.setdefault("curves", {})
    fresh = {
        k: v
        for k, v in (doc.get("curves") or {}).items()
        if not (v.get("curve") or {}).get("stale") and (k not in curves or (curves[k].get("curve") or {}).get("stale"))
    }
    if not fresh and (seed / "learnt.json").is_file():
        return
    curves.update(fresh)
    kept = {**doc, **kept, "entries": {}}
    (seed / "learnt.json").write_text(json.dumps(kept))


# -- --workload chat: an editor's chat session through the openai client ---------------------------------------


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
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Here is my file:\n\n```python\n{code}\n```\n\n{INSTRUCTIONS[0]}"},
    ]


def start_server(args, method: str, home: str) -> tuple[Server, str]:
    """`specdec serve` on a free loopback port with a fresh SPECDEC_HOME; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "specdec_cli", "serve", "--method", method, "--port", "0", "--ctx", str(args.ctx)]
    for flag, value in (("-t", args.target), ("-d", args.draft), ("--threads", args.threads), ("--k", args.k)):
        if value is not None:
            cmd += [flag, str(value)]
    return launch(cmd, home)


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
        rows.append(
            {
                "request": i + 1,
                "wall_s": wall,
                "tokens": resp.usage.completion_tokens,
                "prompt_tokens": resp.usage.prompt_tokens,
                "cached_tokens": resp.usage.prompt_tokens_details.cached_tokens,
                "client_tok_s": resp.usage.completion_tokens / wall,
                "decode_tok_s": spec["tokens_per_s"],
                "drafted": spec["drafted"],
                "accepted": spec["accepted"],
                "tokens_per_pass": spec["tokens_per_pass"],
            }
        )
        print(
            f"  request {i + 1:2d}: {rows[-1]['tokens']:4d} tokens in {wall:6.2f} s  "
            f"{rows[-1]['client_tok_s']:6.1f} tok/s (decode {spec['tokens_per_s']:.1f})  "
            f"acceptance {spec['acceptance_rate']:.0%}  cached {rows[-1]['cached_tokens']}/{rows[-1]['prompt_tokens']}",
            file=sys.stderr,
        )
    return rows


def http_runs(client, messages: list[dict], max_tokens: int, repeats: int) -> list[dict]:
    out = []
    for _ in range(repeats + 1):  # the first run is a warm-up (it fills the KV cache)
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model="specdec", messages=messages, max_tokens=max_tokens, temperature=0)
        out.append(
            {
                "wall_s": time.perf_counter() - t0,
                "tokens": resp.usage.completion_tokens,
                "decode_ms": resp.model_extra["specdec"]["decode_ms"],
            }
        )
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
            request = Request(
                GenerationConfig(max_tokens=max_tokens),
                messages=tuple(Message(m["role"], m["content"]) for m in messages),
            )
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


def chat_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_serve.py --workload chat", description=CHAT_DOC)
    ap.add_argument("-t", "--target")
    ap.add_argument("-d", "--draft")
    ap.add_argument("--methods", default=f"none,{DEFAULT_METHOD}", help="comma-separated; none is the baseline")
    ap.add_argument("-n", "--max-tokens", type=int, default=160, help="max tokens per request of the session")
    ap.add_argument("--overhead-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the overhead comparison (median)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--k")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
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
            overhead = (
                http_runs(client, first_messages(code), args.overhead_tokens, args.repeats)
                if method == "none"
                else None
            )
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
    table = Table(
        title=f"specdec serve, editor-like session: 10 requests, history resent, {args.max_tokens} tokens max"
    )
    for col in (
        "method",
        "total s",
        "speedup vs none",
        "tok/s 1-5",
        "tok/s 6-10",
        "learning (6-10 / 1-5)",
        "acceptance",
        "tokens per pass",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, res in results["methods"].items():
        rows = res["rows"]
        drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
        early, late = tok_s(rows[:5]), tok_s(rows[5:])
        table.add_row(
            method,
            f"{res['total_s']:.1f}",
            f"{base / res['total_s']:.2f}×",
            f"{early:.1f}",
            f"{late:.1f}",
            f"{late / early:.2f}×",
            f"{accepted / drafted:.0%}" if drafted else "–",
            f"{statistics.mean(r['tokens_per_pass'] for r in rows):.2f}",
        )
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
    results["overhead"].update(
        {
            "http_median_s": http_s,
            "direct_median_s": direct_s,
            "decode_median_s": decode_s,
            "overhead_share_of_decode": share,
        }
    )
    out.print(
        f"HTTP overhead, {http[0]['tokens']}-token reply (method none, median of {args.repeats} warm runs): "
        f"server {http_s * 1e3:.0f} ms vs engine in process {direct_s * 1e3:.0f} ms "
        f"(decode {decode_s * 1e3:.0f} ms): {share:+.1%} of decode time",
        highlight=False,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


# -- --workload fim: editor autocomplete (/infill) with speculation against none --------------------------------


CASES = {
    # the missing line of a small function
    "fib line": ("def fib(n):\n    if n < 2:\n        return n\n", "\n\nprint(fib(10))\n", []),
    # a method whose twin is in the suffix: prompt lookup copies it
    "twin method": (
        "class Vec:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def add(self, other):\n",
        "\n\n    def sub(self, other):\n        if not isinstance(other, Vec):\n            raise TypeError(other)\n"
        "        return Vec(self.x - other.x, self.y - other.y)\n",
        [],
    ),
    # a call site whose definition is in another file (input_extra)
    "extra file": (
        "from shapes import area\n\n\ndef report(rects):\n    total = 0\n    for r in rects:\n",
        "\n    return total\n",
        [
            {
                "filename": "shapes.py",
                "text": "def area(width: float, height: float) -> float:\n"
                '    """The area of a width x height rectangle."""\n'
                "    return width * height\n",
            }
        ],
    ),
    # a dict entry between similar entries
    "config entry": (
        'DEFAULTS = {\n    "host": "127.0.0.1",\n    "port": 8000,\n',
        '\n    "timeout_s": 30,\n    "retries": 3,\n}\n',
        [],
    ),
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
    body = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": extra,
        "n_predict": n_predict,
        "temperature": 0,
        "stream": True,
    }
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
    return {
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "text": "".join(text),
        "specdec": last.get("specdec", {}),
        "tokens": last.get("tokens_predicted", 0),
    }


def fim_table(rows: dict, method: str) -> str:
    """The markdown table: one row per case and method, medians (min-max) over the repeats so far."""
    out = [
        "| case | method | tokens | time to first token, s | completion time, s | tokens/pass | accepted/drafted |",
        "|---|---|---|---|---|---|---|",
    ]
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
        out.append(
            f"| {name} | {m} | {tokens:g} | {spread([r['ttft_s'] for r in rs])} | "
            f"{spread([r['total_s'] for r in rs])} | {tpp:.2f} | {shown} |"
        )
    return "\n".join(out)


def fim_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_serve.py --workload fim", description=FIM_DOC)
    ap.add_argument("-t", "--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="auto", help="the speculative method measured against none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)

    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    print(host.describe_build(system_info()), file=sys.stderr)  # which build both servers run (this venv's)
    servers = {}
    for method in (args.method, "none"):
        cmd = [
            sys.executable,
            "-m",
            "specdec_cli",
            "serve",
            "-t",
            args.target,
            "--method",
            method,
            "--port",
            "0",
            "--ctx",
            str(args.ctx),
        ] + (["--threads", str(args.threads)] if args.threads else [])
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
            print(f"after {rep + 1} repeats:\n{fim_table(rows, args.method)}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(fim_table(rows, args.method))
    return 0


# -- --workload editor-during-agent,chats: several clients on one server (was bench_concurrency.py) -------------


SOURCE_COMMIT = "fbc1b06c63a70e889841c505b6bc1021403fd9e7"  # the text the requests are built from (git show)


AGENT_FILES = [
    "specdec_cli/server/worker.py",
    "specdec_cli/server/http.py",
    "specdec_cli/server/service.py",
    "specdec_cli/driver.py",
    "specdec_cli/core/engine.py",
    "specdec_cli/stores/kv_parking.py",
]


FIM_FILE = "specdec_cli/core/controller.py"  # the file being edited: the cursor inside it


FIM_EXTRA = ["specdec_cli/core/cost_model.py", "specdec_cli/core/verify_curve.py", "specdec_cli/core/stats.py"]


CHAT_FILES = [
    "specdec_cli/server/fim.py",
    "specdec_cli/core/detok.py",
    "specdec_cli/stores/kv_parking.py",
    "specdec_cli/server/reply.py",
]


CHARS_PER_TOKEN = 3.3  # Qwen2.5's tokenizer on this Python source, about (the tables report the real counts)


FIM_PERIOD_S = 2.0


COUNT_AT_S = 5.0


AGENT_SYSTEM = (
    "You are a coding agent working in the user's repository. Use the tools to read and change files; "
    "answer concisely. When the user asks a question about code they pasted, answer from that code."
)


AGENT_TOOLS = [  # Claude Code's shape: name, description, input_schema
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "offset": {"type": "number"}, "limit": {"type": "number"}},
            "required": ["file_path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Bash",
        "description": "Run a bash command and return its output.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Edit",
        "description": "Replace old_string with new_string in a file.",
        "input_schema": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string"},
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
            },
            "required": ["file_path", "old_string", "new_string"],
            "additionalProperties": False,
        },
    },
]


AGENT_TASK = (
    "Above are the server's worker, HTTP layer, service, driver, engine and KV parking. Explain in a short "
    "numbered list how one request travels from the HTTP handler to the engine and back, naming the "
    "functions it passes through."
)


CHAT_TASK = "Rewrite this module with full type hints on every function and a one-line docstring where one is missing."


# -- text ---------------------------------------------------------------------------------------------------------
def source(path: str) -> str:
    """`path` at SOURCE_COMMIT (the same text whatever is checked out)."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{SOURCE_COMMIT}:{path}"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"cannot read {path} at {SOURCE_COMMIT[:10]} (a git checkout of specdec is needed): {e}"
        ) from e


def agent_body(tokens: int, max_tokens: int, nonce: str, capture: Path | None) -> tuple[str, dict]:
    """(path, body) of the agent's request: a capture's, or built from AGENT_FILES up to about `tokens` prompt tokens.
    `nonce` starts the system prompt: a repeat's own (its cells, each on a fresh server, send the same prompt)."""
    if capture is not None:
        doc = json.loads(capture.read_text())
        body = dict(doc.get("body_json") or doc.get("body") or doc)
        path = (doc.get("path") or "/v1/messages").split("?")[0]
        if path != "/v1/messages":
            raise SystemExit(f"{capture}: only Anthropic /v1/messages captures are supported here (it is {path})")
        system = body.get("system") or ""
        body["system"] = (
            f"[{nonce}] {system}" if isinstance(system, str) else [{"type": "text", "text": f"[{nonce}]"}, *system]
        )
        body.update(stream=True, temperature=0, max_tokens=max_tokens)
        body.pop("top_p", None), body.pop("top_k", None)
        return path, body
    budget, parts = int(tokens * CHARS_PER_TOKEN), []
    for f in AGENT_FILES:
        text = source(f)
        parts.append(f'<file path="{f}">\n{text[: max(0, budget)]}\n</file>')
        budget -= len(text)
        if budget <= 0:
            break
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "system": f"[{nonce}] {AGENT_SYSTEM}",
        "tools": AGENT_TOOLS,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "\n\n".join(parts)}, {"type": "text", "text": AGENT_TASK}],
            }
        ],
    }
    return "/v1/messages", body


@dataclass
class Editor:
    """llama.vim's view of one file: the cursor at line `at`, the ring buffer's chunks of other files."""

    lines: list[str]
    at: int
    extra: list[dict]
    typed: str
    n_predict: int
    n_prefix: int = 256  # llama.vim's lines before the cursor
    n_suffix: int = 64  # and after it

    @classmethod
    def make(cls, quick: bool, n_predict: int) -> Editor:
        lines = source(FIM_FILE).splitlines(keepends=True)
        chunk = 8 if quick else 64
        extra = [
            {"filename": f, "text": "".join(source(f).splitlines(keepends=True)[:chunk])}
            for f in FIM_EXTRA[: 1 if quick else 3]
        ]
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > len(lines) // 2)
        return cls(lines, at + 1, extra, "        ", n_predict, *((16, 8) if quick else (256, 64)))

    def body(self, i: int, *, warm_up: bool = False) -> dict:
        """The i-th request (the current line typed i characters further; i < 0: nothing typed yet)."""
        n_prefix, n_suffix = self.n_prefix, self.n_suffix
        word = "return self.weights[index]"
        return {
            "id_slot": 0,
            "input_prefix": "".join(self.lines[max(0, self.at - n_prefix) : self.at]),
            "input_suffix": "".join(self.lines[self.at + 1 : self.at + 1 + n_suffix]),
            "input_extra": self.extra,
            "prompt": self.typed + word[: max(0, i) % len(word)],
            "n_predict": 0 if warm_up else self.n_predict,
            "n_indent": len(self.typed),
            "top_k": 40,
            "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"],
            "stream": False,
            "cache_prompt": True,
            "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000,
            "temperature": 0,
            "response_fields": [
                "content",
                "timings/prompt_n",
                "timings/prompt_ms",
                "timings/predicted_n",
                "timings/predicted_ms",
                "tokens_cached",
                "truncated",
            ],
        }


def chat_bodies(quick: bool, nonce: str) -> list[dict]:
    """The four chats: a module to rewrite, 0.6-2k prompt tokens (quick: 100-250), 128-256 max tokens (quick:
    8-16). `nonce` starts the system prompt (the cells' prompts are the same but for it: a reply is compared with
    the same chat's reply in the other cell, so both cells of a repeat share it)."""
    sizes, limits = (
        ((100, 150, 200, 250), (8, 12, 16, 10)) if quick else ((600, 1000, 1400, 1900), (128, 192, 256, 160))
    )
    out = []
    for f, n, limit in zip(CHAT_FILES, sizes, limits, strict=False):
        text = source(f)[: int(n * CHARS_PER_TOKEN)]
        out.append(
            {
                "model": "specdec",
                "stream": True,
                "temperature": 0,
                "max_tokens": limit,
                "stream_options": {"include_usage": True},
                "messages": [
                    {"role": "system", "content": f"[{nonce}] You are a careful Python programmer."},
                    {"role": "user", "content": f"{CHAT_TASK}\n\n```python\n{text}\n```"},
                ],
            }
        )
    return out


# -- servers ------------------------------------------------------------------------------------------------------
@dataclass
class Kind:
    """A server to measure: specdec from a checkout, or llama-server."""

    name: str
    checkout: Path | None = None  # specdec's
    binary: Path | None = None  # llama-server's
    parallel: bool = False  # whether its --help lists --parallel (specdec)


def lists_parallel(checkout: Path) -> bool:
    """Whether `specdec serve --help` of `checkout` lists --parallel."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "NO_COLOR": "1", "COLUMNS": "200"}
    try:
        out = subprocess.run(
            [sys.executable, "-P", "-m", "specdec_cli", "serve", "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--parallel" in out


class Cell:
    """One fresh server for one cell (a context manager): `url`."""

    def __init__(self, kind: Kind, args, work: Path, seed: Path, label: str) -> None:
        self.kind, self.args, self.work, self.seed, self.label = kind, args, work, seed, label

    def __enter__(self) -> Cell:
        a, port = self.args, free_port()
        log = self.work / f"{self.kind.name}-{self.label}.log"
        if self.kind.binary is not None:
            cmd = [
                str(self.kind.binary),
                "-m",
                str(model_path(a.target)),
                "--jinja",
                "-np",
                str(a.parallel),
                "-kvu",
                "--spec-type",
                "ngram-mod",
                "-c",
                str(a.ctx or 32768),
                "-t",
                str(a.threads),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            self.home = self.pass_log = None
            self.server = Server(self.kind.name, cmd, f"http://127.0.0.1:{port}", log)
        else:
            self.home = Path(tempfile.mkdtemp(prefix="home-", dir=self.work))
            shutil.copytree(self.seed, self.home / "data", dirs_exist_ok=True)  # data_dir(): $SPECDEC_HOME/data
            # -P: not the working directory's specdec_cli (the checkout this script is in) but the PYTHONPATH's
            cmd = [
                sys.executable,
                "-P",
                "-m",
                "specdec_cli",
                "serve",
                "--port",
                str(port),
                "--threads",
                str(a.threads),
                "--no-prompt-cache",
            ]
            cmd += ["--ctx", str(a.ctx)] if a.ctx else []
            cmd += ["-t", a.target] if a.target else []
            cmd += ["--method", a.method] if a.method else []
            cmd += ["--parallel", str(a.parallel)] if self.kind.parallel else []
            self.pass_log = self.work / f"{self.kind.name}-{self.label}.passes.jsonl"
            env = {**serve_env(self.home, self.kind.checkout), "SPECDEC_PASS_LOG": str(self.pass_log)}
            try:
                self.server = Server(self.kind.name, cmd, f"http://127.0.0.1:{port}", log, env)
            except SystemExit:
                harvest(self.seed, self.home)  # a verify curve measured before it gave up is kept for the next
                raise
        self.url = self.server.url
        return self

    def passes(self) -> list[tuple[float, list[list[int]]]]:
        """Every pass the server made so far, (ms, [[slot, rows, rows that want logits], ...]) each (its
        SPECDEC_PASS_LOG); [] for llama-server or a checkout whose server keeps none."""
        if self.pass_log is None or not self.pass_log.exists():
            return []
        return [(p["ms"], p["parts"]) for p in map(json.loads, self.pass_log.read_text().splitlines())]

    def __exit__(self, *exc) -> None:
        self.server.stop()
        if self.home is not None:
            harvest(self.seed, self.home)
            shutil.rmtree(self.home, ignore_errors=True)


# -- scenario 1: an editor during an agent's request ---------------------------------------------------------------
@dataclass
class Fim:
    sent: float
    latency: float
    service_s: float  # the server's own prompt + predict time (`timings`)
    text: str


def fim_once(url: str, editor: Editor, i: int) -> Fim:
    t0 = time.perf_counter()
    status, reply, wall = post(url, "/infill", editor.body(i))
    if status != 200:
        raise SystemExit(f"/infill failed: HTTP {status}: {json.dumps(reply)[:300]}")
    timings = reply.get("timings") or {}
    ms = (reply.get("timings/prompt_ms", timings.get("prompt_ms")) or 0) + (
        reply.get("timings/predicted_ms", timings.get("predicted_ms")) or 0
    )
    return Fim(t0, wall, ms / 1e3, reply.get("content", ""))


def fim_loop(url: str, editor: Editor, until, out: list[Fim], start: int = 0) -> None:
    """One completion in flight, one sent every FIM_PERIOD_S (or at once when the previous took longer), until
    `until()` is true."""
    i, next_at = start, time.perf_counter()
    while not until():
        time.sleep(max(0.0, next_at - time.perf_counter()))
        if until():
            break
        out.append(fim_once(url, editor, i))
        i += 1
        next_at = out[-1].sent + FIM_PERIOD_S


def warm_fim(url: str, editor: Editor) -> None:
    """llama.vim's cache warm-up (n_predict 0), then one completion: the editor's prefix is cached."""
    post(url, "/infill", editor.body(-1, warm_up=True))
    fim_once(url, editor, 0)


def editor_cells(kind: Kind, args, work: Path, seed: Path, rep: int, editor: Editor) -> dict:
    """The three cells of one repeat, in an order that alternates with `rep`."""
    res: dict = {}
    order = ["fim", "agent", "during"]
    order = order[rep % 3 :] + order[: rep % 3]
    # one prompt for the repeat's agent cells (each on a fresh server with no prompt cache), so its reply during the
    # FIMs can be compared with its reply alone
    path, body = agent_body(args.agent_prompt, args.agent_tokens, f"r{rep}", args.agent_body)
    for cell in order:
        with Cell(kind, args, work, seed, f"r{rep}-{cell}") as c:
            warm_fim(c.url, editor)
            if cell == "fim":
                fims: list[Fim] = []
                fim_loop(c.url, editor, lambda fims=fims: len(fims) >= args.fim_alone, fims, start=1)
                got = {"fim_alone": [f.latency for f in fims]}
            elif cell == "agent":
                agent = stream(c.url, path, body)
                _check(agent, "agent alone")
                got = {
                    "agent_alone": agent.wall,
                    "agent_prompt": agent.prompt,
                    "agent_out": agent.tokens,
                    "agent_text": agent.text,
                }
            else:
                got = during(c.url, editor, path, body)
        res.update(got)
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in got.items() if not k.endswith("_text"))
        print(f"  {kind.name} rep {rep + 1} {cell}: {shown}", file=sys.stderr, flush=True)
    return res


def during(url: str, editor: Editor, path: str, body: dict) -> dict:
    """The agent's request, FIMs every FIM_PERIOD_S from 1 s after it was sent until it ends, count_tokens 5 s in."""
    done = threading.Event()
    box: dict = {}

    def agent() -> None:
        box["agent"] = stream(url, path, body)
        done.set()

    def count() -> None:
        if done.wait(COUNT_AT_S):
            return
        counted = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature")}
        status, reply, wall = post(url, "/v1/messages/count_tokens", counted)
        box["count"] = (status, reply.get("input_tokens"), wall)

    threads = [threading.Thread(target=agent, daemon=True), threading.Thread(target=count, daemon=True)]
    for t in threads:
        t.start()
    fims: list[Fim] = []
    time.sleep(1.0)
    fim_loop(url, editor, done.is_set, fims, start=1)
    for t in threads:
        t.join()
    agent = box["agent"]
    _check(agent, "agent during")
    latencies, service = fim_costs(fims, agent.end)
    status, n, count_s = box.get("count", (None, None, float("nan")))
    if status not in (None, 200):
        print(f"  count_tokens: HTTP {status}", file=sys.stderr)
    return {
        "fim_during": latencies,
        "agent_during": agent.wall,
        "agent_during_text": agent.text,
        "agent_during_out": agent.tokens,
        "fim_service": service,
        "count_s": count_s,
        "count_n": n,
    }


def fim_costs(fims: list[Fim], agent_end: float) -> tuple[list[float], float]:
    """(latencies of the FIMs sent before the agent's reply ended, answered then or later; seconds of server time of
    those answered before it ended: the service time the agent's own may grow by)."""
    sent = [f for f in fims if f.sent < agent_end]
    return [f.latency for f in sent], sum(f.service_s for f in sent if f.sent + f.latency <= agent_end)


def _check(s: Streamed, what: str) -> None:
    if s.error:
        raise SystemExit(f"{what} failed: {s.error}")


def _fmt(v) -> str:
    if isinstance(v, list):
        return f"p50 {pct(v, 0.5):.2f} s p95 {pct(v, 0.95):.2f} s (n={len(v)})"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def editor_table(kind: str, reps: list[dict]) -> str:
    """Scenario 1's table for one server kind: one row per measure, the median (min-max) over the repeats."""
    col = lambda key, f=lambda x: x: [f(r[key]) for r in reps if key in r]  # noqa: E731
    fim_alone95, fim_during95 = col("fim_alone", lambda v: pct(v, 0.95)), col("fim_during", lambda v: pct(v, 0.95))
    agent_alone, agent_during, service = col("agent_alone"), col("agent_during"), col("fim_service")
    count = col("count_s")
    rows = [
        ("FIM latency p50 alone, s", col("fim_alone", lambda v: pct(v, 0.5)), ""),
        ("FIM latency p95 alone, s", fim_alone95, ""),
        ("FIM latency p50 during the agent, s", col("fim_during", lambda v: pct(v, 0.5)), ""),
        (
            "FIM latency p95 during the agent, s",
            fim_during95,
            _target(
                [d - a for a, d in zip(fim_alone95, fim_during95, strict=False)], 1.5, "p95 during - p95 alone", "s"
            ),
        ),
        ("FIMs answered during the agent", col("fim_during", len), ""),
        ("agent alone, s", agent_alone, ""),
        ("agent during, s", agent_during, ""),
        ("FIMs' service time during the agent, s", service, ""),
        (
            "agent during / (alone + FIM service)",
            [d / (a + s) for a, d, s in zip(agent_alone, agent_during, service, strict=False)],
            _target(
                [d / (a + s) for a, d, s in zip(agent_alone, agent_during, service, strict=False)], 1.1, "ratio", "x"
            ),
        ),
        ("count_tokens 5 s in, s", count, _target(count, 0.1, "latency", "s")),
    ]
    prompt = col("agent_prompt")
    out = [
        f"### {kind}: an editor during an agent's cold request ({spread(prompt, 0)} prompt tokens, "
        f"{spread(col('agent_out'), 0)} out)",
        "",
        "| measure | median (min-max) | target |",
        "|---|---|---|",
    ]
    out += [f"| {name} | {spread(vals)} | {target} |" for name, vals, target in rows]
    same = [
        f"repeat {i + 1}: "
        + divergence(r["agent_text"], r["agent_during_text"])
        + f" ({r.get('agent_out')} tokens alone, {r.get('agent_during_out')} during)"
        for i, r in enumerate(reps)
        if "agent_text" in r and "agent_during_text" in r
    ]
    if same:  # greedy: the agent's reply beside the FIMs is its reply alone, up to near-ties (`specdec check`)
        out += ["", "the agent's reply during the FIMs against alone: " + "; ".join(same)]
    return "\n".join(out)


def _target(values: list[float], limit: float, what: str, unit: str, *, at_least: bool = False) -> str:
    """Whether the median of `values` is <= `limit` (>= with `at_least`), in words."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    med = statistics.median(values)
    met = med >= limit if at_least else med <= limit
    sign = (">=" if met else "<") if at_least else ("<=" if met else ">")
    return f"{what} {med:.2f} {unit} {sign} {limit} {unit}: " + ("met" if met else "NOT met")


# -- scenario 2: four greedy chats at once -------------------------------------------------------------------------
def chats_cell(url: str, bodies: list[dict], together: bool) -> list[Streamed]:
    """The chats one after another, or all sent at once (threads released together)."""
    if not together:
        return [stream(url, "/v1/chat/completions", b) for b in bodies]
    out: list[Streamed | None] = [None] * len(bodies)
    gate = threading.Barrier(len(bodies))

    def one(i: int) -> None:
        gate.wait()
        out[i] = stream(url, "/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def aggregate(replies: list[Streamed]) -> dict:
    """{"tok_s": all output tokens / wall from the first send to the last end, "decode_tok_s": tokens after each
    reply's first / the union of first-token-to-end intervals, "wall_s", "tokens", "first_s": the replies' times to
    first token added up (one after another: the prefills' time)}."""
    tokens = sum(r.tokens for r in replies)
    wall = max(r.end for r in replies) - min(r.sent for r in replies)
    decode = union_s([(r.first, r.end) for r in replies if r.first is not None])
    after_first = sum(max(0, r.tokens - 1) for r in replies)
    return {
        "tok_s": tokens / wall if wall > 0 else float("nan"),
        "wall_s": wall,
        "tokens": tokens,
        "decode_tok_s": after_first / decode if decode > 0 else float("nan"),
        "first_s": sum(r.first - r.sent for r in replies if r.first is not None),
        "prompts": [r.prompt for r in replies],
    }


def sharing_gain(seed: Path, model: Path, n: int, rows: int = 16) -> float | None:
    """The most one pass shared by `n` lanes can save over their passes apart on this machine's verify curve (the
    seed's learnt.json, `model`'s curve, v(b) ms): the largest (v(r_1) + ... + v(r_n)) / v(r_1 + ... + r_n) over
    1 <= r_i <= `rows` (a verify pass of up to `rows` - 1 drafts) within the curve's sizes; from a curve marked stale
    where there is no other. None without a curve."""
    import itertools

    try:
        curves = json.loads((seed / "learnt.json").read_text()).get("curves") or {}
    except (OSError, ValueError):
        return None
    ours = sorted(
        ((v.get("curve") or {}) for k, v in curves.items() if k.startswith(f"{model.name}:")),
        key=lambda c: bool(c.get("stale")),
    )  # a stale curve (drifted, or measured on a busy machine) last
    ms = ours[0].get("ms") if ours else None
    if not ms or len(ms) < n:
        return None
    return max(
        sum(ms[r - 1] for r in rs) / ms[sum(rs) - 1]
        for rs in itertools.combinations_with_replacement(range(1, rows + 1), n)
        if sum(rs) <= len(ms)
    )


def stream_gain(
    model: Path,
    chats: list[list[dict]],
    threads: int,
    rows: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    repeats: int = 5,
    n_ctx: int = 4096,
) -> dict:
    """The most one pass shared by len(`chats`) KV streams saves over their passes apart, measured on this machine:
    lanes of one context as `specdec serve --parallel` makes them (`n_ctx` tokens each, flash attention as it
    chooses), each holding one chat's prompt (in a shared pass every stream's attention spans the deepest stream's
    cells, which the verify curve, timed on one sequence, does not show); for each r in `rows`, r rows on every lane
    in one `decode_many` (one llama_decode) against a `decode` per lane, back to back in alternating order, `repeats`
    times, each lane rolled back after each. A ratio is taken within each repeat (the two timings seconds apart: a
    host whose speed drifts over minutes moves both) and its median over the repeats kept. Returns {"gain": the
    largest of those medians over `rows`, "ratios": {r: median(apart / shared)}, "rows": {r: [median apart ms,
    median shared ms]}, "depths": each lane's prompt tokens, "best": {"gain": the median over repeats of the most
    rows per ms shared (any r) over the most apart (any r), "shared": r, "apart": r, where each is most by the
    medians}}. The ratio at one r is largest where r rows are a dear size apart and 4 r a cheap one (on a CPU's
    curve 8 rows against 32), a size a lane alone would not verify; the best against the best is what decoding at
    once gains when every draft is right (a row is then a token)."""
    import numpy as np

    from specdec_cli.models.llama import LlamaBackend
    from specdec_cli.session import flash_attn

    b = LlamaBackend(model, n_ctx=n_ctx, n_threads=threads, n_lanes=len(chats), flash_attn=flash_attn(model, threads))
    try:
        lanes = [b.lane(i) for i in range(len(chats))]
        depths = []
        for lane, messages in zip(lanes, chats, strict=True):
            toks = np.asarray(b.tokenize(b.format_chat(messages), add_special=False, parse_special=True), np.int32)
            depths.append(len(toks))
            lane.decode(toks, n_logits=0)  # (in chunks of n_batch)
        rng = np.random.default_rng(0)
        times: dict[tuple[int, str], list[float]] = {}
        for rep in range(repeats):
            for r in rows:
                parts = [(lane, rng.integers(100, 1000, r).astype(np.int32), r) for lane in lanes]
                for how in ("shared", "apart") if rep % 2 == 0 else ("apart", "shared"):
                    t0 = time.perf_counter()
                    if how == "shared":
                        b.decode_many(parts)
                    else:
                        for lane, toks, n in parts:
                            lane.decode(toks, n_logits=n)
                    times.setdefault((r, how), []).append((time.perf_counter() - t0) * 1e3)
                    for lane, depth in zip(lanes, depths, strict=True):
                        lane.truncate(depth)
    finally:
        b.close()
    med = {r: [statistics.median(times[(r, "apart")]), statistics.median(times[(r, "shared")])] for r in rows}
    pair = lambda r: zip(times[(r, "apart")], times[(r, "shared")], strict=True)  # noqa: E731
    ratios = {r: statistics.median(a / s for a, s in pair(r)) for r in rows}
    fast = lambda how, i: max(r / times[(r, how)][i] for r in rows)  # noqa: E731 (rows per ms in repeat i)
    best = {
        "gain": statistics.median(fast("shared", i) / fast("apart", i) for i in range(repeats)),
        "shared": max(rows, key=lambda r: r / med[r][1]),
        "apart": max(rows, key=lambda r: r / med[r][0]),
    }
    return {"gain": max(ratios.values()), "ratios": ratios, "rows": med, "depths": depths, "best": best}


def ceiling(serial: dict, gain: float) -> float:
    """The most four chats at once can gain over the same four one after another (`serial`, their `aggregate`) when
    the prefills take what they took one after another (a prompt is read in batches of up to 512 rows either way:
    a CPU's prompt pass is as fast alone as beside another) and decoding at once is at most `gain` times as fast:
    wall / (prefills + decoding / gain)."""
    first, wall = serial["first_s"], serial["wall_s"]
    return wall / (first + (wall - first) / gain)


def passes_ceiling(serial: dict, passes: list, ratios: dict[int, float]) -> float | None:
    """The most four chats at once can gain over the same four one after another (`serial`, their `aggregate`) when
    every decode pass one after another (`passes`, `Cell.passes` of that cell: the verify steps after each chat's
    first, whose time is in its time to first token) is shared with three others of its rows, saving what such a
    pass saved as timed (`ratios`: `stream_gain`'s apart / shared at r rows a lane, interpolated between the timed
    sizes, the largest's past it, 1 where sharing costs more: at once a step can go alone), and everything else
    (prefills, the time between passes) takes what it took: wall / (wall - saved). None without passes."""
    import numpy as np

    if not passes:
        return None
    sizes = sorted(ratios)
    gain = lambda r: max(1.0, float(np.interp(r, sizes, [ratios[x] for x in sizes])))  # noqa: E731 (ends: clamped)
    saved_ms, last = 0.0, None  # the slot whose prefill the last pass read (its next step gives its first token)
    for ms, parts in passes:
        steps = [(slot, rows) for slot, rows, logits in parts if rows == logits and rows > 0]
        if len(steps) == len(parts) == 1 and steps[0][0] != last:
            saved_ms += ms * (1 - 1 / gain(steps[0][1]))
        last = parts[0][0] if len(parts) == 1 and parts[0][2] != parts[0][1] else None
    return serial["wall_s"] / (serial["wall_s"] - saved_ms / 1e3)


def divergence(a: str, b: str) -> str:
    """ "equal", or where `b` leaves `a`: the character and a little of each side."""
    if a == b:
        return "equal"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"diverges at char {i}: {a[i : i + 24]!r} vs {b[i : i + 24]!r}"


def chats_cells(kind: Kind, args, work: Path, seed: Path, rep: int) -> dict:
    """One repeat on `kind`: one after another and at once (fresh servers, order alternating with `rep`); both
    cells send the same prompts (the repeat's nonce)."""
    bodies = chat_bodies(args.quick, f"r{rep}")
    warm = {
        "model": "specdec",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": f"[{rep}] Say hello."}],
    }
    res: dict = {}
    for together in (False, True) if rep % 2 == 0 else (True, False):
        name = "together" if together else "serial"
        with Cell(kind, args, work, seed, f"r{rep}-chats-{name}") as c:
            stream(c.url, "/v1/chat/completions", warm)  # the first request's one-off costs, as the runs
            warmed = len(c.passes())  # (the warm-up's passes are on disk: each is before the logits it returned)
            replies = chats_cell(c.url, bodies, together)
            res[f"{name}_passes"] = c.passes()[warmed:]
        for i, r in enumerate(replies):
            _check(r, f"chat {i + 1} ({name})")
        res[name] = aggregate(replies)
        res[f"{name}_texts"] = [r.text for r in replies]
        print(
            f"  {kind.name} rep {rep + 1} {name}: {res[name]['tok_s']:.2f} tok/s, decode "
            f"{res[name]['decode_tok_s']:.2f} tok/s, {res[name]['wall_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    res["same"] = [divergence(a, b) for a, b in zip(res["serial_texts"], res["together_texts"], strict=False)]
    return res


def chats_table(
    kind: str, reps: list[dict], peer: list[dict] | None, gain: float | None = None, measured: dict | None = None
) -> str:
    """Scenario 2's table for one server kind (and its ratio to llama-server's at once, when measured; with `gain`,
    `sharing_gain`, the `ceiling` of at once / one after another on this machine from the verify curve; with
    `measured`, `stream_gain`'s: the target's ceiling, `passes_ceiling` (the serial cells' own decode passes, each
    shared at its size), and two more from passes shared by four KV streams as timed here: the largest ratio at one
    size, and the best shared against the best apart)."""
    col = lambda cell, key: [r[cell][key] for r in reps]  # noqa: E731
    ratio = [t / s for t, s in zip(col("together", "tok_s"), col("serial", "tok_s"), strict=False)]
    dratio = [t / s for t, s in zip(col("together", "decode_tok_s"), col("serial", "decode_tok_s"), strict=False)]
    prompts = reps[0]["serial"]["prompts"]
    out = [
        f"### {kind}: four greedy chats (prompts {', '.join(map(str, prompts))} tokens)",
        "",
        "| measure | median (min-max) | target |",
        "|---|---|---|",
        f"| one after another: aggregate tok/s | {spread(col('serial', 'tok_s'))} | |",
        f"| at once: aggregate tok/s | {spread(col('together', 'tok_s'))} | |",
        f"| at once / one after another | {spread(ratio)} | {_target(ratio, 1.3, 'ratio', 'x', at_least=True)} |",
        f"| one after another: decode-phase tok/s | {spread(col('serial', 'decode_tok_s'))} | |",
        f"| at once: decode-phase tok/s | {spread(col('together', 'decode_tok_s'))} | |",
        f"| decode phase: at once / one after another | {spread(dratio)} | |",
        f"| one after another: wall s | {spread(col('serial', 'wall_s'))} | |",
        f"| at once: wall s | {spread(col('together', 'wall_s'))} | |",
    ]

    def against(name: str, top: list[float], why: str, target: bool = False) -> None:
        """Two rows: a ceiling of at once / one after another per repeat (`why` says whence), and at once against
        it (with the 0.95 target when `target`)."""
        vs = [x / t for x, t in zip(ratio, top, strict=False)]
        out.append(f"| {name} | {spread(top)} | {why} |")
        verdict = f" {_target(vs, 0.95, 'ratio', 'x', at_least=True)} |" if target else " |"
        out.append(f"| at once / that ceiling | {spread(vs)} |{verdict}")

    def decoding(g: float) -> list[float]:  # the ceiling when decoding at once is at most g times as fast
        return [ceiling(r["serial"], g) for r in reps]

    own = (
        [passes_ceiling(r["serial"], r.get("serial_passes") or [], measured["ratios"]) for r in reps]
        if measured
        else []
    )
    if own and all(t is not None for t in own):
        against(
            "ceiling here, these chats' own passes shared",
            [t for t in own if t is not None],
            "each decode pass one after another shared by 4 lanes at its rows, saving what that saves as timed "
            "(below), the prefills and the rest as they took",
            target=True,
        )
    if gain is not None:
        first = statistics.median(col("serial", "first_s"))
        against(
            "ceiling of at once / one after another here",
            decoding(gain),
            f"prefills {first:.1f} s of {statistics.median(col('serial', 'wall_s')):.1f} s one after another; "
            f"decoding at once at most {gain:.2f}x as fast (the most a pass shared by 4 lanes saves on the verify "
            "curve)",
        )
    if measured is not None:
        per = ", ".join(f"{r} rows {x:.2f}x" for r, x in measured["ratios"].items())
        against(
            "ceiling here, passes shared by 4 KV streams as timed",
            decoding(measured["gain"]),
            f"decoding at once at most {measured['gain']:.2f}x as fast: a pass of r rows on each of 4 lanes holding "
            f"the prompts against 4 passes apart ({per})",
        )
    if measured is not None and "best" in measured:
        best = measured["best"]
        against(
            "ceiling here, the best pass shared by 4 KV streams against the best apart",
            decoding(best["gain"]),
            f"decoding at once at most {best['gain']:.2f}x as fast with every draft right: the most rows per ms "
            f"shared ({best['shared']} rows a lane) over the most apart ({best['apart']} rows a lane)",
        )
    if peer:
        vs = [t / p["together"]["tok_s"] for t, p in zip(col("together", "tok_s"), peer, strict=False)]
        out.append(
            f"| at once / llama-server at once | {spread(vs)} | {_target(vs, 1.5, 'ratio', 'x', at_least=True)} |"
        )
    out += ["", "Each reply at once against the same chat one after another:", ""]
    for rep, r in enumerate(reps, 1):
        out.append(f"- repeat {rep}: " + "; ".join(f"chat {i + 1} {s}" for i, s in enumerate(r["same"])))
    return "\n".join(out)


# -- the sitting --------------------------------------------------------------------------------------------------
def host_line() -> str:
    """The host's CPU, its count and load, Python and the OS, in one line."""
    from specdec_cli.models.machine import cpu_model

    return (
        f"host: {cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}"
    )


def checkout_line(path: Path) -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(path), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev = "?"
    return f"{path} at {rev or '?'}"


def kv_per_token(model: Path) -> int:
    """Bytes of f16 KV cache per token of one sequence: n_layer x 2 (K, V) x n_head_kv x head_dim x 2, from the GGUF's
    metadata (head_dim: `attention.key_length`, else embedding_length / head_count)."""
    from specdec_cli.models.gguf import check_gguf

    info = check_gguf(model)
    m, a = info.metadata, info.architecture
    head_dim = m.get(f"{a}.attention.key_length") or m[f"{a}.embedding_length"] // m[f"{a}.attention.head_count"]
    return (
        int(m[f"{a}.block_count"])
        * 2
        * int(m.get(f"{a}.attention.head_count_kv") or m[f"{a}.attention.head_count"])
        * int(head_dim)
        * 2
    )


def concurrency_main(argv: list[str], workloads: set[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="bench_serve.py --workload editor-during-agent,chats", description=CONCURRENCY_DOC
    )
    ap.add_argument(
        "--scenarios",
        help="bench_concurrency.py's name for the workloads: editor, "
        "chats or both (comma-separated); overrides --workload",
    )
    ap.add_argument("-t", "--target", help="model (default: the catalog's default target)")
    ap.add_argument("--method", help="specdec serve --method (default: its default)")
    ap.add_argument("--parallel", type=int, default=4, help="specdec serve --parallel (if it has it), llama-server -np")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, help="specdec serve --ctx (default its own); llama-server -c (default 32768)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: a 400-token agent request, 8-token FIMs and replies, 100-250-token chats",
    )
    ap.add_argument("--agent-prompt", type=int, help="the agent's prompt, about, in tokens (default 8000; --quick 400)")
    ap.add_argument("--agent-tokens", type=int, help="the agent's max tokens (default 256; quick 8)")
    ap.add_argument("--agent-body", type=Path, help="the agent's request body (agent_capture.py's NNN-POST-*.json)")
    ap.add_argument("--fim-n-predict", type=int, help="FIM n_predict (default llama.vim's 128; quick 8)")
    ap.add_argument("--fim-alone", type=int, help="FIM requests in the alone cell (default 8; quick 3)")
    ap.add_argument("--llama-server", type=Path, help="also measure this llama-server (chats)")
    ap.add_argument("--baseline", type=Path, help="also measure the specdec of this checkout")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args(argv)
    q = args.quick
    args.agent_prompt = args.agent_prompt or (400 if q else 8000)
    args.agent_tokens = args.agent_tokens or (8 if q else 256)
    args.fim_n_predict = args.fim_n_predict or (8 if q else 128)
    args.fim_alone = args.fim_alone or (3 if q else 8)
    scenarios = (
        {s.strip() for s in args.scenarios.split(",")}
        if args.scenarios
        else {"editor" if w == "editor-during-agent" else w for w in workloads}
    )
    if not scenarios <= {"editor", "chats"}:
        raise SystemExit(f"--scenarios: {args.scenarios!r}: use editor, chats or editor,chats")

    sys.path.insert(0, str(ROOT))
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    kinds = [Kind("specdec", checkout=ROOT, parallel=lists_parallel(ROOT))]
    if args.baseline is not None:
        kinds.append(
            Kind(
                f"specdec@{args.baseline.name}",
                checkout=args.baseline.resolve(),
                parallel=lists_parallel(args.baseline.resolve()),
            )
        )
    peer = Kind("llama-server", binary=args.llama_server) if args.llama_server is not None else None
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(host_line())
    print(host.describe_build(system_info()))
    for k in kinds:
        print(f"{k.name}: {checkout_line(k.checkout)}; --parallel {args.parallel if k.parallel else 'not offered'}")
    if peer is not None:
        print(f"llama-server: {peer.binary} -np {args.parallel} -kvu --spec-type ngram-mod, -t {args.threads}")
    model = model_path(args.target)
    print(
        f"model: {model.name} (KV cache {kv_per_token(model) / 1024:g} KiB per token); threads {args.threads}; "
        f"repeats {args.repeats}{'; --quick' if q else ''}",
        flush=True,
    )

    if "editor" in scenarios:
        what = (
            f"{args.agent_body} (its body)"
            if args.agent_body
            else f"built: Claude Code's shape, specdec's {', '.join(AGENT_FILES)} at {SOURCE_COMMIT[:10]} cut to ~"
            f"{args.agent_prompt} tokens, and a question"
        )
        print(f"agent request: POST /v1/messages, streamed, greedy, max_tokens {args.agent_tokens}; {what}")
        print(
            f"editor: POST /infill as llama.vim sends it, n_predict {args.fim_n_predict}, every {FIM_PERIOD_S:g} s, "
            f"in {FIM_FILE} at {SOURCE_COMMIT[:10]}; count_tokens {COUNT_AT_S:g} s into the agent's request"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    seed = seed_home(work)
    print(f"server logs in {work}", file=sys.stderr)
    results: dict = {}
    editor = Editor.make(q, args.fim_n_predict) if "editor" in scenarios else None
    for rep in range(args.repeats):
        for k in kinds:
            if editor is not None:
                results.setdefault(("editor", k.name), []).append(editor_cells(k, args, work, seed, rep, editor))
            if "chats" in scenarios:
                results.setdefault(("chats", k.name), []).append(chats_cells(k, args, work, seed, rep))
        if peer is not None and "chats" in scenarios:
            results.setdefault(("chats", peer.name), []).append(chats_cells(peer, args, work, seed, rep))
    print()
    gain = sharing_gain(seed, model, 4)
    measured = None
    if "chats" in scenarios and not q:  # alone, after the cells: what a pass shared by four KV streams saves here
        measured = stream_gain(model, [b["messages"] for b in chat_bodies(q, "gain")], args.threads)
        print(f"passes shared by 4 KV streams (prompts {measured['depths']} tokens): {measured['gain']:.2f}x at best")
    for (scenario, name), reps in results.items():
        if scenario == "editor":
            print(editor_table(name, reps))
        else:
            print(
                chats_table(
                    name,
                    reps,
                    results.get(("chats", "llama-server")) if name != "llama-server" else None,
                    gain if name != "llama-server" else None,
                    measured if name != "llama-server" else None,
                )
            )
        print()
    base = results.get(("chats", kinds[-1].name)) if len(kinds) > 1 else None
    if base is not None and "chats" in scenarios:  # one client at a time: this checkout against the baseline's
        ours = results[("chats", kinds[0].name)]
        ratio = [o["serial"]["tok_s"] / b["serial"]["tok_s"] for o, b in zip(ours, base, strict=False)]
        print(
            f"one after another, {kinds[0].name} / {kinds[-1].name} aggregate tok/s: {spread(ratio)} "
            f"({_target(ratio, 0.97, 'ratio', 'x', at_least=True)}: at most 3 % slower)\n"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({f"{s}/{n}": r for (s, n), r in results.items()}, indent=1))
    shutil.rmtree(work / "seed-home", ignore_errors=True)
    return 0


# -- --workload replay: captured agent sessions against specdec serve and llama-server (was agents_replay.py) -


SESSIONS = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "agent-sessions"


# -- sessions -------------------------------------------------------------------------------------------------------
def import_session(capture: Path, name: str) -> Path:
    """Copy the POST /v1/messages or /v1/responses bodies of a capture directory (`agent_capture.py --out`'s:
    NNN-POST-*.json, each {"path", "body_json", ...}) into SESSIONS/name/NNN.json as {"path", "body"}. Returns the
    session directory."""
    out = SESSIONS / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n = 0
    for f in sorted(capture.glob("*-POST-*.json")):
        doc = json.loads(f.read_text())
        path = doc["path"].split("?")[0]
        if path not in ("/v1/messages", "/v1/responses") or not doc.get("body_json"):
            continue
        n += 1
        (out / f"{n:03d}.json").write_text(json.dumps({"path": path, "body": doc["body_json"]}))
    if n == 0:
        raise SystemExit(f"no POST /v1/messages or /v1/responses bodies in {capture}")
    print(f"{name}: {n} turns in {out}")
    return out


def load_session(name: str, max_tokens: int) -> list[tuple[str, dict]]:
    """The session's turns as (path, body), made greedy, unstreamed and limited to `max_tokens`."""
    turns = []
    for f in sorted((SESSIONS / name).glob("*.json")):
        doc = json.loads(f.read_text())
        body = dict(doc["body"])
        body["stream"] = False
        body["temperature"] = 0
        body.pop("top_p", None)
        body.pop("top_k", None)
        body["max_tokens" if doc["path"] == "/v1/messages" else "max_output_tokens"] = max_tokens
        turns.append((doc["path"], body))
    if not turns:
        raise SystemExit(f"no session {name!r} in {SESSIONS} (import one first: see --help)")
    return turns


def start_specdec(args, home: Path, log: Path) -> Server:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdec_cli",
        "serve",
        "--port",
        str(port),
        "--ctx",
        str(args.ctx),
        "--method",
        args.method,
    ]
    if args.target:
        cmd += ["-t", args.target]
    return Server("specdec", cmd, f"http://127.0.0.1:{port}", log, serve_env(home))


def start_llama(args, model: Path, log: Path) -> Server:
    port = free_port()
    cmd = [
        str(args.llama_server),
        "-m",
        str(model),
        "--jinja",
        "--spec-type",
        "ngram-mod",
        "-c",
        str(args.ctx),
        "-t",
        str(args.threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return Server("llama-server", cmd, f"http://127.0.0.1:{port}", log)


# -- replaying ------------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request's numbers. prefill_s / decode_s: the server's own; wall_s: the client's."""

    server: str
    run: str
    turn: int
    prompt: int
    cached: int
    output: int
    prefill_s: float
    decode_s: float
    wall_s: float
    note: str = ""

    @property
    def server_s(self) -> float:
        return self.prefill_s + self.decode_s


LLAMA_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


LLAMA_EVAL = re.compile(r"\|\s+eval time =\s*([\d.]+) ms /\s*(\d+) tokens")  # "| task 0 |        eval time = ..."


def usage_of(path: str, reply: dict) -> tuple[int, int, int]:
    """(prompt tokens, of which cached, output tokens) from an Anthropic or Responses reply's usage."""
    u = reply.get("usage") or {}
    if path == "/v1/messages":
        cached = u.get("cache_read_input_tokens") or 0
        return (u.get("input_tokens") or 0) + cached, cached, u.get("output_tokens") or 0
    cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return u.get("input_tokens") or 0, cached, u.get("output_tokens") or 0


def replay(server: Server, run: str, turns: list[tuple[str, dict]], timeout: float) -> list[Turn]:
    rows = []
    for i, (path, body) in enumerate(turns, 1):
        t0 = time.perf_counter()
        status, reply, _ = post(server.url, path, body, timeout)
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # llama-server logs its timings just after the reply
        log = server.new_log()
        if status != 200:
            print(f"  {server.kind} {run} turn {i}: HTTP {status}: {json.dumps(reply)[:300]}", file=sys.stderr)
            rows.append(Turn(server.kind, run, i, 0, 0, 0, 0.0, 0.0, wall, note=f"HTTP {status}"))
            continue
        prompt, cached, output = usage_of(path, reply)
        if server.kind == "specdec":
            spec = reply.get("specdec") or (reply.get("response") or {}).get("specdec") or {}
            prefill, decode = spec.get("prefill_ms", 0) / 1e3, spec.get("decode_ms", 0) / 1e3
            note = f"{spec.get('accepted', 0)}/{spec.get('drafted', 0)} drafts accepted"
        else:
            p, e = LLAMA_PROMPT.findall(log), LLAMA_EVAL.findall(log)
            prefill = float(p[-1][0]) / 1e3 if p else float("nan")
            decode = float(e[-1][0]) / 1e3 if e else float("nan")
            acc = re.findall(r"draft acceptance rate = ([\d.]+) \(\s*(\d+) accepted /\s*(\d+) generated", log)
            note = f"{acc[-1][1]}/{acc[-1][2]} drafts accepted" if acc else ""
        row = Turn(server.kind, run, i, prompt, cached, output, prefill, decode, wall, note)
        print(
            f"  {row.server:12s} {row.run:8s} turn {row.turn}: prompt {row.prompt} ({row.cached} cached), "
            f"{row.output} out, prefill {row.prefill_s:.1f} s, decode {row.decode_s:.1f} s, wall {row.wall_s:.1f} s"
            f" {row.note}",
            flush=True,
        )
        rows.append(row)
    return rows


def replay_table(rows: list[Turn]) -> str:
    """The per-turn table and the totals, as Markdown."""
    out = [
        "| server | run | turn | prompt (cached) | output | prefill s | decode s | server s | wall s | drafts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.server} | {r.run} | {r.turn} | {r.prompt} ({r.cached}) | {r.output} | {r.prefill_s:.1f} | "
            f"{r.decode_s:.1f} | {r.server_s:.1f} | {r.wall_s:.1f} | {r.note} |"
        )
    totals = {}
    for r in rows:
        t = totals.setdefault((r.server, r.run), [0.0, 0.0, 0.0])
        t[0] += r.prefill_s
        t[1] += r.decode_s
        t[2] += r.wall_s
    out.append("")
    out.append("| server | run | prefill s | decode s | server s | wall s | vs llama-server (server s) |")
    out.append("|---|---|---|---|---|---|---|")
    for (server, run), (p, d, w) in totals.items():
        peer = totals.get(("llama-server", run)) or totals.get(("llama-server", "first"))
        ratio = f"{(p + d) / (peer[0] + peer[1]):.2f}x" if peer and peer[0] + peer[1] > 0 else "-"
        out.append(f"| {server} | {run} | {p:.1f} | {d:.1f} | {p + d:.1f} | {w:.1f} | {ratio} |")
    return "\n".join(out)


def replay_run(args) -> None:
    turns = load_session(args.session, args.max_tokens)[: args.turns]
    work = Path(tempfile.mkdtemp(prefix="specdec-replay-"))
    home = args.home or work / "specdec-home"
    model = model_path(args.target)
    print(
        f"replaying {args.session} ({len(turns)} turns, max tokens {args.max_tokens}) with {model.name}; "
        f"logs in {work}; load: {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    print(host.describe_build(system_info()), flush=True)  # which build specdec serve runs (this venv's)
    rows: list[Turn] = []
    servers = [s for s in ("specdec", "llama-server") if s in args.servers]
    plan = [
        (run_name, kind)
        for run_name in args.runs.split(",")
        for kind in servers
        if not (kind == "llama-server" and run_name == "restart" and args.llama_once)
    ]
    for run_name, kind in plan:
        if kind == "specdec":
            server = start_specdec(args, home, work / "specdec.log")
        else:
            server = start_llama(args, model, work / "llama-server.log")
        try:
            rows += replay(server, run_name, turns, args.timeout)
        finally:
            server.stop()
    report = replay_table(rows)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


def replay_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_serve.py --workload replay", description=REPLAY_DOC)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a session from a capture directory (agent_capture.py --out)")
    imp.add_argument("capture", type=Path)
    imp.add_argument("--name", required=True)
    go = sub.add_parser("run", help="replay a session against both servers, twice")
    go.add_argument("--session", required=True)
    go.add_argument(
        "--llama-server",
        type=Path,
        help="llama-server to compare with (with --servers llama-server, the default)",
    )
    go.add_argument("-t", "--target")
    go.add_argument("--method", default="auto")
    go.add_argument("--ctx", type=int, default=32768)
    go.add_argument("--threads", type=int, default=2)
    go.add_argument("--max-tokens", type=int, default=256)
    go.add_argument("--timeout", type=float, default=3600)
    go.add_argument("--servers", default="specdec,llama-server")
    go.add_argument("--runs", default="first,restart", help="first: a cold start; restart: after a restart")
    go.add_argument("--turns", type=int, help="replay only the first N turns")
    go.add_argument(
        "--home",
        type=Path,
        help="specdec's SPECDEC_HOME (prompt cache, suffix store): "
        "default a fresh one; an earlier run's to replay after a restart only (--runs restart)",
    )
    go.add_argument("--out", type=Path, help="also write the tables (Markdown) here")
    go.add_argument(
        "--llama-once",
        action="store_true",
        help="replay on llama-server once: it keeps nothing across "
        "a restart, so its replay after one is its first session again (then the restart row compares "
        "with that)",
    )
    args = parser.parse_args(argv)
    if args.command == "import":
        import_session(args.capture, args.name)
    else:
        if args.llama_server is None and "llama-server" in args.servers:
            parser.error("--llama-server PATH is needed, or --servers specdec")
        replay_run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`--workload W[,W]` picks the workload; the rest of the command line is that workload's own options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument(
        "--workload",
        "-w",
        help=", ".join(WORKLOADS) + " (editor-during-agent and chats may go together, comma-separated)",
    )
    args, rest = ap.parse_known_args(argv)
    if args.workload is None:
        if "--help" in rest or "-h" in rest:
            print(__doc__)
            return 0
        ap.error("--workload is needed: " + ", ".join(WORKLOADS))
    workloads = {w.strip() for w in args.workload.split(",") if w.strip()}
    if not workloads or not workloads <= set(WORKLOADS):
        ap.error(f"--workload {args.workload!r}: use one of {', '.join(WORKLOADS)}")
    if workloads <= {"editor-during-agent", "chats"}:
        return concurrency_main(rest, workloads)
    if len(workloads) > 1:
        ap.error("only editor-during-agent and chats run together")
    return {"chat": chat_main, "fim": fim_main, "replay": replay_main}[workloads.pop()](rest)


if __name__ == "__main__":
    sys.exit(main())
