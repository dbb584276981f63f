"""Several clients on one `specdec serve` (issue 44): an editor during an agent's cold long request, and four greedy
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
   `timings`; those answered before the agent's end), count_tokens' latency, against the targets: FIM p95 during <= p95 alone + 1.5 s; agent during <= 1.1 x
   (alone + the FIMs' service time); count_tokens <= 0.1 s.
2. **Four greedy chats at once.** Four chat requests (`/v1/chat/completions`, streamed, temperature 0) with prompts of
   0.6-2k tokens (a source file to rewrite) and 128-256 tokens each: served one after another, then (the next cell,
   a fresh server) sent at once. Reported: aggregate tok/s (all output tokens over the wall time from the first send
   to the last reply's end) at once vs one after another; the decode phase's aggregate tok/s apart (output tokens
   after each reply's first, over the union of the replies' first-token-to-end intervals); each reply at once
   compared with its reply one after another (equal, or where it diverges); the ceiling of at once / one after
   another on this machine (`ceiling`: the prefills as long as one after another, decoding at once at most as much
   faster as one pass shared by four lanes saves on the verify curve, `sharing_gain`); with `--llama-server PATH`,
   the same on llama-server `-np N -kvu --spec-type ngram-mod --jinja` with the same threads and model file, and
   specdec at once against it.

Every cell runs on a fresh server (a fresh SPECDEC_HOME holding only this machine's verify curve and flash-attention
choice, copied from the user's learnt.json or measured by the first cell; no prompt cache): nothing one cell's
requests taught (the suffix store, `--k auto`, cached prompts) helps the next. Repeats alternate the cells' order.
`specdec serve --parallel N` is passed only when the server's --help lists it, so the same script measures today's
one-at-a-time server (the baseline) and the concurrent one; `--baseline DIR` also runs the specdec of another
checkout (e.g. a worktree at the last release) in the same sitting.

    python benchmarks/bench_concurrency.py                          # both scenarios, the default model, 3 repeats
    python benchmarks/bench_concurrency.py --scenarios chats --llama-server /work/peers/.../llama-server
    python benchmarks/bench_concurrency.py --quick --repeats 1      # small sizes: a smoke test (minutes)

The first cell measures this machine's verify curve when the user's learnt.json has none (minutes on 2 cores; a
server has 600 s to start); SPECDEC_VERIFY_CURVE=off skips it (a smoke test, not a measurement). Timings on a shared
machine are noise: run it alone on the host.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from agents_replay import Server, free_port, model_path  # benchmarks/ is on sys.path when a script in it runs

ROOT = Path(__file__).resolve().parent.parent
SOURCE_COMMIT = "fbc1b06c63a70e889841c505b6bc1021403fd9e7"  # the text the requests are built from (git show)
AGENT_FILES = ["specdec_cli/server/worker.py", "specdec_cli/server/http.py", "specdec_cli/server/service.py",
               "specdec_cli/driver.py", "specdec_cli/core/engine.py", "specdec_cli/stores/kv_parking.py"]
FIM_FILE = "specdec_cli/core/controller.py"  # the file being edited: the cursor inside it
FIM_EXTRA = ["specdec_cli/core/cost_model.py", "specdec_cli/core/verify_curve.py", "specdec_cli/core/stats.py"]
CHAT_FILES = ["specdec_cli/server/fim.py", "specdec_cli/core/detok.py", "specdec_cli/stores/kv_parking.py",
              "specdec_cli/server/reply.py"]
CHARS_PER_TOKEN = 3.3  # Qwen2.5's tokenizer on this Python source, about (the tables report the real counts)
FIM_PERIOD_S = 2.0
COUNT_AT_S = 5.0

AGENT_SYSTEM = ("You are a coding agent working in the user's repository. Use the tools to read and change files; "
                "answer concisely. When the user asks a question about code they pasted, answer from that code.")
AGENT_TOOLS = [  # Claude Code's shape: name, description, input_schema
    {"name": "Read", "description": "Read a file from the local filesystem.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                        "offset": {"type": "number"}, "limit": {"type": "number"}},
                      "required": ["file_path"], "additionalProperties": False}},
    {"name": "Bash", "description": "Run a bash command and return its output.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                        "description": {"type": "string"}},
                      "required": ["command"], "additionalProperties": False}},
    {"name": "Edit", "description": "Replace old_string with new_string in a file.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                        "old_string": {"type": "string"},
                                                        "new_string": {"type": "string"}},
                      "required": ["file_path", "old_string", "new_string"], "additionalProperties": False}},
]
AGENT_TASK = ("Above are the server's worker, HTTP layer, service, driver, engine and KV parking. Explain in a short "
              "numbered list how one request travels from the HTTP handler to the engine and back, naming the "
              "functions it passes through.")
CHAT_TASK = "Rewrite this module with full type hints on every function and a one-line docstring where one is missing."


# -- text ---------------------------------------------------------------------------------------------------------
def source(path: str) -> str:
    """`path` at SOURCE_COMMIT (the same text whatever is checked out)."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{SOURCE_COMMIT}:{path}"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"cannot read {path} at {SOURCE_COMMIT[:10]} (a git checkout of specdec is needed): {e}")


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
        body["system"] = f"[{nonce}] {system}" if isinstance(system, str) else \
            [{"type": "text", "text": f"[{nonce}]"}, *system]
        body.update(stream=True, temperature=0, max_tokens=max_tokens)
        body.pop("top_p", None), body.pop("top_k", None)
        return path, body
    budget, parts = int(tokens * CHARS_PER_TOKEN), []
    for f in AGENT_FILES:
        text = source(f)
        parts.append(f"<file path=\"{f}\">\n{text[:max(0, budget)]}\n</file>")
        budget -= len(text)
        if budget <= 0:
            break
    body = {"model": "claude-sonnet-4-5", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "system": f"[{nonce}] {AGENT_SYSTEM}", "tools": AGENT_TOOLS,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "\n\n".join(parts)},
                                                       {"type": "text", "text": AGENT_TASK}]}]}
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
        extra = [{"filename": f, "text": "".join(source(f).splitlines(keepends=True)[:chunk])}
                 for f in FIM_EXTRA[: 1 if quick else 3]]
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > len(lines) // 2)
        return cls(lines, at + 1, extra, "        ", n_predict, *((16, 8) if quick else (256, 64)))

    def body(self, i: int, *, warm_up: bool = False) -> dict:
        """The i-th request (the current line typed i characters further; i < 0: nothing typed yet)."""
        n_prefix, n_suffix = self.n_prefix, self.n_suffix
        word = "return self.weights[index]"
        return {"id_slot": 0, "input_prefix": "".join(self.lines[max(0, self.at - n_prefix):self.at]),
                "input_suffix": "".join(self.lines[self.at + 1:self.at + 1 + n_suffix]),
                "input_extra": self.extra, "prompt": self.typed + word[:max(0, i) % len(word)],
                "n_predict": 0 if warm_up else self.n_predict, "n_indent": len(self.typed), "top_k": 40,
                "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
                "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "temperature": 0,
                "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n",
                                    "timings/predicted_ms", "tokens_cached", "truncated"]}


def chat_bodies(quick: bool, nonce: str) -> list[dict]:
    """The four chats: a module to rewrite, 0.6-2k prompt tokens (quick: 100-250), 128-256 max tokens (quick:
    8-16). `nonce` starts the system prompt (the cells' prompts are the same but for it: a reply is compared with
    the same chat's reply in the other cell, so both cells of a repeat share it)."""
    sizes, limits = ((100, 150, 200, 250), (8, 12, 16, 10)) if quick else ((600, 1000, 1400, 1900),
                                                                           (128, 192, 256, 160))
    out = []
    for f, n, limit in zip(CHAT_FILES, sizes, limits):
        text = source(f)[: int(n * CHARS_PER_TOKEN)]
        out.append({"model": "specdec", "stream": True, "temperature": 0, "max_tokens": limit,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": f"[{nonce}] You are a careful Python programmer."},
                                 {"role": "user", "content": f"{CHAT_TASK}\n\n```python\n{text}\n```"}]})
    return out


# -- HTTP ---------------------------------------------------------------------------------------------------------
HEADERS = {"Content-Type": "application/json", "x-api-key": "unused", "Authorization": "Bearer unused",
           "anthropic-version": "2023-06-01"}


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
        out = subprocess.run([sys.executable, "-P", "-m", "specdec_cli", "serve", "--help"], capture_output=True,
                             text=True, env=env, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--parallel" in out


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
    fresh = {k: v for k, v in (doc.get("curves") or {}).items()
             if not (v.get("curve") or {}).get("stale") and (k not in curves or (curves[k].get("curve") or {}).get("stale"))}
    if not fresh and (seed / "learnt.json").is_file():
        return
    curves.update(fresh)
    kept = {**doc, **kept, "entries": {}}
    (seed / "learnt.json").write_text(json.dumps(kept))


class Cell:
    """One fresh server for one cell (a context manager): `url`."""

    def __init__(self, kind: Kind, args, work: Path, seed: Path, label: str) -> None:
        self.kind, self.args, self.work, self.seed, self.label = kind, args, work, seed, label

    def __enter__(self) -> Cell:
        a, port = self.args, free_port()
        log = self.work / f"{self.kind.name}-{self.label}.log"
        if self.kind.binary is not None:
            cmd = [str(self.kind.binary), "-m", str(model_path(a.target)), "--jinja", "-np", str(a.parallel), "-kvu",
                   "--spec-type", "ngram-mod", "-c", str(a.ctx or 32768), "-t", str(a.threads),
                   "--host", "127.0.0.1", "--port", str(port)]
            self.home = None
            self.server = Server(self.kind.name, cmd, f"http://127.0.0.1:{port}", log)
        else:
            self.home = Path(tempfile.mkdtemp(prefix="home-", dir=self.work))
            shutil.copytree(self.seed, self.home / "data", dirs_exist_ok=True)  # data_dir(): $SPECDEC_HOME/data
            # -P: not the working directory's specdec_cli (the checkout this script is in) but the PYTHONPATH's
            cmd = [sys.executable, "-P", "-m", "specdec_cli", "serve", "--port", str(port), "--threads", str(a.threads),
                   "--no-prompt-cache"]
            cmd += ["--ctx", str(a.ctx)] if a.ctx else []
            cmd += ["-t", a.target] if a.target else []
            cmd += ["--method", a.method] if a.method else []
            cmd += ["--parallel", str(a.parallel)] if self.kind.parallel else []
            env = {**os.environ, "SPECDEC_HOME": str(self.home), "SPECDEC_PROMPT_CACHE": str(self.home / "prompts"),
                   "PYTHONPATH": str(self.kind.checkout) + os.pathsep + os.environ.get("PYTHONPATH", "")}
            try:
                self.server = Server(self.kind.name, cmd, f"http://127.0.0.1:{port}", log, env)
            except SystemExit:
                harvest(self.seed, self.home)  # a verify curve measured before it gave up is kept for the next
                raise
        self.url = self.server.url
        return self

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
    ms = (reply.get("timings/prompt_ms", timings.get("prompt_ms")) or 0) + \
        (reply.get("timings/predicted_ms", timings.get("predicted_ms")) or 0)
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
    order = order[rep % 3:] + order[:rep % 3]
    # one prompt for the repeat's agent cells (each on a fresh server with no prompt cache), so its reply during the
    # FIMs can be compared with its reply alone
    path, body = agent_body(args.agent_prompt, args.agent_tokens, f"r{rep}", args.agent_body)
    for cell in order:
        with Cell(kind, args, work, seed, f"r{rep}-{cell}") as c:
            warm_fim(c.url, editor)
            if cell == "fim":
                fims: list[Fim] = []
                fim_loop(c.url, editor, lambda: len(fims) >= args.fim_alone, fims, start=1)
                got = {"fim_alone": [f.latency for f in fims]}
            elif cell == "agent":
                agent = stream(c.url, path, body)
                _check(agent, "agent alone")
                got = {"agent_alone": agent.wall, "agent_prompt": agent.prompt, "agent_out": agent.tokens,
                       "agent_text": agent.text}
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
    return {"fim_during": latencies, "agent_during": agent.wall, "agent_during_text": agent.text,
            "agent_during_out": agent.tokens, "fim_service": service, "count_s": count_s,
            "count_n": n}


def fim_costs(fims: list[Fim], agent_end: float) -> tuple[list[float], float]:
    """(latencies of the FIMs sent before the agent's reply ended, answered then or later; seconds of server time of
    those answered before it ended: the service time the agent's own may grow by)."""
    sent = [f for f in fims if f.sent < agent_end]
    return [f.latency for f in sent], sum(f.service_s for f in sent if f.sent + f.latency <= agent_end)


def _check(s: Streamed, what: str) -> None:
    if s.error:
        raise SystemExit(f"{what} failed: {s.error}")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0-1) of `values`, linear between ranks (nan for none)."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def spread(values: list[float], digits: int = 2) -> str:
    """"median (min-max)" of `values`."""
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _fmt(v) -> str:
    if isinstance(v, list):
        return f"p50 {pct(v, .5):.2f} s p95 {pct(v, .95):.2f} s (n={len(v)})"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def editor_table(kind: str, reps: list[dict]) -> str:
    """Scenario 1's table for one server kind: one row per measure, the median (min-max) over the repeats."""
    col = lambda key, f=lambda x: x: [f(r[key]) for r in reps if key in r]  # noqa: E731
    fim_alone95, fim_during95 = col("fim_alone", lambda v: pct(v, .95)), col("fim_during", lambda v: pct(v, .95))
    agent_alone, agent_during, service = col("agent_alone"), col("agent_during"), col("fim_service")
    count = col("count_s")
    rows = [("FIM latency p50 alone, s", col("fim_alone", lambda v: pct(v, .5)), ""),
            ("FIM latency p95 alone, s", fim_alone95, ""),
            ("FIM latency p50 during the agent, s", col("fim_during", lambda v: pct(v, .5)), ""),
            ("FIM latency p95 during the agent, s", fim_during95,
             _target([d - a for a, d in zip(fim_alone95, fim_during95)], 1.5, "p95 during - p95 alone", "s")),
            ("FIMs answered during the agent", col("fim_during", len), ""),
            ("agent alone, s", agent_alone, ""),
            ("agent during, s", agent_during, ""),
            ("FIMs' service time during the agent, s", service, ""),
            ("agent during / (alone + FIM service)", [d / (a + s) for a, d, s in zip(agent_alone, agent_during, service)],
             _target([d / (a + s) for a, d, s in zip(agent_alone, agent_during, service)], 1.1, "ratio", "x")),
            ("count_tokens 5 s in, s", count, _target(count, 0.1, "latency", "s"))]
    prompt = col("agent_prompt")
    out = [f"### {kind}: an editor during an agent's cold request ({spread(prompt, 0)} prompt tokens, "
           f"{spread(col('agent_out'), 0)} out)", "", "| measure | median (min-max) | target |", "|---|---|---|"]
    out += [f"| {name} | {spread(vals)} | {target} |" for name, vals, target in rows]
    same = [f"repeat {i + 1}: " + divergence(r["agent_text"], r["agent_during_text"]) +
            f" ({r.get('agent_out')} tokens alone, {r.get('agent_during_out')} during)"
            for i, r in enumerate(reps) if "agent_text" in r and "agent_during_text" in r]
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
    return {"tok_s": tokens / wall if wall > 0 else float("nan"), "wall_s": wall, "tokens": tokens,
            "decode_tok_s": after_first / decode if decode > 0 else float("nan"),
            "first_s": sum(r.first - r.sent for r in replies if r.first is not None),
            "prompts": [r.prompt for r in replies]}


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
    ours = sorted(((v.get("curve") or {}) for k, v in curves.items() if k.startswith(f"{model.name}:")),
                  key=lambda c: bool(c.get("stale")))  # a stale curve (drifted, or measured on a busy machine) last
    ms = ours[0].get("ms") if ours else None
    if not ms or len(ms) < n:
        return None
    return max(sum(ms[r - 1] for r in rs) / ms[sum(rs) - 1]
               for rs in itertools.combinations_with_replacement(range(1, rows + 1), n) if sum(rs) <= len(ms))


def ceiling(serial: dict, gain: float) -> float:
    """The most four chats at once can gain over the same four one after another (`serial`, their `aggregate`) when
    the prefills take what they took one after another (a prompt is read in batches of up to 512 rows either way:
    a CPU's prompt pass is as fast alone as beside another) and decoding at once is at most `gain` times as fast:
    wall / (prefills + decoding / gain)."""
    first, wall = serial["first_s"], serial["wall_s"]
    return wall / (first + (wall - first) / gain)


def divergence(a: str, b: str) -> str:
    """"equal", or where `b` leaves `a`: the character and a little of each side."""
    if a == b:
        return "equal"
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"diverges at char {i}: {a[i:i + 24]!r} vs {b[i:i + 24]!r}"


def chats_cells(kind: Kind, args, work: Path, seed: Path, rep: int) -> dict:
    """One repeat on `kind`: one after another and at once (fresh servers, order alternating with `rep`); both
    cells send the same prompts (the repeat's nonce)."""
    bodies = chat_bodies(args.quick, f"r{rep}")
    warm = {"model": "specdec", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"[{rep}] Say hello."}]}
    res: dict = {}
    for together in ((False, True) if rep % 2 == 0 else (True, False)):
        name = "together" if together else "serial"
        with Cell(kind, args, work, seed, f"r{rep}-chats-{name}") as c:
            stream(c.url, "/v1/chat/completions", warm)  # the first request's one-off costs, as the runs
            replies = chats_cell(c.url, bodies, together)
        for i, r in enumerate(replies):
            _check(r, f"chat {i + 1} ({name})")
        res[name] = aggregate(replies)
        res[f"{name}_texts"] = [r.text for r in replies]
        print(f"  {kind.name} rep {rep + 1} {name}: {res[name]['tok_s']:.2f} tok/s, decode "
              f"{res[name]['decode_tok_s']:.2f} tok/s, {res[name]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    res["same"] = [divergence(a, b) for a, b in zip(res["serial_texts"], res["together_texts"])]
    return res


def chats_table(kind: str, reps: list[dict], peer: list[dict] | None, gain: float | None = None) -> str:
    """Scenario 2's table for one server kind (and its ratio to llama-server's at once, when measured; and with
    `gain`, `sharing_gain`, the `ceiling` of at once / one after another on this machine)."""
    col = lambda cell, key: [r[cell][key] for r in reps]  # noqa: E731
    ratio = [t / s for t, s in zip(col("together", "tok_s"), col("serial", "tok_s"))]
    dratio = [t / s for t, s in zip(col("together", "decode_tok_s"), col("serial", "decode_tok_s"))]
    prompts = reps[0]["serial"]["prompts"]
    out = [f"### {kind}: four greedy chats (prompts {', '.join(map(str, prompts))} tokens)", "",
           "| measure | median (min-max) | target |", "|---|---|---|",
           f"| one after another: aggregate tok/s | {spread(col('serial', 'tok_s'))} | |",
           f"| at once: aggregate tok/s | {spread(col('together', 'tok_s'))} | |",
           f"| at once / one after another | {spread(ratio)} | {_target(ratio, 1.3, 'ratio', 'x', at_least=True)} |",
           f"| one after another: decode-phase tok/s | {spread(col('serial', 'decode_tok_s'))} | |",
           f"| at once: decode-phase tok/s | {spread(col('together', 'decode_tok_s'))} | |",
           f"| decode phase: at once / one after another | {spread(dratio)} | |",
           f"| one after another: wall s | {spread(col('serial', 'wall_s'))} | |",
           f"| at once: wall s | {spread(col('together', 'wall_s'))} | |"]
    if gain is not None:
        top = [ceiling(r["serial"], gain) for r in reps]
        first = statistics.median(col("serial", "first_s"))
        out.append(f"| ceiling of at once / one after another here | {spread(top)} | prefills {first:.1f} s of "
                   f"{statistics.median(col('serial', 'wall_s')):.1f} s one after another; decoding at once at most "
                   f"{gain:.2f}x as fast (the most a pass shared by 4 lanes saves on the verify curve) |")
    if peer:
        vs = [t / p["together"]["tok_s"] for t, p in zip(col("together", "tok_s"), peer)]
        out.append(f"| at once / llama-server at once | {spread(vs)} | {_target(vs, 1.5, 'ratio', 'x', at_least=True)} |")
    out += ["", "Each reply at once against the same chat one after another:", ""]
    for rep, r in enumerate(reps, 1):
        out.append(f"- repeat {rep}: " + "; ".join(f"chat {i + 1} {s}" for i, s in enumerate(r["same"])))
    return "\n".join(out)


# -- the sitting --------------------------------------------------------------------------------------------------
def host_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"host: {cpu}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at start, Python " \
           f"{platform.python_version()}, {platform.system()} {platform.release()}"


def checkout_line(path: Path) -> str:
    try:
        rev = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
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
    return int(m[f"{a}.block_count"]) * 2 * int(m.get(f"{a}.attention.head_count_kv") or
                                                 m[f"{a}.attention.head_count"]) * int(head_dim) * 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="editor,chats", help="editor, chats or both (comma-separated)")
    ap.add_argument("-t", "--target", default=None, help="model (default: the catalog's default target)")
    ap.add_argument("--method", default=None, help="specdec serve --method (default: its default)")
    ap.add_argument("--parallel", type=int, default=4, help="sequences at once: specdec serve --parallel (when "
                    "listed by its --help) and llama-server -np")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=None, help="specdec serve --ctx (default: its own, 32768) and "
                    "llama-server -c, the one KV pool its -kvu slots share (default 32768)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test): a ~400-token agent request of "
                    "8 tokens, 8-token FIMs in a 24-line window, 100-250-token chats of 8-16 tokens")
    ap.add_argument("--agent-prompt", type=int, default=None, help="the agent request's prompt tokens, about "
                    "(default 8000; --quick 400)")
    ap.add_argument("--agent-tokens", type=int, default=None, help="the agent's max tokens (default 256; quick 8)")
    ap.add_argument("--agent-body", type=Path, default=None, help="an Anthropic /v1/messages request body (or an "
                    "agent_capture.py NNN-POST-*.json) to send as the agent's instead of the built one")
    ap.add_argument("--fim-n-predict", type=int, default=None, help="FIM n_predict (default llama.vim's 128; quick 8)")
    ap.add_argument("--fim-alone", type=int, default=None, help="FIM requests in the alone cell (default 8; quick 3)")
    ap.add_argument("--llama-server", type=Path, default=None, help="also measure this llama-server (chats)")
    ap.add_argument("--baseline", type=Path, default=None, help="also measure the specdec of this checkout")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    args = ap.parse_args()
    q = args.quick
    args.agent_prompt = args.agent_prompt or (400 if q else 8000)
    args.agent_tokens = args.agent_tokens or (8 if q else 256)
    args.fim_n_predict = args.fim_n_predict or (8 if q else 128)
    args.fim_alone = args.fim_alone or (3 if q else 8)
    scenarios = {s.strip() for s in args.scenarios.split(",")}
    if not scenarios <= {"editor", "chats"}:
        raise SystemExit(f"--scenarios: {args.scenarios!r}: use editor, chats or editor,chats")

    sys.path.insert(0, str(ROOT))
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    kinds = [Kind("specdec", checkout=ROOT, parallel=lists_parallel(ROOT))]
    if args.baseline is not None:
        kinds.append(Kind(f"specdec@{args.baseline.name}", checkout=args.baseline.resolve(),
                          parallel=lists_parallel(args.baseline.resolve())))
    peer = Kind("llama-server", binary=args.llama_server) if args.llama_server is not None else None
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(host_line())
    print(host.describe_build(system_info()))
    for k in kinds:
        print(f"{k.name}: {checkout_line(k.checkout)}; --parallel {args.parallel if k.parallel else 'not offered'}")
    if peer is not None:
        print(f"llama-server: {peer.binary} -np {args.parallel} -kvu --spec-type ngram-mod, -t {args.threads}")
    model = model_path(args.target)
    print(f"model: {model.name} (KV cache {kv_per_token(model) / 1024:g} KiB per token); threads {args.threads}; "
          f"repeats {args.repeats}{'; --quick' if q else ''}", flush=True)

    if "editor" in scenarios:
        what = f"{args.agent_body} (its body)" if args.agent_body else \
            f"built: Claude Code's shape, specdec's {', '.join(AGENT_FILES)} at {SOURCE_COMMIT[:10]} cut to ~" \
            f"{args.agent_prompt} tokens, and a question"
        print(f"agent request: POST /v1/messages, streamed, greedy, max_tokens {args.agent_tokens}; {what}")
        print(f"editor: POST /infill as llama.vim sends it, n_predict {args.fim_n_predict}, every {FIM_PERIOD_S:g} s, "
              f"in {FIM_FILE} at {SOURCE_COMMIT[:10]}; count_tokens {COUNT_AT_S:g} s into the agent's request")
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
    for (scenario, name), reps in results.items():
        if scenario == "editor":
            print(editor_table(name, reps))
        else:
            print(chats_table(name, reps, results.get(("chats", "llama-server")) if name != "llama-server" else None,
                              gain if name != "llama-server" else None))
        print()
    base = results.get(("chats", kinds[-1].name)) if len(kinds) > 1 else None
    if base is not None and "chats" in scenarios:  # one client at a time: this checkout against the baseline's
        ours = results[("chats", kinds[0].name)]
        ratio = [o["serial"]["tok_s"] / b["serial"]["tok_s"] for o, b in zip(ours, base)]
        print(f"one after another, {kinds[0].name} / {kinds[-1].name} aggregate tok/s: {spread(ratio)} "
              f"({_target(ratio, 0.97, 'ratio', 'x', at_least=True)}: at most 3 % slower)\n")
    if args.json is not None:
        args.json.write_text(json.dumps({f"{s}/{n}": r for (s, n), r in results.items()}, indent=1))
    shutil.rmtree(work / "seed-home", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
