"""Small output helpers shared by the commands: JSON files, progress bars and spinners on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from rich.console import Console

from specdec_cli.errors import UsageError


def write_json(path: str, doc: dict, *, indent: int = 2) -> None:
    """Write `doc` to `path` ('-' = stdout). Raises UsageError when the file cannot be written."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    try:
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"Cannot write --json {path}: {e.strerror or e}.", "Give a writable path, or - for stdout.") \
            from None


def progress(console: Console, unit: str = "runs"):
    """A Rich progress bar for long sweeps (tune, bench); hidden when `console` is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn(unit), TimeElapsedColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


@contextlib.contextmanager
def status(console: Console | None, message: str) -> Iterator[None]:
    """A spinner with `message` while the block runs; nothing when `console` is None or not a terminal."""
    if console is None or not console.is_terminal:
        yield
        return
    with console.status(message, spinner="dots"):
        yield


def fsync_dir(directory: Path) -> None:
    """Flush `directory`'s entries to disk, so a rename into it survives a crash (best effort: some platforms and
    file systems refuse, and nothing is lost then but that durability)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - not supported on every platform
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
