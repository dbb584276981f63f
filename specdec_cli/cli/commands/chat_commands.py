"""`specdec chat`'s slash commands (/help /reset /stats /k /method /predict /rejected /save /quit) and the transcripts
/save writes.

`COMMANDS` is the table: each entry runs with the `Chat` and the text after the command, and returns True to end
the chat. `dispatch` looks a line up in it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdec_cli import files
from specdec_cli.cli.console import RichReporter
from specdec_cli.errors import SpecdecError, UsageError
from specdec_cli.spec import METHOD_NAMES, NEEDS_DRAFT_MODEL, USES_PREDICTION, K, Method

if TYPE_CHECKING:
    from specdec_cli.cli.commands.chat_session import Chat


@dataclass(frozen=True)
class Command:
    run: Callable[[Chat, str], bool]  # (chat, argument) → True to end the chat
    usage: str
    help: str


def _help(chat: Chat, arg: str) -> bool:
    chat.view.help([(c.usage, c.help) for c in COMMANDS.values() if c.usage])
    return False


def _reset(chat: Chat, arg: str) -> bool:
    chat.conversation.reset()
    chat.view.note("New conversation" + (" (the system prompt is kept)." if chat.conversation.system else "."))
    return False


def _stats(chat: Chat, arg: str) -> bool:
    chat.view.stats(chat.totals, chat.spec.method)
    return False


def _k(chat: Chat, arg: str) -> bool:
    if not arg:
        chat.view.note(f"K is {chat.spec.k}. Change it with /k auto or /k N (0-64).")
        return False
    try:
        chat.set_spec(replace(chat.spec, k=K(arg), k_given=True))
    except UsageError as e:
        raise UsageError(e.message, "Use /k auto or /k N with N from 0 to 64.") from None
    chat.view.note(
        f"K is now {chat.spec.k}" + (" (it applies once a drafter is on: /method)." if chat.drafter is None else ".")
    )
    return False


def _predict(chat: Chat, arg: str) -> bool:
    """/predict FILE: the text the next reply is expected to repeat (predicted outputs), drafted from by auto and
    predict; read like a prompt file (the same one-line errors)."""
    from specdec_cli.cli.inputs import read_prediction

    if not arg.strip():
        raise UsageError("/predict needs a file: the text you expect the next reply to repeat.", "/predict FILE")
    chat.prediction = read_prediction(arg.strip())
    uses = chat.spec.method in USES_PREDICTION
    chat.view.note(
        f"The next reply drafts from {arg.strip()} ({len(chat.prediction):,} characters)."
        + ("" if uses else f" The method {chat.spec.method} does not: /method auto uses it.")
    )
    return False


def _method(chat: Chat, arg: str) -> bool:
    names = METHOD_NAMES
    if not arg:
        chat.view.note(f"The method is {chat.spec.method}. Change it with /method NAME ({names}).")
        return False
    try:
        method = Method(arg.strip().lower())
    except ValueError:
        raise UsageError(f"Unknown method {arg.strip()!r}.", f"Use /method with one of {names}.") from None
    if method in NEEDS_DRAFT_MODEL and chat.session.draft is None:
        chat.view.note(f"--method {method} needs a draft model; loading it (--draft, else the catalog default).")
        try:
            chat.session.load_draft(reporter=RichReporter(chat.view.err))
        except SpecdecError as e:
            chat.view.error(e)
            chat.view.note(f"No draft model, so the method stays {chat.spec.method}.")
            return False
    try:
        chat.set_spec(replace(chat.spec, method=method))
    except ImportError as e:  # a drafter module this build does not have
        raise UsageError(
            f"--method {method} is not available in this build ({e}).", f"Use /method with one of {names}."
        ) from None
    chat.view.note(f"The method is now {method}.")
    chat.view.show_legend(method)
    return False


def _save(chat: Chat, arg: str) -> bool:
    if not arg:
        raise UsageError("/save needs a path.", "Use /save chat.md (Markdown) or /save chat.json (JSON).")
    path = Path(arg.strip()).expanduser()
    kind = {".md": "md", ".markdown": "md", ".json": "json"}.get(path.suffix.lower())
    if kind is None:
        raise UsageError(
            f"Cannot tell the format of {path.name} from its extension.",
            "Use a path ending in .md (Markdown) or .json (JSON).",
        )
    text = transcript_markdown(chat) if kind == "md" else transcript_json(chat)
    try:
        files.write_atomic(path, text)  # 0o600, also over a file that had wider permissions
    except OSError as e:
        raise UsageError(
            f"Could not write {path}: {e.strerror or e}.", "Check the directory exists and is writable."
        ) from None
    n = len(chat.conversation.turns)
    chat.view.note(f"Saved {n} turn{'s' * (n != 1)} to {path} (readable by you only).")
    return False


def _rejected(chat: Chat, arg: str) -> bool:
    """/rejected on|off: show the drafts the target rejected in the stream, or not (--clean starts with off)."""
    choice = arg.strip().lower()
    if choice not in ("", "on", "off"):
        raise UsageError(f"/rejected takes on or off, not {arg.strip()!r}.", "Use /rejected on or /rejected off.")
    if choice:
        chat.view.show_rejected = choice == "on"
    shown = "shown" if chat.view.show_rejected else "hidden"
    chat.view.note(
        f"Rejected drafts are {shown} from the next reply on."
        if choice
        else f"Rejected drafts are {shown}. Change it with /rejected on or /rejected off."
    )
    if choice == "on" and not chat.view.styled:
        chat.view.note("They are shown only in colour, on a terminal (not with --plain, NO_COLOR or a pipe).")
    return False


def _quit(chat: Chat, arg: str) -> bool:
    return True


COMMANDS: dict[str, Command] = {
    "/help": Command(_help, "/help", "show this help"),
    "/reset": Command(_reset, "/reset", "start a new conversation (keeps the system prompt and the models)"),
    "/stats": Command(_stats, "/stats", "session totals and acceptance by draft position"),
    "/k": Command(_k, "/k N|auto", "draft length K from the next reply on (e.g. /k 4, /k auto)"),
    "/method": Command(
        _method, "/method NAME", "drafter: auto, none, draft, ngram, suffix, predict (loads a draft model if needed)"
    ),
    "/predict": Command(_predict, "/predict FILE", "draft the next reply from FILE, the text you expect back"),
    "/rejected": Command(
        _rejected,
        "/rejected on|off",
        "show the drafts the target rejected in the reply, or hide "
        "them (on one line, in their own style; never in /save)",
    ),
    "/save": Command(_save, "/save PATH", "write the transcript: PATH.md as Markdown, PATH.json as JSON (mode 600)"),
    "/quit": Command(_quit, "/quit", "end the chat (also /exit, Ctrl-D, or Ctrl-C at an empty prompt)"),
    "/exit": Command(_quit, "", ""),  # an alias, not listed
}


def dispatch(chat: Chat, line: str) -> bool:
    """Run a slash command. Returns True when the chat should end. Raises UsageError for an unknown command."""
    name, _, arg = line.strip().partition(" ")
    command = COMMANDS.get(name.lower())
    if command is None:
        raise UsageError(
            f"Unknown command {name}.",
            "/help lists the commands; start a message with // to send text that begins with a slash.",
        )
    return command.run(chat, arg.strip())


def is_command(line: str) -> bool:
    return line.lstrip().startswith("/") and not line.lstrip().startswith("//")


# ----------------------------------------------------------------------------------------------------------------
# Transcripts


def transcript_json(chat: Chat) -> str:
    s = chat.session
    conv = chat.conversation
    doc = {
        "target": str(s.target_path),
        "draft": str(s.draft_path) if s.draft_path else None,
        "system": conv.system,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "messages": conv.messages(),
        "turns": [
            {
                "user": t.user,
                "assistant": t.assistant,
                "interrupted": t.interrupted,
                "in_context": i >= conv.start,
                "method": t.method,
                "k": t.k,
                "stats": t.stats.to_dict() if t.stats else None,
            }
            for i, t in enumerate(conv.turns)
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def transcript_markdown(chat: Chat) -> str:
    from specdec_cli.cli.commands.chat_view import footer_text

    s = chat.session
    conv = chat.conversation
    out = ["# specdec chat", "", f"- target: `{s.target_path.name}`"]
    if s.draft_path:
        out.append(f"- draft: `{s.draft_path.name}`")
    out.append(f"- saved: {time.strftime('%Y-%m-%d %H:%M')}")
    out.append("")
    if conv.system:
        out += ["## System", "", conv.system, ""]
    for t in conv.turns:
        out += ["## You", "", t.user, "", "## Assistant", "", t.assistant, ""]
        if t.stats is not None:
            out += [f"*{footer_text(t)}*", ""]
    return "\n".join(out)
