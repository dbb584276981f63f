"""`specdec chat` in a real terminal (tmux): a message, Ctrl-C during a long reply, another message, /save, /quit; and a
reply whose rejected drafts are shown without taking its lines and indentation.

Drives the tiny SmolLM2 pair (target = draft) through a pseudo-terminal so the interactive paths run for real:
readline prompts, SIGINT from the keyboard during generation, the history file. Polls the screen with a timeout
instead of sleeping. Needs tmux (`apt-get install -y tmux`); skipped with that reason when it is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import SGR, unstrike

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
]

TIMEOUT = 300.0  # seconds per phase: generous for a loaded small machine; a healthy run takes a few seconds


class Tmux:
    """One tmux server on a private socket, one session running `command`."""

    def __init__(self, socket, command: str) -> None:
        self.socket = str(socket)
        self._tmux("new-session", "-d", "-x", "110", "-y", "45", "-s", "chat", command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", text)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def key(self, key: str) -> None:
        self._tmux("send-keys", "-t", "chat", key)

    def screen(self) -> str:
        """The whole pane, scrollback included, wrapped lines joined, without colours."""
        try:
            return self._tmux("capture-pane", "-p", "-J", "-t", "chat", "-S", "-2000")
        except subprocess.CalledProcessError:
            return "(the session has ended)"

    def coloured(self) -> str:
        """The whole pane as `screen`, with each cell's colours and attributes as escape codes (capture-pane -e)."""
        return self._tmux("capture-pane", "-p", "-e", "-J", "-t", "chat", "-S", "-2000")

    def wait_for(self, predicate, what: str, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; the screen:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def prompts(screen: str) -> int:
    return sum(line.startswith(">>>") for line in screen.splitlines())


def after(screen: str, marker: str) -> str:
    return screen.rsplit(marker, 1)[1] if marker in screen else ""


def test_chat_in_a_terminal_survives_ctrl_c(tmp_path, smollm2_path):
    home = tmp_path / "home"
    rc_file = tmp_path / "rc"
    saved = tmp_path / "chat.json"
    chat = [
        sys.executable,
        "-m",
        "specdec_cli",
        "chat",
        "-t",
        "smollm2-135m",
        "-d",
        "smollm2-135m",
        "-n",
        "200",
        "--k",
        "3",
        "--threads",
        "2",
    ]
    command = (
        f"cd {shlex.quote(str(tmp_path))} && env SPECDEC_HOME={shlex.quote(str(home))} "
        f"{shlex.join(chat)}; echo $? > {shlex.quote(str(rc_file))}"
    )
    tmux = Tmux(tmp_path / "tmux.sock", command)
    try:
        screen = tmux.wait_for(lambda s: prompts(s) == 1, "the first prompt")
        assert "specdec chat" in screen and "legend" in screen

        long_message = "Write a long story about a dragon who learns to bake bread."
        tmux.type(long_message)
        tmux.wait_for(lambda s: len(after(s, long_message).strip()) >= 30, "the reply to start")
        tmux.key("C-c")
        screen = tmux.wait_for(lambda s: prompts(s) == 2, "the prompt after Ctrl-C")
        assert "interrupted" in after(screen, long_message)

        tmux.type("Say hello in three words.")
        screen = tmux.wait_for(lambda s: prompts(s) == 3, "the second reply")
        second = after(screen, "Say hello in three words.")
        assert " tok/s · " in second and "interrupted" not in second
        assert len(second.split(" tokens · ")[0].strip()) > 0  # some reply text before the footer

        tmux.type(f"/save {saved}")
        tmux.wait_for(lambda s: "Saved 2 turns" in s, "/save")
        tmux.type("/quit")
        tmux.wait_for(lambda s: rc_file.exists() and rc_file.read_text().strip() != "", "the exit code")
        assert rc_file.read_text().strip() == "0", tmux.screen()
    finally:
        tmux.kill()

    turns = json.loads(saved.read_text())["turns"]
    assert turns[0]["interrupted"] and turns[0]["assistant"].strip()  # what was shown is kept in the history
    assert not turns[1]["interrupted"] and turns[1]["assistant"].strip()
    assert turns[1]["stats"]["n_prefill_evaluated"] < turns[1]["stats"]["n_prompt"] // 2  # the cache was reused
    history = home / "chat_history"
    assert stat.S_IMODE(os.stat(history).st_mode) == 0o600
    assert long_message in history.read_text()


FOOTER = re.compile(r"^\d+ tokens · ")


def lines(text: str) -> list[str]:
    """Lines as a terminal keeps them: trailing spaces dropped (tmux trims them), trailing empty lines too."""
    out = [line.rstrip() for line in text.split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def test_rejected_drafts_never_take_the_replys_lines_in_a_terminal(tmp_path, smollm2_path):
    """The reply as the terminal shows it, its struck-through cells (the rejected drafts' style, `spec.rejected`, the
    only one that strikes) removed, is the reply's text line for line; and rejected drafts were shown."""
    rc_file = tmp_path / "rc"
    saved = tmp_path / "chat.json"
    chat = [
        sys.executable,
        "-m",
        "specdec_cli",
        "chat",
        "-t",
        "smollm2-135m",
        "--method",
        "ngram",
        "--ngram-min",
        "1",
        "--k",
        "8",
        "-n",
        "160",
        "--threads",
        "2",
    ]
    root = str(Path(__file__).resolve().parents[2])  # this checkout's specdec_cli, whatever is installed
    command = (
        f"cd {shlex.quote(str(tmp_path))} && env SPECDEC_HOME={shlex.quote(str(tmp_path / 'home'))} "
        f"PYTHONPATH={shlex.quote(root)} {shlex.join(chat)}; echo $? > {shlex.quote(str(rc_file))}"
    )
    tmux = Tmux(tmp_path / "tmux.sock", command)
    message = "Write a Python function is_palindrome(s) with a docstring, and show how to call it."
    try:
        tmux.wait_for(lambda s: prompts(s) == 1, "the first prompt")
        tmux.type(message)
        tmux.wait_for(lambda s: prompts(s) == 2, "the reply")
        screen = tmux.coloured()
        tmux.type(f"/save {saved}")
        tmux.wait_for(lambda s: "Saved 1 turn" in s, "/save")
        tmux.type("/quit")
        tmux.wait_for(lambda s: rc_file.exists() and rc_file.read_text().strip() != "", "the exit code")
        assert rc_file.read_text().strip() == "0", tmux.screen()
    finally:
        tmux.kill()

    reply = json.loads(saved.read_text())["turns"][0]["assistant"]
    rows = screen.split("\n")
    plain = [SGR.sub("", row) for row in rows]
    start = max(i for i, row in enumerate(plain) if message in row) + 1
    end = next(i for i in range(start, len(rows)) if FOOTER.match(plain[i]))
    shown, rejected = unstrike("\n".join(rows[start:end]))
    assert rejected, "no rejected draft was shown: the test proves nothing"
    assert lines(shown) == lines(reply.expandtabs()), "\n".join(plain[start:end])
    assert any("↵" in r for r in rejected)  # a rejected newline was shown as its mark, not as a line break
