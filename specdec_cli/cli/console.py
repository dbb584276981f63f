"""Small output helpers shared by the commands: JSON files, progress bars and spinners on stderr, and the Rich
`Reporter` through which finding and loading models shows its notes, spinners and progress bars."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.text import Text

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


class RichReporter:
    """`specdec_cli.models.resolver.Reporter` on a Rich console (stderr): `note: ...` lines (the label yellow),
    spinners on a terminal only, and Rich progress bars (bytes: size, speed, time left; steps: done/total)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def note(self, text: str) -> None:
        self.console.print(Text.assemble(("note:", "yellow"), " ", text))

    def say(self, text: str) -> None:
        self.console.print(Text(text))

    def status(self, text: str) -> contextlib.AbstractContextManager[None]:
        return status(self.console, text)

    @contextlib.contextmanager
    def progress(self, description: str, total: int, *, unit: str = "bytes") -> Iterator[RichTask]:
        from rich.progress import (
            BarColumn, DownloadColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
            TimeRemainingColumn, TransferSpeedColumn,
        )

        if unit == "bytes":
            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn())
        else:
            columns = (SpinnerColumn(), TextColumn("{task.description}"), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console) as bar:
            yield RichTask(bar, bar.add_task(description, total=total))


class RichTask:
    """One bar of a Rich `Progress` as a `models.resolver.Task` (advance, describe): what library code that reports
    progress (`measure.tune.run`) is given."""

    def __init__(self, bar, task_id) -> None:
        self._bar, self._id = bar, task_id

    def advance(self, n: int = 1) -> None:
        self._bar.advance(self._id, n)

    def describe(self, text: str) -> None:
        self._bar.update(self._id, description=text)
