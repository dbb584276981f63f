"""Small output helpers shared by the commands: JSON files, progress bars and spinners on stderr."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Iterator

from rich.console import Console

from specdec_cli.errors import UsageError
from specdec_cli.stores import files


def write_json(path: str, doc: dict, *, indent: int = 2) -> None:
    """Write `doc` to `path` ('-' = stdout), atomically (`stores.files.write_atomic`: a reader never sees half a
    document; the file gets the mode a plain write would). Raises UsageError when the file cannot be written."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    try:
        files.write_atomic(Path(path), text + "\n", private=False)
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
