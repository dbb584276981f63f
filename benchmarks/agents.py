"""Coding agents end to end through `specdec serve`: each fixes a one-line bug in a scratch directory.

    python benchmarks/agents.py --agent claude            # Claude Code (`claude -p`, ANTHROPIC_BASE_URL)
    python benchmarks/agents.py --agent all -t qwen2.5-coder-1.5b --keep /tmp/agents

For each agent: install its npm package into ~/.cache/specdec/agents/npm if it is missing (`npm install --prefix`),
start `specdec serve` on a free loopback port (its stderr, one line per request, goes to a log), write a scratch
directory with `bug.py` (`return a - b` where `a + b` is meant) and `test_bug.py`, run the agent there with the
environment that keeps it off the network, and print PASS (bug.py changed and its test passes) or FAIL, the seconds,
the server's per-request lines and where the agent's transcript is (`--output-format stream-json`: every request,
tool call and tool result of the session).

Claude Code 2.1 (the configuration README's "Claude Code" section gives): HOME is a temporary directory whose
`.claude.json` has onboarding done; DISABLE_TELEMETRY, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, DISABLE_AUTOUPDATER
and DISABLE_ERROR_REPORTING keep it off Anthropic's servers; API_TIMEOUT_MS gives a CPU's long first prefill time
(its default is 600 s per request); `--permission-mode acceptEdits` lets it read and edit without asking
(`--dangerously-skip-permissions` refuses to run as root); `--model specdec` is any name (the server serves one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NPM_DIR = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "agents" / "npm"
PACKAGES = {"claude": ("@anthropic-ai/claude-code@2.1.197", "claude"), "codex": ("@openai/codex@0.169.0", "codex")}
BUG = "def add(a, b):\n    return a - b\n"
TEST = "from bug import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('ok')\n"
TASK = "fix the bug in bug.py"


@dataclass
class Result:
    """One agent's run: passed (bug.py changed and test_bug.py passes), seconds, the agent's exit code, the server's
    per-request log lines, and the transcript's path."""

    agent: str
    passed: bool
    seconds: float
    exit_code: int
    changed: bool
    server_lines: list[str] = field(default_factory=list)
    transcript: Path | None = None
    note: str = ""


# -- the pieces -----------------------------------------------------------------------------------------------------
def npm_bin(agent: str) -> Path:
    """The agent's executable, installed from npm into NPM_DIR when missing. Exits when npm fails."""
    package, name = PACKAGES[agent]
    exe = NPM_DIR / "node_modules" / ".bin" / name
    if not exe.exists():
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        print(f"installing {package} into {NPM_DIR} ...", file=sys.stderr)
        done = subprocess.run(["npm", "install", "--prefix", str(NPM_DIR), "--no-audit", "--no-fund", package],
                              capture_output=True, text=True)
        if done.returncode != 0 or not exe.exists():
            raise SystemExit(f"npm install {package} failed:\n{done.stderr[-2000:]}")
    return exe


class Server:
    """`specdec serve` on a free loopback port, its stderr in `log` (read back with `lines`)."""

    def __init__(self, args, log: Path) -> None:
        cmd = [sys.executable, "-m", "specdec_cli", "serve", "--port", "0", "--method", args.method]
        if args.target:
            cmd += ["-t", args.target]
        if args.ctx:
            cmd += ["--ctx", str(args.ctx)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = log
        self._file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._file, text=True, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            m = re.search(r"at (http://[\d.]+:\d+)/v1", log.read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"specdec serve did not start:\n{log.read_text()[-3000:]}")

    def lines(self) -> list[str]:
        """The per-request lines ("#3 messages: ..." and "count_tokens: ...")."""
        return [ln for ln in self.log.read_text().splitlines()
                if re.match(r"#\d+ |count_tokens:|messages: server tools", ln)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._file.close()


def scratch(root: Path, agent: str) -> Path:
    """A directory with bug.py and test_bug.py (a git repository: agents look for one)."""
    work = root / f"scratch-{agent}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "bug.py").write_text(BUG)
    (work / "test_bug.py").write_text(TEST)
    subprocess.run(["git", "init", "-q"], cwd=work)
    subprocess.run(["git", "-c", "user.name=specdec", "-c", "user.email=specdec@localhost", "add", "."], cwd=work)
    subprocess.run(["git", "-c", "user.name=specdec", "-c", "user.email=specdec@localhost", "commit", "-qm",
                    "a bug"], cwd=work)
    return work


def check(work: Path) -> tuple[bool, bool]:
    """(bug.py changed, test_bug.py passes)."""
    changed = (work / "bug.py").read_text() != BUG
    test = subprocess.run([sys.executable, "test_bug.py"], cwd=work, capture_output=True, text=True)
    return changed, test.returncode == 0


# -- the agents -----------------------------------------------------------------------------------------------------
def run_claude(args, url: str, root: Path) -> Result:
    """Claude Code (`claude -p TASK`) against `url` in a scratch directory, with a temporary HOME."""
    exe = npm_bin("claude")
    work = scratch(root, "claude")
    home = root / "home-claude"
    home.mkdir(exist_ok=True)
    (home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "lastOnboardingVersion": "2.1.197", "theme": "dark",
        "customApiKeyResponses": {"approved": ["unused"], "rejected": []},
        "projects": {str(work): {"hasTrustDialogAccepted": True}}}))
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_ERROR_REPORTING": "1", "API_TIMEOUT_MS": str(args.timeout * 1000)}
    transcript = root / "claude-transcript.jsonl"
    cmd = [str(exe), "-p", TASK, "--model", "specdec", "--permission-mode", "acceptEdits",
           "--output-format", "stream-json", "--verbose"]
    t0 = time.monotonic()
    with open(transcript, "w") as out:
        try:
            done = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=args.timeout)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
    seconds = time.monotonic() - t0
    changed, passes = check(work)
    return Result("claude", changed and passes, seconds, code, changed, transcript=transcript,
                  note=summary(transcript))


def run_codex(args, url: str, root: Path) -> Result:
    """Codex CLI: written on the Responses API's branch (it needs /v1/responses)."""
    raise SystemExit("--agent codex: run_codex comes with the Responses API (/v1/responses).")


AGENTS = {"claude": run_claude, "codex": run_codex}


def summary(transcript: Path) -> str:
    """The session in one line per event: tool calls, tool results and the final result (from stream-json)."""
    out = []
    for line in transcript.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            out.append(f"  (text) {line[:200]}")
            continue
        kind = event.get("type")
        if kind in ("assistant", "user"):
            for block in event.get("message", {}).get("content", []):
                if block.get("type") == "tool_use":
                    out.append(f"  tool_use {block.get('name')} {json.dumps(block.get('input'))[:200]}")
                elif block.get("type") == "tool_result":
                    content = block.get("content")
                    text = content if isinstance(content, str) else json.dumps(content)
                    out.append(f"  tool_result{' (error)' if block.get('is_error') else ''} {text[:200]!r}")
                elif block.get("type") == "text":
                    out.append(f"  text {block.get('text', '')[:200]!r}")
        elif kind == "result":
            out.append(f"  result {event.get('subtype')}: is_error={event.get('is_error')} turns="
                       f"{event.get('num_turns')} {str(event.get('result', ''))[:200]!r}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", choices=["claude", "codex", "all"], default="all")
    parser.add_argument("-t", "--target", default=None, help="the served model (default: the catalog's default)")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--ctx", type=int, default=None, help="--ctx for specdec serve (default: serve's)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for one agent's whole session")
    parser.add_argument("--keep", type=Path, default=None, help="keep the scratch dirs, logs and transcripts here")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="specdec-agents-"))
    root.mkdir(parents=True, exist_ok=True)
    agents = ["claude", "codex"] if args.agent == "all" else [args.agent]
    results = []
    for agent in agents:
        server = Server(args, root / f"serve-{agent}.log")
        try:
            result = AGENTS[agent](args, server.url, root)
        finally:
            server.stop()
        result.server_lines = server.lines()
        results.append(result)
        print(f"{agent}: {'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s (exit {result.exit_code}, "
              f"bug.py {'changed' if result.changed else 'unchanged'})")
        for line in result.server_lines:
            print(f"  server: {line}")
        if result.note:
            print(result.note)
        print(f"  transcript: {result.transcript}; server log: {server.log}")
    raise SystemExit(0 if all(r.passed for r in results) else 1)


if __name__ == "__main__":
    main()
