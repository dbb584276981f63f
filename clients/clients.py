"""Real clients against a real `specdec serve` in one sitting (issue 27): PASS/FAIL per client with seconds.

Starts one `specdec serve` (Qwen2.5-Coder-1.5B by default, fresh SPECDEC_HOME, loopback) behind a recording proxy
(every request and reply kept), runs each client in its own process from its own virtual environment (created from
PyPI on first use: the clients pin different `openai` releases), and prints one line per client. Then two checks over
everything the proxy saw: no reply ended with `finish_reason: "length"` (a loop, a reply that does not end), and every
tool call returned has `arguments` that parse as JSON. Exits 1 when anything failed.

Clients: aider (whole-file edit), llm (plain, --schema), LangChain (invoke, stream, bind_tools,
with_structured_output with a Pydantic model and a TypedDict, method json_schema; a two-turn tool loop whose messages
carry `name`), smolagents ToolCallingAgent, instructor (TOOLS, JSON_SCHEMA), openai's chat.completions.parse,
pydantic-ai (NativeOutput; its default tool output, under 10 s; an agent with one plain tool), openai-agents
(OpenAIChatCompletionsModel and a function tool, at most 3 turns).

    python clients/clients.py                                # Qwen2.5-Coder-1.5B, the default method
    python clients/clients.py --venvs ~/.cache/specdec/bench-clients --only langchain
    python clients/clients.py --url http://127.0.0.1:8000/v1  # a server already running (no proxy checks)

Venvs (`--venvs DIR`): DIR/clients (openai-agents, pydantic-ai-slim[openai], langchain-openai, smolagents, llm,
instructor) and DIR/aider (aider-chat); an existing one is reused as it is.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
VENVS = {
    "clients": ["openai-agents", "pydantic-ai-slim[openai]", "langchain-openai", "smolagents", "llm", "instructor"],
    "aider": ["aider-chat"],
}
MODEL = "specdec"


# -- the scenarios: each runs in a client venv (`python clients.py --run NAME --url URL`), prints what it got -------
def weather_tool_fn(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny, 22 degrees Celsius in {city}."


def run_langchain(url: str, part: str) -> str:
    from typing import Annotated

    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field
    from typing_extensions import TypedDict  # pydantic wants it before Python 3.12

    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", timeout=600, max_retries=0)

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather_tool_fn(city)

    if part == "invoke":
        out = llm.invoke([HumanMessage("Say hello in one short sentence.", name="alice")]).content
        assert out.strip(), out
        return out
    if part == "stream":
        out = "".join(c.content for c in llm.stream("Count from 1 to 5, separated by spaces."))
        assert "3" in out, out
        return out
    if part == "bind_tools":
        msg = llm.bind_tools([get_weather]).invoke("What is the weather in Paris? Use the tool.")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
        return repr(msg.tool_calls)
    if part == "structured_pydantic":

        class Person(BaseModel):
            """A person mentioned in the text."""

            name: str = Field(description="The person's name")
            age: int = Field(description="Age in years")

        p = llm.with_structured_output(Person, method="json_schema").invoke(
            [SystemMessage("Extract the person."), HumanMessage("Bob is 42 years old.", name="alice")]
        )
        assert p.name == "Bob" and p.age == 42, p
        return repr(p)
    if part == "structured_typeddict":

        class PersonT(TypedDict):
            """A person mentioned in the text."""

            name: Annotated[str, ..., "The person's name"]
            age: Annotated[int, ..., "Age in years"]

        p = llm.with_structured_output(PersonT, method="json_schema").invoke(
            [SystemMessage("Extract the person."), HumanMessage("Bob is 42 years old.", name="alice")]
        )
        assert p["name"] == "Bob" and p["age"] == 42, p
        return repr(p)
    if part == "tool_loop_named":
        bound = llm.bind_tools([get_weather])
        messages = [
            SystemMessage(
                "You are a helpful assistant. Use tools for live data; answer in one sentence once you have the result."
            ),
            HumanMessage("What is the weather in Paris right now?", name="alice"),
        ]
        first = bound.invoke(messages)
        assert first.tool_calls, first
        messages.append(first)
        for call in first.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"], name=call["name"]))
        second = bound.invoke(messages)
        assert second.content and not second.tool_calls, second
        return second.content
    raise SystemExit(f"unknown langchain part {part}")


def run_smolagents(url: str) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name.
        """
        return weather_tool_fn(city)

    model = OpenAIServerModel(model_id=MODEL, api_base=url, api_key="unused")
    out = ToolCallingAgent(tools=[get_weather], model=model, max_steps=4, verbosity_level=0).run(
        "What is the weather in Paris?"
    )
    assert "22" in str(out) or "unny" in str(out), out
    return str(out)


def run_instructor(url: str, mode: str) -> str:
    import instructor
    import openai
    from pydantic import BaseModel

    class User(BaseModel):
        name: str
        age: int

    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key="unused", timeout=600), mode=getattr(instructor.Mode, mode)
    )
    user = client.chat.completions.create(
        model=MODEL,
        response_model=User,
        max_retries=0,
        messages=[{"role": "user", "content": "Extract the user: Jason is 25 years old and lives in Lyon."}],
    )
    assert user.age == 25 and "Jason" in user.name, user
    return repr(user)


def run_parse(url: str) -> str:
    import openai
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
    done = client.chat.completions.parse(
        model=MODEL,
        response_format=City,
        messages=[
            {"role": "user", "content": "Which city is the capital of France? Answer with the city and its country."}
        ],
    )
    city = done.choices[0].message.parsed
    assert city is not None and "Paris" in city.name, done
    return repr(city)


def run_pydantic_ai(url: str, part: str) -> str:
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class City(BaseModel):
        """A city."""

        name: str = Field(description="City name")
        country: str

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url, api_key="unused"))
    if part == "tool":  # an agent with one plain tool: it must call it and answer with its result
        calls: list[str] = []
        agent = Agent(
            model,
            instructions="You are a helpful assistant. Call a tool when you need data; once a tool's "
            "result is in the conversation, answer the user's question with it in one sentence.",
        )

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            calls.append(city)
            return weather_tool_fn(city)

        answer = agent.run_sync("What is the weather in Paris right now?", model_settings={"max_tokens": 80}).output
        assert calls and "Paris" in calls[0], f"the tool was not called (calls: {calls}); output: {answer!r}"
        assert "22" in answer, f"the answer does not use the tool's result: {answer!r}"
        return f"get_weather({calls[0]!r}) -> {answer!r}"
    output = NativeOutput(City) if part == "native" else City
    t0 = time.monotonic()
    result = Agent(model, output_type=output, instructions="Answer about cities.").run_sync(
        "Which city is the capital of France?"
    )
    took = time.monotonic() - t0
    city = result.output
    assert "Paris" in city.name, city
    if part == "tool_output":
        assert took < 10, f"took {took:.1f} s (over 10 s): {city!r}"
    return f"{city!r} in {took:.1f} s"


def run_agents(url: str) -> str:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return weather_tool_fn(city)

    client = AsyncOpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
    agent = Agent(
        name="Assistant",
        instructions="You are a helpful assistant.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert calls and result.final_output, (calls, result.final_output)
    return f"{result.final_output!r} (tool called for {calls})"


SCENARIOS = {  # name -> (venv, function and args)
    "langchain invoke": ("clients", run_langchain, "invoke"),
    "langchain stream": ("clients", run_langchain, "stream"),
    "langchain bind_tools": ("clients", run_langchain, "bind_tools"),
    "langchain structured Pydantic": ("clients", run_langchain, "structured_pydantic"),
    "langchain structured TypedDict": ("clients", run_langchain, "structured_typeddict"),
    "langchain tool loop with names": ("clients", run_langchain, "tool_loop_named"),
    "smolagents ToolCallingAgent": ("clients", run_smolagents),
    "instructor TOOLS": ("clients", run_instructor, "TOOLS"),
    "instructor JSON_SCHEMA": ("clients", run_instructor, "JSON_SCHEMA"),
    "openai chat.completions.parse": ("clients", run_parse),
    "pydantic-ai NativeOutput": ("clients", run_pydantic_ai, "native"),
    "pydantic-ai tool output (<10 s)": ("clients", run_pydantic_ai, "tool_output"),
    "pydantic-ai agent, one tool": ("clients", run_pydantic_ai, "tool"),
    "openai-agents chat model + tool": ("clients", run_agents),
    "llm plain": ("clients", None),
    "llm --schema": ("clients", None),
    "aider whole-file edit": ("aider", None),
}


# -- command-line clients ---------------------------------------------------------------------------------------------
def run_llm(python: Path, url: str, schema: bool) -> str:
    home = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    (home / "extra-openai-models.yaml").write_text(
        f'- model_id: {MODEL}\n  model_name: {MODEL}\n  api_base: "{url}"\n  supports_schema: true\n'
        "  supports_tools: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}
    llm = python.parent / "llm"
    cmd = [str(llm), "-m", MODEL] + (
        ["--schema", "name, age int", "Bob is 42 years old."] if schema else ["Say hello in one short sentence."]
    )
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode:
        raise AssertionError(out.stderr.strip()[-400:])
    if schema:
        obj = json.loads(out.stdout)
        assert obj == {"name": "Bob", "age": 42}, obj
    else:
        assert out.stdout.strip(), out
    return out.stdout.strip()[:200]


BUG = "def average(xs):\n    return sum(xs) / len(xs) + 1\n"


def run_aider(python: Path, url: str) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-aider-"))
    (work / "avg.py").write_text(BUG)
    env = {**os.environ, "HOME": str(work / "home"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [
        str(python.parent / "aider"),
        "--model",
        f"openai/{MODEL}",
        "--openai-api-base",
        url,
        "--openai-api-key",
        "unused",
        "--yes",
        "--no-git",
        "--no-check-update",
        "--analytics-disable",
        "--no-show-release-notes",
        "--no-show-model-warnings",
        "--no-pretty",
        "--edit-format",
        "whole",
        "--message",
        "Fix the bug in avg.py: average must not add 1.",
        "avg.py",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=900, stdin=subprocess.DEVNULL)
    fixed = (work / "avg.py").read_text()
    assert "+ 1" not in fixed and "sum(xs) / len(xs)" in fixed, (fixed, out.stdout[-400:])
    return fixed.strip()


# -- the recording proxy ----------------------------------------------------------------------------------------------
class Recorder:
    """A loopback HTTP proxy to the server that keeps (path, request body, status, response body) of every request."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        self.records: list[dict] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                conn = http.client.HTTPConnection(recorder.upstream.hostname, recorder.upstream.port, timeout=1800)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                data = bytearray()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    data += chunk
                    self.wfile.write(chunk)
                    self.wfile.flush()
                conn.close()
                recorder.records.append(
                    {
                        "path": self.path,
                        "request": body.decode("utf-8", "replace"),
                        "status": resp.status,
                        "response": data.decode("utf-8", "replace"),
                    }
                )

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


def replies(record: dict) -> tuple[str | None, list[dict]]:
    """(finish_reason, tool calls [{"name", "arguments"}]) of one recorded chat reply, streamed or not."""
    text = record["response"]
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None, []
        choice = (obj.get("choices") or [{}])[0]
        calls = (choice.get("message") or {}).get("tool_calls") or []
        return choice.get("finish_reason"), [c["function"] for c in calls]
    finish, calls = None, {}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        obj = json.loads(line[6:])
        for choice in obj.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            for tc in (choice.get("delta") or {}).get("tool_calls") or ():
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += (tc.get("function") or {}).get("name") or ""
                c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    return finish, list(calls.values())


def check_records(records: list[dict]) -> list[str]:
    """Problems in what the server returned: replies ending with finish_reason length, tool-call arguments that
    are not JSON."""
    problems = []
    for i, r in enumerate(records):
        if not r["path"].startswith("/v1/chat/completions") or r["status"] != 200:
            continue
        finish, calls = replies(r)
        if finish == "length":
            problems.append(f"request {i + 1}: finish_reason length")
        for c in calls:
            try:
                json.loads(c["arguments"])
            except json.JSONDecodeError:
                problems.append(
                    f"request {i + 1}: tool call {c['name']} has arguments that are not JSON: {c['arguments'][:80]!r}"
                )
    return problems


# -- running it -------------------------------------------------------------------------------------------------------
def ensure_venv(root: Path, name: str) -> Path:
    """DIR/NAME's python, creating the venv and installing its clients from PyPI when it is missing."""
    python = root / name / "bin" / "python"
    if not python.exists():
        print(f"creating {root / name} ({', '.join(VENVS[name])}) from PyPI ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(root / name)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *VENVS[name]], check=True)
    return python


def run_one(name: str, python: Path, url: str, timeout: float) -> tuple[bool, float, str]:
    venv, *rest = SCENARIOS[name]
    t0 = time.monotonic()
    try:
        if name.startswith("llm"):
            detail = run_llm(python, url, schema="schema" in name)
        elif name.startswith("aider"):
            detail = run_aider(python, url)
        else:
            out = subprocess.run(
                [str(python), __file__, "--run", name, "--url", url],
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "PYTHONPATH": ""},
            )
            lines = out.stdout.strip().splitlines()
            if out.returncode or not lines:
                raise AssertionError((out.stderr.strip().splitlines() or ["(no output)"])[-1][:400])
            detail = lines[-1]
        return True, time.monotonic() - t0, detail
    except Exception as e:  # a client's failure is a FAIL line, never the end of the run
        return False, time.monotonic() - t0, f"{type(e).__name__}: {str(e)[:400]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--venvs", default=str(Path.home() / ".cache" / "specdec" / "bench-clients"))
    ap.add_argument("--only", default="", help="run only the clients whose name contains this")
    ap.add_argument("--url", default=None, help="a running server's /v1 URL (then no server is started)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per client")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.run:  # inside a client venv
        _, fn, *fn_args = SCENARIOS[args.run]
        print(fn(args.url, *fn_args))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # bench_serve: the server helpers
    from bench_serve import launch, stop_server

    names = [n for n in SCENARIOS if args.only in n]
    pythons = {v: ensure_venv(Path(args.venvs), v) for v in {SCENARIOS[n][0] for n in names}}
    proc = None
    if args.url:
        url, recorder = args.url, None
    else:
        cmd = [
            sys.executable,
            "-m",
            "specdec_cli",
            "serve",
            "-t",
            args.target,
            "--method",
            args.method,
            "--port",
            "0",
            "--ctx",
            str(args.ctx),
        ] + (["--threads", str(args.threads)] if args.threads else [])
        proc, server_url = launch(cmd, tempfile.mkdtemp(prefix="bench-clients-"))
        recorder = Recorder(server_url.removesuffix("/v1"))
        url = recorder.url
    failed = 0
    try:
        for name in names:
            ok, seconds, detail = run_one(name, pythons[SCENARIOS[name][0]], url, args.timeout)
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {name:34} {seconds:7.1f} s  {detail[:160]}", flush=True)
    finally:
        log = stop_server(proc) if proc is not None else ""
    if recorder is not None:
        problems = check_records(recorder.records)
        lengths = [ln for ln in log.splitlines() if "finish length" in ln]
        n_calls = sum(len(replies(r)[1]) for r in recorder.records if r["path"].startswith("/v1/chat"))
        print(
            f"{'PASS' if not problems else 'FAIL'}  replies: {len(recorder.records)} requests, {n_calls} tool calls "
            f"returned; none ended with finish_reason length and every tool call's arguments are JSON"
            if not problems
            else f"FAIL  replies: {'; '.join(problems[:6])}"
        )
        failed += bool(problems)
        for ln in lengths:
            print(f"      server: {ln}")
        Path(tempfile.gettempdir(), "bench-clients-records.json").write_text(json.dumps(recorder.records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
