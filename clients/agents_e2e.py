"""Coding agents end to end through `specdec serve`: each fixes a one-line bug in a scratch directory.

    python clients/agents_e2e.py --agent claude                     # Claude Code (`claude -p`, ANTHROPIC_BASE_URL)
    python clients/agents_e2e.py --agent codex                      # Codex CLI (`codex exec`, wire_api = "responses")
    python clients/agents_e2e.py --agent codex -t qwen2.5-coder-7b --codex-metadata fallback --keep /tmp/agents

For each agent: install its npm package into ~/.cache/specdec/agents/npm if it is missing (`npm install --prefix`),
start `specdec serve` on a free loopback port with an API key (`--api-key-file`, a random key the agent is given as a
user would give it: Claude Code's ANTHROPIC_API_KEY, Codex's `env_key`; its stderr, one line per request, goes to a
log), write a scratch git repository with `bug.py` (`return a - b` where `a + b` is meant) and `test_bug.py`, run the
agent there, and print PASS (bug.py changed and its test passes) or FAIL, the seconds, the server's per-request lines
and where the agent's transcript is.

Codex CLI 0.169 (`run_codex`; the configuration README's "Codex CLI" section gives): HOME is a temporary directory,
CODEX_HOME is ~/.cache/specdec/agents/codex-home (emptied first; not under /tmp, where Codex will not create its
helper binaries); CODEX_HOME/config.toml names a custom provider whose `base_url` is the server, with
`wire_api = "responses"`, its key from SPECDEC_API_KEY (Codex refuses to start without it), no retries, a long idle
timeout (a CPU's first prefill of Codex's ~9k-token prompt takes minutes before the first event), and the startup
plugin sync and analytics off. `--codex-metadata catalog` (the default) gives the served model Codex's full model
metadata (its gpt-5.5 entry from `codex debug models`, renamed `specdec`, its context window the server's): Codex then
offers its `apply_patch` tool as a custom tool with a Lark grammar, which specdec serve holds the model's patch to;
`fallback` leaves the model unknown to Codex (fallback metadata: edits go through `exec_command`). The transcript is
`codex exec --json` (every command, patch, message and error of the session).

Claude Code 2.1 (the configuration README's "Claude Code" section gives): HOME is a temporary directory whose
`.claude.json` has onboarding done; DISABLE_TELEMETRY, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC, DISABLE_AUTOUPDATER
and DISABLE_ERROR_REPORTING keep it off Anthropic's servers; API_TIMEOUT_MS and CLAUDE_STREAM_IDLE_TIMEOUT_MS (its
watchdog between stream events, 300 s by default) give a CPU's long first prefill time
(its default is 600 s per request); `--permission-mode acceptEdits` lets it read and edit without asking
(`--dangerously-skip-permissions` refuses to run as root); `--model specdec` is any name (the server serves one). The
transcript is `--output-format stream-json` (every request, tool call and tool result of the session).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
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
CODEX_CONFIG = """model = "specdec"
model_provider = "local"
check_for_update_on_startup = false

[model_providers.local]
name = "specdec serve"
base_url = "{url}/v1"                    # codex appends /responses
wire_api = "responses"
env_key = "SPECDEC_API_KEY"              # codex refuses to start when this variable is unset or empty
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_ms}

[analytics]
enabled = false

[features]                               # no startup plugin sync (it contacts github.com and chatgpt.com)
plugins = false
apps = false
remote_plugin = false
"""


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
def npm_bin(agent: str, clients: Path | None = None) -> Path:
    """The agent's executable: CLIENTS/node_modules/.bin/NAME when `clients` is given (a directory where the user ran
    `npm install`), else installed from npm into NPM_DIR when missing. Exits when it is not there or npm fails."""
    package, name = PACKAGES[agent]
    if clients is not None:
        exe = clients / "node_modules" / ".bin" / name
        if not exe.exists():
            raise SystemExit(f"no {exe}: run `npm install {package}` in {clients}")
        return exe
    exe = NPM_DIR / "node_modules" / ".bin" / name
    if not exe.exists():
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        print(f"installing {package} into {NPM_DIR} ...", file=sys.stderr)
        done = subprocess.run(
            ["npm", "install", "--prefix", str(NPM_DIR), "--no-audit", "--no-fund", package],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not exe.exists():
            raise SystemExit(f"npm install {package} failed:\n{done.stderr[-2000:]}")
    return exe


class Server:
    """`specdec serve` on a free loopback port, its stderr in `log` (read back with `lines`)."""

    def __init__(self, args, log: Path, key_file: Path | None = None) -> None:
        cmd = [sys.executable, "-m", "specdec_cli", "serve", "--port", "0", "--method", args.method]
        if args.target:
            cmd += ["-t", args.target]
        if args.ctx:
            cmd += ["--ctx", str(args.ctx)]
        if args.max_tokens:
            cmd += ["--max-tokens", str(args.max_tokens)]
        if key_file is not None:
            cmd += ["--api-key-file", str(key_file)]
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
        """The per-request lines ("#3 responses: ...", "count_tokens: ...") and the notes about hosted tools left
        out."""
        return [
            ln
            for ln in self.log.read_text().splitlines()
            if re.match(r"#\d+ |count_tokens:|messages: server tools|responses: left out", ln)
        ]

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
    git = ["git", "-c", "user.name=specdec", "-c", "user.email=specdec@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=work)
    subprocess.run([*git, "add", "."], cwd=work)
    subprocess.run([*git, "commit", "-qm", "a bug"], cwd=work)
    return work


def check(work: Path) -> tuple[bool, bool]:
    """(bug.py changed, test_bug.py passes)."""
    changed = (work / "bug.py").read_text() != BUG
    test = subprocess.run([sys.executable, "test_bug.py"], cwd=work, capture_output=True, text=True)
    return changed, test.returncode == 0


def run_agent(agent: str, cmd: list[str], work: Path, env: dict, transcript: Path, timeout: float, summary) -> Result:
    """Run the agent's command in `work` (its output to `transcript`, at most `timeout` s; exit code -1 when it ran
    out), then check the scratch directory."""
    t0 = time.monotonic()
    with open(transcript, "w") as out:
        try:
            done = subprocess.run(
                cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
    seconds = time.monotonic() - t0
    changed, passes = check(work)
    return Result(agent, changed and passes, seconds, code, changed, transcript=transcript, note=summary(transcript))


# -- the agents -----------------------------------------------------------------------------------------------------
def claude_command(
    exe: Path, url: str, root: Path, work: Path, timeout: float, key: str = "unused"
) -> tuple[list[str], dict]:
    """(command, environment) of Claude Code (`claude -p TASK`) against `url` with API key `key`, its HOME a
    temporary directory under `root` that trusts `work`."""
    home = root / "home-claude"
    home.mkdir(exist_ok=True)
    (home / ".claude.json").write_text(
        json.dumps(
            {
                "hasCompletedOnboarding": True,
                "lastOnboardingVersion": "2.1.197",
                "theme": "dark",
                "customApiKeyResponses": {"approved": [key[-20:]], "rejected": []},
                "projects": {str(work): {"hasTrustDialogAccepted": True}},
            }
        )
    )
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": key,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "API_TIMEOUT_MS": str(int(timeout * 1000)),
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(int(timeout * 1000)),
    }
    cmd = [
        str(exe),
        "-p",
        TASK,
        "--model",
        "specdec",
        "--permission-mode",
        "acceptEdits",
        "--output-format",
        "stream-json",
        "--verbose",
    ]
    return cmd, env


def run_claude(args, url: str, root: Path, key: str = "unused") -> Result:
    """Claude Code (`claude -p TASK`) against `url` in a scratch directory, with a temporary HOME."""
    exe = npm_bin("claude", args.clients)
    work = scratch(root, "claude")
    cmd, env = claude_command(exe, url, root, work, args.timeout, key)
    transcript = root / "claude-transcript.jsonl"
    return run_agent("claude", cmd, work, env, transcript, args.timeout, claude_summary)


def transcript_events(transcript: Path, out: list[str]):
    """The JSON events of a JSON-lines transcript, in order; a line that is not JSON goes to `out` as text."""
    for line in transcript.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            out.append(f"  (text) {line[:200]}")


def claude_summary(transcript: Path) -> str:
    """The session in one line per event: tool calls, tool results and the final result (from stream-json)."""
    out = []
    for event in transcript_events(transcript, out):
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
            out.append(
                f"  result {event.get('subtype')}: is_error={event.get('is_error')} turns="
                f"{event.get('num_turns')} {str(event.get('result', ''))[:200]!r}"
            )
    return "\n".join(out)


def codex_catalog(exe: Path, env: dict, ctx: int, path: Path) -> Path:
    """A model catalog whose one model, "specdec", has the metadata of Codex's gpt-5.5 (`codex debug models`: the
    freeform apply_patch tool, unified exec), its context window `ctx`."""
    out = subprocess.run([str(exe), "debug", "models"], env=env, capture_output=True, text=True, check=True)
    models = json.loads(out.stdout)["models"]
    entry = next((m for m in models if m.get("slug") == "gpt-5.5"), None) or next(
        m for m in models if m.get("apply_patch_tool_type") == "freeform"
    )
    entry = {**entry, "slug": "specdec", "display_name": "specdec", "context_window": ctx, "max_context_window": ctx}
    path.write_text(json.dumps({"models": [entry]}))
    return path


def codex_command(
    exe: Path, url: str, root: Path, timeout: float, metadata: str, ctx: int, key: str = "unused"
) -> tuple[list[str], dict]:
    """(command without its task, environment) of Codex CLI (`codex exec`) against `url` with API key `key`: HOME
    a temporary directory under `root`, CODEX_HOME emptied, its config.toml naming the server; `metadata` "catalog"
    gives the model Codex's full metadata (`codex_catalog`, context window `ctx`)."""
    # CODEX_HOME outside /tmp: there Codex refuses to create its helper binaries (the `apply_patch` command on PATH)
    home, codex_home = root / "home-codex", NPM_DIR.parent / "codex-home"
    for d in (home, codex_home):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(url=url, idle_ms=int(timeout * 1000)))
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(codex_home), "SPECDEC_API_KEY": key}
    cmd = [str(exe), "exec", "--json", "--sandbox", "workspace-write"]
    if metadata == "catalog":
        catalog = codex_catalog(exe, env, ctx, root / "codex-catalog.json")
        cmd += ["-c", f'model_catalog_json="{catalog}"']
    return [*cmd, TASK], env


def run_codex(args, url: str, root: Path, key: str = "unused") -> Result:
    """Codex CLI (`codex exec TASK`) against `url` in a scratch repository, with temporary HOME and CODEX_HOME."""
    exe = npm_bin("codex", args.clients)
    work = scratch(root, "codex")
    cmd, env = codex_command(exe, url, root, args.timeout, args.codex_metadata, args.ctx or 32768, key)
    transcript = root / "codex-transcript.jsonl"
    return run_agent("codex", cmd, work, env, transcript, args.timeout, codex_summary)


def codex_summary(transcript: Path) -> str:
    """The session in one line per event (`codex exec --json`: commands run, patches, messages, errors)."""
    out = []
    for event in transcript_events(transcript, out):
        item = event.get("item") or {}
        kind = item.get("type") or event.get("type")
        if event.get("type") == "item.completed":
            if kind == "command_execution":
                out.append(
                    f"  command {item.get('command')!r} -> exit {item.get('exit_code')}: "
                    f"{(item.get('aggregated_output') or '')[:160]!r}"
                )
            elif kind == "file_change":
                out.append(f"  file_change {json.dumps(item.get('changes'))[:200]} {item.get('status')}")
            elif kind in ("agent_message", "reasoning"):
                out.append(f"  {kind} {(item.get('text') or '')[:200]!r}")
            else:
                out.append(f"  {kind} {json.dumps(item)[:200]}")
        elif event.get("type") in ("error", "turn.failed"):
            out.append(f"  {event.get('type')} {json.dumps(event)[:300]}")
        elif event.get("type") == "turn.completed":
            out.append(f"  turn.completed usage {json.dumps(event.get('usage'))}")
    return "\n".join(out)


AGENTS = {"claude": run_claude, "codex": run_codex}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", choices=["claude", "codex", "all"], default="all")
    parser.add_argument("-t", "--target", default=None, help="the served model (default: the catalog's default)")
    parser.add_argument("--method", default="auto")
    parser.add_argument(
        "--ctx",
        type=int,
        default=None,
        help="--ctx for specdec serve (default: serve's, 32768; the agents' prompts are 9k-25k tokens)",
    )
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for one agent's whole session")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="--max-tokens for specdec serve: the longest reply (default: serve's)",
    )
    parser.add_argument(
        "--codex-metadata",
        choices=["catalog", "fallback"],
        default="catalog",
        help="Codex's model metadata: catalog (apply_patch as a grammar tool) or fallback",
    )
    parser.add_argument(
        "--clients",
        type=Path,
        default=None,
        help="take the agents from DIR/node_modules/.bin "
        "(a directory where `npm install @openai/codex @anthropic-ai/claude-code` was run)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the scratch dirs, logs and transcripts here")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="specdec-agents-"))
    root.mkdir(parents=True, exist_ok=True)
    agents = ["claude", "codex"] if args.agent == "all" else [args.agent]
    results = []
    key_file = root / "serve-key"  # the server's key, as a user keeps it (off the command line); the agents send it
    key_file.write_text(f"sk-{secrets.token_hex(16)}\n")
    key = key_file.read_text().strip()
    for agent in agents:
        server = Server(args, root / f"serve-{agent}.log", key_file)
        try:
            result = AGENTS[agent](args, server.url, root, key)
        finally:
            server.stop()
        result.server_lines = server.lines()
        results.append(result)
        print(
            f"{agent}: {'PASS' if result.passed else 'FAIL'} in {result.seconds:.0f} s (exit {result.exit_code}, "
            f"bug.py {'changed' if result.changed else 'unchanged'})"
        )
        for line in result.server_lines:
            print(f"  server: {line}")
        if result.note:
            print(result.note)
        print(f"  transcript: {result.transcript}; server log: {server.log}")
    raise SystemExit(0 if results and all(r.passed for r in results) else 1)


if __name__ == "__main__":
    main()
