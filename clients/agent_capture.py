"""Capture a coding agent's session for `benchmarks/bench_serve.py --workload replay`: the real agent CLI against a
scripted stub on 127.0.0.1.

    python clients/agent_capture.py claude --out captures/claude-code --import claude-code
    python clients/agent_capture.py codex --out captures/codex-catalog --import codex
    python clients/agent_capture.py count claude-code codex      # prompt tokens per turn (the default model's)

The agent (Claude Code's `claude -p`, Codex's `codex exec`; installed as `agents_e2e.py` installs it, or taken from
`--clients DIR`, e.g. a directory where `npm install @openai/codex @anthropic-ai/claude-code` was run) runs
`agents_e2e.py`'s task ("fix the bug in bug.py") in a scratch git repository, configured as `agents_e2e.py`
configures it, against a stub that costs no model time: its replies are scripted by how far the conversation has
got (the number of tool results in the request), the same on every run, so both servers of a replay later get
byte-identical prompts:

  turn 1: a tool call that reads the file (Claude Code's `Read`; Codex's `exec_command` / `shell` with `cat bug.py`)
  turn 2: a tool call that edits it (Claude Code's `Edit`; Codex's `apply_patch`, or a `sed -i` command)
  turn 3: a short final text.

A request with no tools (Claude Code's side requests: a quota probe, a title with a JSON schema) gets a short text
(an instance of the schema when one is asked). The stub speaks what the clients need: `POST /v1/messages` (streamed
as Anthropic's server-sent events or not; `count_tokens`; `HEAD /`) and `POST /v1/responses` (streamed as the
Responses API's events), `GET /v1/models`; anything else gets 404, and every request is logged.

`--out DIR` gets every request as DIR/all/NNN-METHOD-path.json (v1_messages) ({"path", "method", "headers", "body_json",
"reply"}: what the client sent, headers included, and what the stub answered), and the agent's conversation turns
(the requests that carry tools) as DIR/NNN-POST-path.json, the files
`benchmarks/bench_serve.py --workload replay import DIR` reads; `--import
NAME` imports them at once into ~/.cache/specdec/agent-sessions/NAME. Never commit a capture: Claude Code's system
prompt is Anthropic's. `count` prints each imported session's prompt tokens per turn through the served model's chat
template, as `specdec serve` would count them (the model's tokenizer only: no generation).
"""

from __future__ import annotations

import argparse
import http.server
import json
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_serve: the server helpers
import agents_e2e  # noqa: E402
import bench_serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FINAL = "Fixed: `add` in bug.py now returns `a + b`, so `test_bug.py` passes."
OLD, NEW = "    return a - b", "    return a + b"
PATCH = f"*** Begin Patch\n*** Update File: bug.py\n@@\n def add(a, b):\n-{OLD[1:]}\n+{NEW[1:]}\n*** End Patch\n"


# -- the script -------------------------------------------------------------------------------------------------------
def turn_of(path: str, body: dict) -> int:
    """How far the conversation has got: the number of tool results it carries (0 on the first turn)."""
    if path == "/v1/messages":
        return sum(
            1
            for m in body.get("messages") or ()
            if m.get("role") == "user" and isinstance(m.get("content"), list)
            for b in m["content"]
            if isinstance(b, dict) and b.get("type") == "tool_result"
        )
    return sum(
        1
        for item in body.get("input") or ()
        if isinstance(item, dict) and item.get("type") in ("function_call_output", "custom_tool_call_output")
    )


def tool_names(body: dict) -> dict[str, dict]:
    """The request's tools by name (Responses' custom tools too)."""
    names = {}
    for t in body.get("tools") or ():
        if isinstance(t, dict) and t.get("name"):
            names[t["name"]] = t
    return names


def example_of(schema: dict):
    """A small instance of a JSON schema (objects with their required properties, strings, numbers, arrays)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: example_of(props.get(k) or {}) for k in schema.get("required") or props}
    if kind == "array":
        return []
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return True
    return "Fix the bug in bug.py"


def claude_reply(body: dict, work: Path) -> list[dict]:
    """Content blocks of the scripted reply to one /v1/messages request."""
    tools = tool_names(body)
    fmt = (body.get("output_config") or {}).get("format") or body.get("output_format")
    if not tools:
        if fmt and fmt.get("schema"):
            return [{"type": "text", "text": json.dumps(example_of(fmt["schema"]))}]
        return [{"type": "text", "text": "OK"}]
    turn = turn_of("/v1/messages", body)
    target = str(work / "bug.py")
    if turn == 0 and "Read" in tools:
        return [
            {"type": "text", "text": "Let me read bug.py."},
            {"type": "tool_use", "id": f"toolu_{turn:02d}stub", "name": "Read", "input": {"file_path": target}},
        ]
    if turn == 1 and "Edit" in tools:
        return [
            {"type": "text", "text": "`add` subtracts; it must add."},
            {
                "type": "tool_use",
                "id": f"toolu_{turn:02d}stub",
                "name": "Edit",
                "input": {"file_path": target, "old_string": OLD, "new_string": NEW},
            },
        ]
    return [{"type": "text", "text": FINAL}]


def codex_reply(body: dict) -> list[dict]:
    """Output items of the scripted reply to one /v1/responses request."""
    tools = tool_names(body)
    turn = turn_of("/v1/responses", body)
    call_id = f"call_{turn:02d}stub"

    def command(cmd: str) -> dict:
        if "exec_command" in tools:
            return {
                "type": "function_call",
                "call_id": call_id,
                "name": "exec_command",
                "arguments": json.dumps({"cmd": cmd}),
            }
        return {
            "type": "function_call",
            "call_id": call_id,
            "name": "shell",
            "arguments": json.dumps({"command": ["bash", "-lc", cmd]}),
        }

    if tools and turn == 0:
        return [command("cat bug.py")]
    if tools and turn == 1:
        if "apply_patch" in tools and tools["apply_patch"].get("type") == "custom":
            return [{"type": "custom_tool_call", "call_id": call_id, "name": "apply_patch", "input": PATCH}]
        if "apply_patch" in tools:
            return [
                {
                    "type": "function_call",
                    "call_id": call_id,
                    "name": "apply_patch",
                    "arguments": json.dumps({"input": PATCH}),
                }
            ]
        return [command("sed -i 's/return a - b/return a + b/' bug.py")]
    return [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": FINAL, "annotations": []}]}
    ]


# -- the wire formats -------------------------------------------------------------------------------------------------
def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def rough_tokens(body: dict) -> int:
    return max(1, len(json.dumps(body)) // 4)


def messages_answer(body: dict, blocks: list[dict]) -> tuple[str, str]:
    """(content type, text) of a /v1/messages reply: a message JSON, or its server-sent events when streamed."""
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    usage = {
        "input_tokens": rough_tokens(body),
        "output_tokens": 16,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    message = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "stub"),
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }
    if not body.get("stream"):
        return "application/json", json.dumps(message)
    out = [
        sse(
            "message_start",
            {
                "type": "message_start",
                "message": {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}},
            },
        )
    ]
    for i, b in enumerate(blocks):
        if b["type"] == "text":
            out.append(
                sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}},
                )
            )
            out.append(
                sse(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": b["text"]}},
                )
            )
        else:
            out.append(
                sse(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}},
                    },
                )
            )
            out.append(
                sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"])},
                    },
                )
            )
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(
        sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 16},
            },
        )
    )
    out.append(sse("message_stop", {"type": "message_stop"}))
    return "text/event-stream", "".join(out)


def responses_answer(body: dict, items: list[dict]) -> tuple[str, str]:
    """(content type, text) of a /v1/responses reply: a response JSON, or its server-sent events when streamed."""
    turn = turn_of("/v1/responses", body)
    for i, item in enumerate(items):  # ids that are the same in every capture: Codex sends them back
        item.setdefault("id", f"{item['type'][:2]}_stub{turn:02d}{i}")
        item["status"] = "completed"
    n_in = rough_tokens(body)
    response = {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": body.get("model", "stub"),
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
    }
    done = {
        **response,
        "status": "completed",
        "output": items,
        "usage": {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 16,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + 16,
        },
    }
    if not body.get("stream"):
        return "application/json", json.dumps(done)
    seq = iter(range(1_000_000))
    out = [
        sse("response.created", {"type": "response.created", "sequence_number": next(seq), "response": response}),
        sse(
            "response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq), "response": response}
        ),
    ]
    for i, item in enumerate(items):
        start = {**item, "status": "in_progress"}
        if item["type"] == "message":
            start["content"] = []
        out.append(
            sse(
                "response.output_item.added",
                {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": i, "item": start},
            )
        )
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            common = {"item_id": item["id"], "output_index": i, "content_index": 0}
            out.append(
                sse(
                    "response.content_part.added",
                    {"type": "response.content_part.added", "sequence_number": next(seq), **common, "part": part},
                )
            )
            out.append(
                sse(
                    "response.output_text.delta",
                    {"type": "response.output_text.delta", "sequence_number": next(seq), **common, "delta": text},
                )
            )
            out.append(
                sse(
                    "response.output_text.done",
                    {"type": "response.output_text.done", "sequence_number": next(seq), **common, "text": text},
                )
            )
            out.append(
                sse(
                    "response.content_part.done",
                    {
                        "type": "response.content_part.done",
                        "sequence_number": next(seq),
                        **common,
                        "part": {**part, "text": text},
                    },
                )
            )
        out.append(
            sse(
                "response.output_item.done",
                {"type": "response.output_item.done", "sequence_number": next(seq), "output_index": i, "item": item},
            )
        )
    out.append(
        sse("response.completed", {"type": "response.completed", "sequence_number": next(seq), "response": done})
    )
    return "text/event-stream", "".join(out)


# -- the stub ---------------------------------------------------------------------------------------------------------
class Stub:
    """A loopback HTTP server that answers the agent with the script and writes every request to `out`."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        (out / "all").mkdir(parents=True, exist_ok=True)
        self.n = 0
        self.turns = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                status, ctype, text = stub.answer(self.command, self.path, body)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                stub.record(self.command, self.path, dict(self.headers.items()), body, raw, status, text)

            do_GET = do_POST = do_HEAD = do_DELETE = _answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, method: str, path: str, body) -> tuple[int, str, str]:
        bare = path.split("?")[0]
        if method == "HEAD":
            return 200, "text/plain", ""
        if method == "GET" and bare in ("/v1/models", "/models"):
            return (
                200,
                "application/json",
                json.dumps(
                    {"object": "list", "data": [{"id": "specdec", "object": "model", "created": 0, "owned_by": "stub"}]}
                ),
            )
        if method == "POST" and bare == "/v1/messages/count_tokens" and isinstance(body, dict):
            return 200, "application/json", json.dumps({"input_tokens": rough_tokens(body)})
        if method == "POST" and bare == "/v1/messages" and isinstance(body, dict):
            return 200, *messages_answer(body, claude_reply(body, self.work))
        if method == "POST" and bare == "/v1/responses" and isinstance(body, dict):
            return 200, *responses_answer(body, codex_reply(body))
        return 404, "application/json", json.dumps({"error": {"message": f"stub: no {method} {bare}"}})

    def record(self, method: str, path: str, headers: dict, body, raw: bytes, status: int, reply: str) -> None:
        bare = path.split("?")[0]
        slug = re.sub(r"[^A-Za-z0-9]+", "_", bare).strip("_") or "root"  # v1_messages, as the old recorder had it
        doc = {
            "path": path,
            "method": method,
            "headers": headers,
            "body_json": body,
            "body": None if body is not None else raw.decode("utf-8", "replace"),
            "status": status,
            "reply": reply,
        }
        with self.lock:
            self.n += 1
            (self.out / "all" / f"{self.n:03d}-{method}-{slug}.json").write_text(json.dumps(doc, indent=1))
            if (
                method == "POST"
                and bare in ("/v1/messages", "/v1/responses")
                and isinstance(body, dict)
                and body.get("tools")
            ):
                self.turns += 1
                (self.out / f"{self.turns:03d}-POST-{slug}.json").write_text(json.dumps(doc, indent=1))
        print(f"  {self.n:3d} {method} {path} -> {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- running an agent -------------------------------------------------------------------------------------------------
def capture(args) -> None:
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        if not (out / "all").is_dir():
            raise SystemExit(f"{out} is not empty and not a capture directory: give a new one")
        shutil.rmtree(out)  # an earlier capture: made again
    out.mkdir(parents=True)
    root = args.work / args.agent  # a fixed path: the agents' prompts name it, so a capture made again is the same
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    work = agents_e2e.scratch(root, args.agent)
    stub = Stub(out, work)
    exe = agents_e2e.npm_bin(args.agent, args.clients)
    print(f"{args.agent}: {exe} in {work} against the stub at {stub.url}", file=sys.stderr, flush=True)
    try:
        if args.agent == "claude":
            cmd, env = agents_e2e.claude_command(exe, stub.url, root, work, args.timeout)
        else:
            cmd, env = agents_e2e.codex_command(exe, stub.url, root, args.timeout, args.codex_metadata, ctx=32768)
        transcript = root / f"{args.agent}-transcript.jsonl"
        result = agents_e2e.run_agent(
            args.agent,
            cmd,
            work,
            env,
            transcript,
            args.timeout,
            agents_e2e.claude_summary if args.agent == "claude" else agents_e2e.codex_summary,
        )
    finally:
        stub.close()
    print(result.note)
    print(
        f"{args.agent}: exit {result.exit_code} in {result.seconds:.0f} s; bug.py "
        f"{'fixed' if result.passed else 'changed' if result.changed else 'unchanged'}; {stub.n} requests, "
        f"{stub.turns} conversation turns in {out}; transcript {transcript}"
    )
    if stub.turns < 3:
        raise SystemExit(f"only {stub.turns} turns captured (see {out / 'all'})")
    if args.import_name:
        bench_serve.import_session(out, args.import_name)


# -- counting ---------------------------------------------------------------------------------------------------------
def count(args) -> None:
    """Each session's prompt tokens per turn, through the served model's chat template (no generation)."""
    sys.path.insert(0, str(ROOT))
    from specdec_cli.server import anthropic_messages, openai_responses  # noqa: PLC0415
    from specdec_cli.server.http import Context  # noqa: PLC0415
    from specdec_cli.server.request import Defaults  # noqa: PLC0415
    from specdec_cli.server.service import GenerationService  # noqa: PLC0415
    from specdec_cli.server.worker import Worker  # noqa: PLC0415
    from specdec_cli.session import open_session  # noqa: PLC0415
    from specdec_cli.spec import ModelOptions, SpecOptions  # noqa: PLC0415

    spec = SpecOptions(method="none")
    session = open_session(ModelOptions(target=args.target, ctx=args.ctx, prompt_cache=False), method=spec.method)
    try:
        ctx = Context(Worker(GenerationService(session, spec)), Defaults(), auth=[])
        store = openai_responses.ResponseStore()
        for name in args.sessions:
            counts = []
            for f in sorted((bench_serve.SESSIONS / name).glob("*.json")):
                doc = json.loads(f.read_text())
                if doc["path"] == "/v1/messages":
                    request = anthropic_messages.to_request(
                        anthropic_messages.MessagesRequest.model_validate(doc["body"]), ctx
                    )
                else:
                    request = openai_responses.to_request(
                        openai_responses.ResponsesRequest.model_validate(doc["body"]), ctx, store
                    ).request
                counts.append(len(ctx.worker.service.prompt_tokens(request)))
            print(
                f"{name}: {len(counts)} turns, prompt tokens {', '.join(f'{n:,}' for n in counts)} "
                f"({session.target_path.name})"
            )
    finally:
        session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for agent in ("claude", "codex"):
        p = sub.add_parser(agent, help=f"capture a {agent} session against the scripted stub")
        p.set_defaults(agent=agent)
        p.add_argument(
            "--out", type=Path, required=True, help="the capture directory (new, or an earlier capture's: replaced)"
        )
        p.add_argument("--import", dest="import_name", default=None, help="then import it as this session name")
        p.add_argument(
            "--clients",
            type=Path,
            default=None,
            help="a directory with node_modules/.bin/claude and codex (default: agents_e2e's npm install)",
        )
        p.add_argument("--timeout", type=int, default=300, help="seconds for the agent's whole session")
        p.add_argument(
            "--work",
            type=Path,
            default=Path(tempfile.gettempdir()) / "specdec-capture",
            help="the scratch repository, the agent's HOME and its transcript go under WORK/AGENT",
        )
        if agent == "codex":
            p.add_argument("--codex-metadata", choices=["catalog", "fallback"], default="catalog")
    c = sub.add_parser("count", help="prompt tokens per turn of imported sessions (no generation)")
    c.add_argument("sessions", nargs="+")
    c.add_argument("-t", "--target", default=None)
    c.add_argument("--ctx", type=int, default=32768)
    args = parser.parse_args()
    if args.command == "count":
        count(args)
    else:
        capture(args)


if __name__ == "__main__":
    main()
