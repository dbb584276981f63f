"""Load and faults against a real `specdec serve` (issue 35): many clients, the faults a long-running local server
meets, then kill -9 during a save and a restart. Loopback only, bounded in count and time, stops by itself.

For `--duration` seconds, `--clients` threads send requests one after another, each drawn (seeded) from: Chat
Completions, Responses or Messages; streamed or not; plain, with a tool, or with a JSON schema. 20 % of the streams
are dropped after their first events, 10 % of the requests carry a long prompt and are dropped during its prefill.
Meanwhile: `--slowloris` connections send a request's headers a byte every 2 s; every 5 s a forged `Host`, a
cross-origin preflight, an oversized body, a body nested 100,000 deep and a tool call whose arguments are nested
too deep are sent (each must be refused: 403, 403, 413, 400, 400); `/health` is asked every 0.25 s by a process of
its own. The load's long prompts wait in the queue, so they are dropped before they run: after the load, with the
server otherwise idle, `--prefill-drops` long prompts are each given up 0.5-4 s into their running prefill.

Then the server answers one more request and is killed (SIGKILL) as soon as a save of what it learnt is under way
(the save that request made due, while the server is idle: a temporary file appears next to its stores; after two
save intervals without one, it is killed anyway), started again on the same data, asked
one request, and stopped (SIGTERM). Printed: a table of statuses per kind of request, the 5xx and crashes (target
0), the worker time after a disconnect (from the server's log: "stopped X s after the client left"; target: at most
one prefill chunk: the log's "its prefill's chunks took Y s at most"), the queue wait (p50/p99, from the log's
"queued X s"), /health's latency (target < 100 ms), the saves seen during the load (the longest time without one;
target: one save interval plus one request), the learnt state's age at the kill, the learning the kill lost (seconds of
answers after the last save; target <= one save interval), and the files after the restart (target: none corrupt, no
temporaries).

    python benchmarks/load_faults.py                                   # the full run: default model, 3 minutes
    python benchmarks/load_faults.py -t smollm2-135m --duration 45 --clients 6 --slowloris 10 --save-interval 10
                                                                       # a smoke run, ~1 minute

Needs `pip install 'specdec-cli[serve]'`; uses only the standard library as a client.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = {200, 400, 401, 403, 404, 408, 413, 429}  # what a request may get while the server runs
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LONG_TEXT = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(150))


# -- the server -------------------------------------------------------------------------------------------------------
class Server:
    """`specdec serve` on a free loopback port, its stderr collected by a thread."""

    def __init__(self, args, home: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "specdec_cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--save-interval",
            str(args.save_interval),
            "--timeout",
            str(args.timeout),
            "--queue",
            str(args.queue),
            "--max-tokens",
            str(args.max_tokens),
        ]
        for flag, value in (("-t", args.model), ("--ctx", args.ctx), ("--threads", args.threads)):
            if value is not None:
                cmd += [flag, str(value)]
        env = {
            **os.environ,
            "SPECDEC_HOME": str(home),
            "SPECDEC_PROMPT_CACHE": str(home / "prompts"),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        env.pop("SPECDEC_SERVE_KEY", None)
        if not args.measure_curve:  # minutes on a busy machine, and not what this run measures
            env["SPECDEC_VERIFY_CURVE"] = "off"
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        started = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
                if m and self.url is None:
                    self.url = m.group(0)
                    self.port = int(m.group(1))
                    started.set()
            started.set()

        threading.Thread(target=read, daemon=True).start()
        if not started.wait(900) or self.url is None:
            self.proc.kill()
            raise SystemExit("specdec serve did not start:\n" + "\n".join(self.lines[-30:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


# -- requests ----------------------------------------------------------------------------------------------------------
def body_of(api: str, shape: str, stream: bool, content: str, max_tokens: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of `api` ("chat", "responses", "messages") and `shape` ("plain", "tool",
    "schema")."""
    if api == "responses":
        body = {"model": "x", "input": content, "max_output_tokens": max_tokens, "stream": stream}
        if shape == "tool":
            body["tools"] = [{"type": "function", "name": "get_weather", "parameters": TOOL_PARAMS}]
        elif shape == "schema":
            body["text"] = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}}
        return "/v1/responses", body
    body = {  # chat's and messages' alike
        "model": "x",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if api == "chat":
        if shape == "tool":
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "description": "The weather.", "parameters": TOOL_PARAMS},
                }
            ]
        elif shape == "schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
        return "/v1/chat/completions", body
    if shape == "tool":
        body["tools"] = [{"name": "get_weather", "description": "The weather.", "input_schema": TOOL_PARAMS}]
    elif shape == "schema":
        body["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    return "/v1/messages", body


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_kind: dict[str, Counter] = defaultdict(Counter)
        self.errors: list[str] = []
        self.disconnects: list[float] = []  # client-side times of disconnects (monotonic)
        self.last_answer = float("nan")  # time.time() of the last whole 200 answer (what the server learnt from)

    def add(self, kind: str, status: int | str) -> None:
        with self.lock:
            self.by_kind[kind][status] += 1

    def error(self, text: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(text)


def one_request(port: int, rng: random.Random, tally: Tally, max_tokens: int, timeout: float) -> float:
    """Send one drawn request; returns seconds to wait before the next (a 429's Retry-After)."""
    api = rng.choice(["chat", "responses", "messages"])
    shape = rng.choice(["plain", "plain", "tool", "schema"])
    stream = rng.random() < 0.5
    long_drop = rng.random() < 0.10
    stream_drop = stream and not long_drop and rng.random() < 0.20
    content = (
        (LONG_TEXT + "\nSummarise.")
        if long_drop
        else rng.choice(["Say hello.", "What is 2 + 2?", "Plan a trip to Paris.", "Weather in Oslo?"])
    )
    path, body = body_of(api, shape, stream, content, max_tokens)
    kind = (
        f"{api}{' stream' if stream else ''} {shape}"
        + (" (dropped in prefill)" if long_drop else "")
        + (" (dropped mid-stream)" if stream_drop else "")
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        if long_drop:  # give up during the long prompt's prefill
            time.sleep(rng.uniform(0.2, 1.5))
            tally.disconnects.append(time.monotonic())
            conn.close()
            tally.add(kind, "dropped")
            return 0.0
        resp = conn.getresponse()
        status = resp.status
        if stream_drop and status == 200:
            for _ in range(3):
                resp.readline()
            conn.close()
            tally.add(kind, "dropped")
            return 0.0
        data = resp.read()
        tally.add(kind, status)
        if status == 200:
            tally.last_answer = time.time()
        if status >= 500 or status not in DOCUMENTED:
            tally.error(f"{kind}: {status} {data[:300]!r}")
        if status == 429:
            return min(float(resp.getheader("Retry-After") or 1), 5.0)
        if status == 200 and stream and b"error" in data[-400:] and b"event: error" in data[-400:]:
            tally.error(f"{kind}: an error event at the end of the stream: {data[-300:]!r}")
        return 0.0
    except (OSError, http.client.HTTPException) as e:
        tally.add(kind, type(e).__name__)
        tally.error(f"{kind}: {type(e).__name__}: {e}")
        return 1.0
    finally:
        conn.close()


def client_loop(port: int, seed: int, until: float, tally: Tally, args) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        wait = one_request(port, rng, tally, args.max_tokens, args.request_timeout)
        time.sleep(wait)


def raw_status(port: int, method: str, path: str, body: bytes | None, headers: dict) -> int | str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def oversized_status(port: int) -> int | str:
    """The status of a request announcing a 100 MB body (its headers only: the server answers before the body)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000000\r\n\r\n" + b"x" * 65536
            )
            head = s.recv(64)
        return int(head.split()[1])
    except (OSError, ValueError, IndexError) as e:
        return type(e).__name__


def faults_loop(port: int, until: float, tally: Tally) -> None:
    """Every 5 s: the requests that must be refused, each with its expected status."""
    json_headers = {"Content-Type": "application/json"}
    deep_args = "[" * 60_000 + "]" * 60_000
    while time.monotonic() < until:
        checks = {
            "forged Host (403)": (
                raw_status(port, "POST", "/v1/chat/completions", b"{}", {**json_headers, "Host": "evil.example"}),
                403,
            ),
            "cross-origin preflight (403)": (
                raw_status(
                    port,
                    "OPTIONS",
                    "/v1/chat/completions",
                    None,
                    {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
                ),
                403,
            ),
            "oversized body (413)": (oversized_status(port), 413),
            "body nested 100,000 deep (400)": (
                raw_status(port, "POST", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, json_headers),
                400,
            ),
            "arguments nested too deep (400)": (
                raw_status(
                    port,
                    "POST",
                    "/v1/chat/completions",
                    json.dumps(
                        {
                            "model": "x",
                            "messages": [
                                {"role": "user", "content": "hi"},
                                {
                                    "role": "assistant",
                                    "content": None,
                                    "tool_calls": [
                                        {
                                            "id": "c",
                                            "type": "function",
                                            "function": {"name": "f", "arguments": deep_args},
                                        }
                                    ],
                                },
                                {"role": "tool", "tool_call_id": "c", "content": "ok"},
                            ],
                        }
                    ).encode(),
                    json_headers,
                ),
                400,
            ),
        }
        for kind, (status, want) in checks.items():
            tally.add(kind, status)
            if status != want:
                tally.error(f"{kind}: got {status}")
        time.sleep(5)


def slowloris(port: int, n: int, until: float, closed: list[int]) -> None:
    """`n` connections sending a request's headers a byte every 2 s; counts those the server closed."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            closed[0] += 1
    i = 0
    while time.monotonic() < until and socks:
        for s in list(socks):
            try:
                s.sendall(head[i % len(head) : i % len(head) + 1])
                s.setblocking(False)
                try:
                    if s.recv(1024) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            except OSError:
                closed[0] += 1
                socks.remove(s)
                s.close()
        i += 1
        time.sleep(2)
    for s in socks:
        s.close()


HEALTH_PROBE = """
import http.client, json, sys, time
port, out = int(sys.argv[1]), []
while True:
    t0, status = time.perf_counter(), None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/health")
        r = c.getresponse(); r.read(); status = r.status
    except (OSError, http.client.HTTPException) as e:
        status = type(e).__name__
    out.append([time.time(), (time.perf_counter() - t0) * 1e3, status])
    c.close()
    if sys.stdin in __import__("select").select([sys.stdin], [], [], 0.25)[0]:
        break
print(json.dumps(out))
"""


class HealthProbe:
    """/health asked every 0.25 s from a process of its own (so the load's 80-odd client threads, sharing one GIL,
    do not delay the measuring): `stop()` returns [(time.time(), ms, status)]."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HEALTH_PROBE, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> list[tuple[float, float, int | str]]:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        return [tuple(x) for x in json.loads(out)]


def running(port: int) -> dict | None:
    """/health's running request ({"id", "kind", "age_s", "tokens"}) or None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read()).get("queue", {}).get("running")
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def drop_in_prefill(port: int, rng: random.Random, tally: Tally, n: int, wait_s: float = 120.0) -> None:
    """`n` times, with the server otherwise idle: a long prompt (a nonce first, so no cached prefix shortens it),
    given up once /health shows it running with no output yet, 0.5-4 s into its prefill; then wait for the worker
    to be free. The server's log says how long it went on ("stopped X s after the client left; its prefill's chunks
    took Y s at most")."""
    for _ in range(n):
        deadline = time.monotonic() + wait_s
        while running(port) is not None and time.monotonic() < deadline:  # the load's last request
            time.sleep(0.2)
        _, body = body_of("chat", "plain", False, f"Session {rng.randrange(10**9)}.\n" + LONG_TEXT + "\nSummarise.", 48)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        kind = "chat plain (dropped during its running prefill)"
        try:
            conn.request(
                "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            seen = None
            while time.monotonic() < deadline and not seen:  # until it runs (a fast model may finish its prefill first)
                time.sleep(0.1)
                seen = running(port)
            if seen is None or seen.get("tokens") != 0:
                tally.add(kind, "not seen in its prefill")
                continue
            time.sleep(rng.uniform(0.5, 4.0))
            tally.add(kind, "dropped")
        finally:
            conn.close()
    deadline = time.monotonic() + wait_s
    while running(port) is not None and time.monotonic() < deadline:
        time.sleep(0.2)


# -- the kill and the restart ----------------------------------------------------------------------------------------
def store_files(home: Path) -> list[Path]:
    return [
        p
        for p in home.rglob("*")
        if p.is_file()
        and "prompts" not in p.parts
        and not p.name.endswith(".lock")
        and ".tmp-" not in p.name
        and ".corrupt-" not in p.name
    ]


def watch_saves(home: Path, done: threading.Event, saves: list[float]) -> None:
    """Until `done`: every 0.25 s, the stores' newest modification time; each new one is a save (time.time())."""
    last = 0.0
    while not done.is_set():
        newest = max((p.stat().st_mtime for p in store_files(home) if p.exists()), default=0.0)
        if newest > last:
            saves.append(newest)
            last = newest
        time.sleep(0.25)


def kill_during_save(server: Server, home: Path, wait: float) -> tuple[bool, float]:
    """SIGKILL the server as soon as a temporary file appears among its stores (a save under way), or after `wait`
    seconds; returns (caught during a save, the kill's time.time())."""
    deadline = time.monotonic() + wait
    caught = False
    while time.monotonic() < deadline:
        if any(".tmp-" in p.name for p in home.rglob(".*")):
            caught = True
            break
        time.sleep(0.002)
    server.kill()
    return caught, time.time()


def check_files(home: Path) -> dict:
    """After the restart: corrupt files set aside, temporaries left, learnt.json parses, the suffix store reads."""
    from specdec_cli.stores.suffix_store import read_store

    out = {
        "corrupt set aside": [p.name for p in home.rglob("*.corrupt-*")],
        "temporaries": [p.name for p in home.rglob(".*.tmp-*")],
        "unreadable": [],
    }
    for p in store_files(home):
        if p.name == "learnt.json":
            try:
                json.loads(p.read_text())
            except ValueError as e:
                out["unreadable"].append(f"{p.name}: {e}")
        elif p.parent.name == "suffix" and not p.name.startswith("."):
            try:
                read_store(p)
            except Exception as e:  # noqa: BLE001 (any failure is what we look for)
                out["unreadable"].append(f"{p.name}: {type(e).__name__}: {e}")
    return out


# -- the report -------------------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--model", help="target model (default: specdec serve's default)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    ap.add_argument("--slowloris", type=int, default=50, help="slow connections (default 50)")
    ap.add_argument("--save-interval", type=float, default=30.0, help="the server's --save-interval (default 30 s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="the server's --timeout (default 300 s)")
    ap.add_argument("--queue", type=int, default=16, help="the server's --queue (default 16)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (default 48)")
    ap.add_argument("--ctx", type=int, help="the server's --ctx")
    ap.add_argument("--threads", type=int, help="the server's --threads")
    ap.add_argument(
        "--prefill-drops",
        type=int,
        default=3,
        help="after the load, requests given up during their "
        "running prefill, one at a time (default 3; the load's own are dropped while queued)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--measure-curve",
        action="store_true",
        help="let the server measure its verify curve at start "
        "(the fresh SPECDEC_HOME has none; off by default: minutes, and not what this run measures)",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0, help="a client's socket timeout (default 600 s)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    home = Path(tempfile.mkdtemp(prefix="specdec-load-faults-"))
    print(f"SPECDEC_HOME={home}; starting specdec serve ...", file=sys.stderr)
    server = Server(args, home)
    port = server.port
    print(f"serving at {server.url}; {args.clients} clients for {args.duration:g} s", file=sys.stderr)

    tally = Tally()
    closed = [0]
    probe = HealthProbe(port)  # /health is asked until the kill
    saves: list[float] = []  # the stores' save times (time.time()), seen from outside
    watch_done = threading.Event()
    watcher = threading.Thread(target=watch_saves, args=(home, watch_done, saves), daemon=True)
    watcher.start()
    load_start = time.time()
    t_start = time.monotonic()
    until = t_start + args.duration
    threads = [
        threading.Thread(target=client_loop, args=(port, args.seed * 1000 + i, until, tally, args), daemon=True)
        for i in range(args.clients)
    ]
    threads += [
        threading.Thread(target=faults_loop, args=(port, until, tally), daemon=True),
        threading.Thread(target=slowloris, args=(port, args.slowloris, until, closed), daemon=True),
    ]
    for t in threads:
        t.start()
    hard_stop = until + min(args.request_timeout, args.timeout) + 60  # the run stops by itself
    for t in threads[: args.clients + 2]:
        t.join(max(0.0, hard_stop - time.monotonic()))
    stragglers = sum(t.is_alive() for t in threads[: args.clients])
    load_end = time.time()  # the clients' last requests answered (the queue drained)
    if server.proc.poll() is None and args.prefill_drops:  # the load's long prompts were dropped while queued
        print(f"{args.prefill_drops} drops during a running prefill ...", file=sys.stderr)
        drop_in_prefill(port, random.Random(args.seed), tally, args.prefill_drops)
    crashed = server.proc.poll() is not None

    # kill -9 during a save, then a restart on the same data
    health = probe.stop()
    latencies = [ms for _, ms, _ in health]
    health_failures = [str(status) for _, _, status in health if status != 200]
    slowest = sorted(health, key=lambda h: -h[1])[:3]
    if not crashed:  # one more answer, so a save falls due while the server is idle: the kill lands in it
        if (
            raw_status(
                port,
                "POST",
                "/v1/chat/completions",
                json.dumps(
                    {"model": "x", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
                ).encode(),
                {"Content-Type": "application/json"},
            )
            == 200
        ):
            tally.last_answer = time.time()
    caught, killed_at = (False, time.time()) if crashed else kill_during_save(server, home, 2 * args.save_interval)
    saved = [p.stat().st_mtime for p in store_files(home)]
    last_save = max(saved) if saved else float("nan")
    age = killed_at - last_save
    lost = max(0.0, tally.last_answer - last_save)  # seconds of answers whose learning the kill lost
    watch_done.set()
    watcher.join(5)
    during = [t for t in saves if load_start <= t <= load_end]
    gaps = [b - a for a, b in zip([load_start, *during], [*during, min(load_end, killed_at)], strict=True)]
    restarted = Server(args, home)
    after = raw_status(
        restarted.port,
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": "x", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}).encode(),
        {"Content-Type": "application/json"},
    )
    code = restarted.stop()
    files = check_files(home)

    # the server's log
    lines = server.lines + restarted.lines
    stop_after = [
        float(m.group(1)) for line in lines for m in [re.search(r"stopped ([\d.]+) s after the client", line)] if m
    ]
    in_prefill = [
        (float(m.group(1)), float(m.group(2)))
        for line in lines
        for m in [re.search(r"stopped ([\d.]+) s after the client left; its prefill's chunks took ([\d.]+) s", line)]
        if m
    ]
    queued = [float(m.group(1)) for line in lines for m in [re.search(r"queued ([\d.]+) s", line)] if m]
    logged = sum(1 for line in lines if re.match(r"#\d+ ", line))
    fives = sum(
        n
        for kinds in tally.by_kind.values()
        for status, n in kinds.items()
        if isinstance(status, int) and status >= 500
    )

    print(f"\n{'request':55} statuses")
    for kind in sorted(tally.by_kind):
        print(f"{kind:55} {', '.join(f'{s}: {n}' for s, n in sorted(tally.by_kind[kind].items(), key=str))}")
    print()
    rows = [
        ("5xx answers (target 0)", str(fives)),
        ("server crashed during the load (target no)", "yes" if crashed else "no"),
        ("clients still waiting at the hard stop", str(stragglers)),
        ("slowloris connections closed by the server", f"{closed[0]} of {args.slowloris}"),
        (
            "worker time after a disconnect, max / p99 (s)",
            f"{max(stop_after):.2f} / {pct(stop_after, 0.99):.2f} ({len(stop_after)} disconnects seen)"
            if stop_after
            else "none seen",
        ),
        (
            "... of those during a running prefill: worker time / its longest chunk (s) (target <= 1 chunk)",
            ", ".join(f"{a:.2f} / {c:.2f}" for a, c in in_prefill) if in_prefill else "none seen",
        ),
        ("queue wait p50 / p99 (s)", f"{pct(queued, 0.5):.2f} / {pct(queued, 0.99):.2f}" if queued else "none"),
        (
            "/health latency p50 / p99 / max (ms) (target < 100)",
            f"{pct(latencies, 0.5):.1f} / {pct(latencies, 0.99):.1f} / {max(latencies):.1f}" if latencies else "none",
        ),
        (
            "/health's slowest answers (ms, s into the run, nearest save s)",
            "; ".join(
                f"{ms:.0f} at {t - load_start:.0f} s ({min((abs(t - v) for v in saves), default=float('nan')):.1f})"
                for t, ms, _ in slowest
            ),
        ),
        ("/health failures (target 0)", f"{len(health_failures)} {sorted(set(health_failures))}"),
        ("kill -9 caught a save under way", "yes" if caught else "no (killed after waiting)"),
        (
            "saves during the load; longest time without one (s)",
            f"{len(during)}; {max(gaps):.1f} (target <= interval {args.save_interval:g} + one request)",
        ),
        ("learnt state's age at the kill (s): since the last save", f"{age:.1f} (interval {args.save_interval:g})"),
        (
            "learning lost by the kill (s of answers after the last save)",
            f"{lost:.1f} (target <= interval {args.save_interval:g})",
        ),
        (
            "files after the restart: corrupt / temporaries / unreadable",
            f"{len(files['corrupt set aside'])} / {len(files['temporaries'])} / {len(files['unreadable'])}",
        ),
        ("request after the restart", str(after)),
        ("restarted server's exit code (SIGTERM)", str(code)),
    ]
    rows.append(("requests the server logged", str(logged)))
    for name, value in rows:
        print(f"{name:62} {value}")
    if tally.errors:
        print("\nfirst errors:")
        for e in tally.errors[:20]:
            print("  " + e)
    if files["unreadable"] or files["corrupt set aside"]:
        print("files:", json.dumps(files, indent=1))
    print(f"\n(data kept in {home})")


if __name__ == "__main__":
    main()
