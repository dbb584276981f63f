"""Speed on coding agents' traffic: replay captured multi-turn agent sessions against `specdec serve` and llama-server.

    # once: capture a session (benchmarks/agent_capture.py: the agent against a scripted stub) and import it
    python benchmarks/agent_capture.py claude --out /work/captures/claude-code --import claude-code
    python benchmarks/agent_capture.py codex --out /work/captures/codex-catalog --import codex
    # or import a capture directory made earlier: its POST bodies in order
    python benchmarks/agents_replay.py import /work/captures/claude-code --name claude-code
    # the benchmark (llama-server built from the same vendored llama.cpp)
    python benchmarks/agents_replay.py run --session claude-code \\
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
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "agent-sessions"
DEFAULT_LLAMA_SERVER = Path("/work/native/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")


# -- sessions -------------------------------------------------------------------------------------------------------
def import_session(capture: Path, name: str) -> Path:
    """Copy the POST /v1/messages or /v1/responses bodies of a capture directory (`agent_capture.py --out`'s:
    NNN-POST-*.json, each {"path", "body_json", ...}) into SESSIONS/name/NNN.json as {"path", "body"}. Returns the session directory."""
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


def start_specdec(args, home: Path, log: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "specdec_cli", "serve", "--port", str(port), "--ctx", str(args.ctx),
           "--method", args.method]
    if args.target:
        cmd += ["-t", args.target]
    env = {**os.environ, "SPECDEC_HOME": str(home), "SPECDEC_PROMPT_CACHE": str(home / "prompts"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return Server("specdec", cmd, f"http://127.0.0.1:{port}", log, env)


def start_llama(args, model: Path, log: Path) -> Server:
    port = free_port()
    cmd = [str(args.llama_server), "-m", str(model), "--jinja", "--spec-type", "ngram-mod", "-c", str(args.ctx),
           "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)]
    return Server("llama-server", cmd, f"http://127.0.0.1:{port}", log)


def model_path(target: str | None) -> Path:
    """The GGUF file specdec resolves `target` to (default: the catalog's default target)."""
    sys.path.insert(0, str(ROOT))
    from specdec_cli.config import load_catalog  # noqa: PLC0415
    from specdec_cli.models.resolver import resolve  # noqa: PLC0415

    catalog = load_catalog()
    return Path(resolve(target or catalog.default_target, catalog))


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


def post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "x-api-key": "unused", "Authorization": "Bearer unused",
        "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


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
        status, reply = post(server.url + path, body, timeout)
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
        print(f"  {row.server:12s} {row.run:8s} turn {row.turn}: prompt {row.prompt} ({row.cached} cached), "
              f"{row.output} out, prefill {row.prefill_s:.1f} s, decode {row.decode_s:.1f} s, wall {row.wall_s:.1f} s"
              f" {row.note}", flush=True)
        rows.append(row)
    return rows


def table(rows: list[Turn]) -> str:
    """The per-turn table and the totals, as Markdown."""
    out = ["| server | run | turn | prompt (cached) | output | prefill s | decode s | server s | wall s | drafts |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.server} | {r.run} | {r.turn} | {r.prompt} ({r.cached}) | {r.output} | {r.prefill_s:.1f} | "
                   f"{r.decode_s:.1f} | {r.server_s:.1f} | {r.wall_s:.1f} | {r.note} |")
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


def run(args) -> None:
    turns = load_session(args.session, args.max_tokens)[: args.turns]
    work = Path(tempfile.mkdtemp(prefix="specdec-replay-"))
    home = args.home or work / "specdec-home"
    model = model_path(args.target)
    print(f"replaying {args.session} ({len(turns)} turns, max tokens {args.max_tokens}) with {model.name}; "
          f"logs in {work}; load: {os.getloadavg()[0]:.1f}", flush=True)
    from specdec_cli.models import host
    from specdec_cli.models.llama import system_info

    print(host.describe_build(system_info()), flush=True)  # which build specdec serve runs (this venv's)
    rows: list[Turn] = []
    servers = [s for s in ("specdec", "llama-server") if s in args.servers]
    plan = [(run_name, kind) for run_name in args.runs.split(",") for kind in servers
            if not (kind == "llama-server" and run_name == "restart" and args.llama_once)]
    for run_name, kind in plan:
        if kind == "specdec":
            server = start_specdec(args, home, work / "specdec.log")
        else:
            server = start_llama(args, model, work / "llama-server.log")
        try:
            rows += replay(server, run_name, turns, args.timeout)
        finally:
            server.stop()
    report = table(rows)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a session from a capture directory (agent_capture.py --out)")
    imp.add_argument("capture", type=Path)
    imp.add_argument("--name", required=True)
    go = sub.add_parser("run", help="replay a session against both servers, twice")
    go.add_argument("--session", required=True)
    go.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    go.add_argument("-t", "--target", default=None)
    go.add_argument("--method", default="auto")
    go.add_argument("--ctx", type=int, default=32768)
    go.add_argument("--threads", type=int, default=2)
    go.add_argument("--max-tokens", type=int, default=256)
    go.add_argument("--timeout", type=float, default=3600)
    go.add_argument("--servers", default="specdec,llama-server")
    go.add_argument("--runs", default="first,restart", help="first: a cold start; restart: after a restart")
    go.add_argument("--turns", type=int, default=None, help="replay only the first N turns")
    go.add_argument("--home", type=Path, default=None, help="specdec's SPECDEC_HOME (prompt cache, suffix store): "
                    "default a fresh one; an earlier run's to replay after a restart only (--runs restart)")
    go.add_argument("--out", type=Path, default=None, help="also write the tables (Markdown) here")
    go.add_argument("--llama-once", action="store_true", help="replay on llama-server once: it keeps nothing across "
                    "a restart, so its replay after one is its first session again (then the restart row compares "
                    "with that)")
    args = parser.parse_args()
    if args.command == "import":
        import_session(args.capture, args.name)
    else:
        run(args)


if __name__ == "__main__":
    main()
