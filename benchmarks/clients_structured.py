"""Real clients against `specdec serve` (issue 22): instructor in Mode.TOOLS and Mode.JSON_SCHEMA, and a pydantic-ai
agent with one tool. Starts one `specdec serve` (its own process, a fresh SPECDEC_HOME, loopback, greedy), runs each
client once, prints one PASS/FAIL line per client with what it got and how long it took, and exits 1 if any failed.

    python benchmarks/clients_structured.py                       # Qwen2.5-Coder-1.5B, the default method
    python benchmarks/clients_structured.py -t qwen2.5-coder-0.5b --threads 2

Needs `pip install 'specdec-cli[serve]' instructor 'pydantic-ai-slim[openai]'` (not test dependencies).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from pydantic import BaseModel

from bench_serve import launch  # benchmarks/ is on sys.path when a script in it runs

ROOT = Path(__file__).resolve().parents[1]


class User(BaseModel):
    name: str
    age: int


EXTRACT = [{"role": "user", "content": "Extract the user: Jason is 25 years old and lives in Lyon."}]


def start_server(args, home: str) -> tuple[subprocess.Popen, str]:
    """`specdec serve` on a free loopback port; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "specdec_cli", "serve", "-t", args.target, "--method", args.method, "--port", "0",
           "--ctx", str(args.ctx), "--temperature", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return launch(cmd, home)


def instructor_mode(url: str, mode_name: str) -> str:
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="unused", timeout=600),
                                    mode=getattr(instructor.Mode, mode_name))
    user = client.chat.completions.create(model="specdec", response_model=User, messages=EXTRACT, max_retries=0,
                                          max_tokens=60)
    if user.age != 25 or "Jason" not in user.name:
        raise AssertionError(f"got {user!r}")
    return repr(user)


def pydantic_ai_agent(url: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[str] = []
    agent = Agent(OpenAIChatModel("specdec", provider=OpenAIProvider(base_url=url, api_key="unused")),
                  instructions="You are a helpful assistant. Call a tool when you need data; once a tool's result "
                               "is in the conversation, answer the user's question with it in one sentence.")

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 22 degrees Celsius."

    result = agent.run_sync("What is the weather in Paris right now?", model_settings={"max_tokens": 80})
    if not calls or "Paris" not in calls[0]:
        raise AssertionError(f"the tool was not called (calls: {calls}); output: {result.output!r}")
    if "22" not in result.output:
        raise AssertionError(f"the answer does not use the tool's result: {result.output!r}")
    return f"get_weather({calls[0]!r}) -> {result.output!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-t", "--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    clients = [("instructor Mode.TOOLS", lambda url: instructor_mode(url, "TOOLS")),
               ("instructor Mode.JSON_SCHEMA", lambda url: instructor_mode(url, "JSON_SCHEMA")),
               ("pydantic-ai agent, one tool", pydantic_ai_agent)]
    failed = 0
    with tempfile.TemporaryDirectory() as home:
        proc, url = start_server(args, home)
        print(f"specdec serve -t {args.target} --method {args.method} at {url}", flush=True)
        try:
            for name, run in clients:
                t0 = time.perf_counter()
                try:
                    detail = run(url)
                    status = "PASS"
                except Exception as e:  # report and go on with the next client
                    failed += 1
                    status, detail = "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    if os.environ.get("SPECDEC_DEBUG"):
                        traceback.print_exc()
                print(f"{status}  {name:30s} {time.perf_counter() - t0:6.1f} s  {detail}", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
    log = [ln for ln in err.splitlines() if ln.startswith("#")]
    print("server log:\n  " + "\n  ".join(log))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
