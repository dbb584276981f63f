"""Reading prompt and prediction files (and directories of prompts for tune and bench): every bad input is one clear
UsageError, never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_cli.errors import UsageError
from specdec_cli.prompts import PromptCase

MAX_PROMPT_BYTES = 16 << 20  # 16 MiB: anything larger is not a prompt


def read_prompt(source: str, *, stdin=None) -> str:
    """The prompt text from a file path, or from standard input when `source` is "-".

    Raises UsageError: missing file, a directory, unreadable, binary (NUL bytes), not UTF-8, empty, or too large.
    """
    return _read_text(source, "prompt", stdin=stdin)


def read_prediction(source: str, *, stdin=None) -> str:
    """The predicted output (`--predict FILE`: the text the reply is expected to repeat, e.g. the file being
    edited) from a file path, or from standard input when `source` is "-". Read like a prompt file, with the same
    one-line errors naming the prediction. Its length is not limited by the context: the drafter only reads it.

    Raises UsageError: missing file, a directory, unreadable, binary (NUL bytes), not UTF-8, empty, or over 16 MiB.
    """
    return _read_text(source, "prediction", stdin=stdin)


def _read_text(source: str, what: str, *, stdin=None) -> str:
    """A UTF-8 text file (or stdin for "-") whose errors name `what` ("prompt", "prediction")."""
    What = what.capitalize()
    if source == "-":
        stream = stdin if stdin is not None else sys.stdin
        data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        name = "standard input"
    else:
        path = Path(source)
        if not path.exists():
            raise UsageError(f"{What} file {source} does not exist.", "Give a path to a text file, or - for stdin.")
        if path.is_dir():
            raise UsageError(f"{What} file {source} is a directory.", "Give a path to a text file, or - for stdin.")
        try:
            if path.stat().st_size > MAX_PROMPT_BYTES:
                raise UsageError(f"{What} file {source} is larger than 16 MiB.", f"Give a shorter {what}.")
            data = path.read_bytes()
        except PermissionError:
            raise UsageError(f"{What} file {source} is not readable.", "Check its permissions.") from None
        except OSError as e:
            raise UsageError(f"{What} file {source} could not be read: {e.strerror}.", "Check the path.") from None
        name = source
    if b"\0" in data:
        raise UsageError(f"The {what} in {name} looks binary (it contains NUL bytes).", "Give a UTF-8 text file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"The {what} in {name} is not UTF-8 (invalid byte at offset {e.start}).",
            "Convert it, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`.",
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise UsageError(f"The {what} in {name} is empty.", "Write something in it.")
    return text


def check_output_path(path: str | None, option: str = "--json") -> None:
    """Before any work: an output file's directory must exist and be a writable directory ("-" = stdout is fine).

    Raises UsageError naming the option, the path and the fix, so a long generation is never lost at the end.
    """
    import os

    if not path or path == "-":
        return
    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise UsageError(
            f"{option} {path} is a directory.", f"Give a file path, e.g. {option} {Path(path) / 'out.json'}."
        )
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: the directory {parent} does not exist.", "Create it, or write elsewhere.")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option} {path} is not writable.", "Check its permissions, or write elsewhere.")


def from_paths(paths: list[Path]) -> list[PromptCase]:
    """Prompt files, and the *.txt / *.md files of directories (recursively); the class is the parent directory.
    Raises UsageError: a directory without prompt files, or what `read_prompt` raises."""
    out = []
    for p in paths:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
            if not files:
                raise UsageError(f"No .txt or .md prompt files in {p}.", "Add some, or name files directly.")
        else:
            files = [p]
        for f in files:
            out.append(PromptCase(f.stem, f.parent.name or "prompt", read_prompt(str(f))))
    return out
