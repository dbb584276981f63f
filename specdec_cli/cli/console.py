"""The consoles and small output helpers the commands share: specdec's theme and consoles (stdout, stderr), JSON
files, progress bars and spinners on stderr, and the Rich `Reporter` through which finding and loading models shows
its notes, spinners and progress bars."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.text import Text
from rich.theme import Theme

from specdec_cli import files
from specdec_cli.errors import UsageError

THEME = Theme(
    {
        "spec.accepted": "green",  # prompt lookup (auto's "prompt", --method ngram/suffix)
        "spec.accepted.store": "magenta",  # the suffix store of past outputs
        "spec.accepted.predict": "cyan",  # the user's prediction (--predict)
        "spec.accepted.draft": "blue",  # a draft model
        "spec.accepted.mtp": "medium_purple1",  # the target's own MTP block
        "spec.accepted.corpus": "dark_orange",  # the corpus `specdec learn` indexed
        "spec.accepted.grammar": "yellow",  # the tokens a grammar forces (--json-object, --json-schema, --grammar)
        "spec.target": "bold",
        "spec.rejected": "red strike",
        "spec.legend": "dim",
        "spec.label": "dim",
        "spec.good": "bold green",
        "spec.bad": "bold red",
        "spec.warn": "yellow",
    }
)


def human_size(n: float) -> str:
    """A size in bytes for people: "512 B", "1.4 MB" (decimal units: `specdec cache stats`, `specdec learn`)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


PIPE_WIDTH = 10_000  # columns of a console that is not a terminal: wide enough that no table is ever cut


def make_console(*, stderr: bool = False, file: TextIO | None = None) -> Console:
    """A console with specdec's theme; Rich honours NO_COLOR, FORCE_COLOR and TERM=dumb itself.

    On a terminal, tables fit its width. Anywhere else (a pipe, a file: a report being saved), Rich would assume
    80 columns (or $COLUMNS) and cut cells to fit ("spee…"); there a table takes the width it needs instead
    (`PIPE_WIDTH`), and nothing is padded to it: tables are not expanded and text is not justified.
    """
    console = Console(theme=THEME, highlight=False, stderr=stderr, file=file, soft_wrap=True)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def choose_encoding(*streams: TextIO) -> None:
    """Write `streams` (default: sys.stdout and sys.stderr) so that any text can be written, whatever the platform
    would have inherited: a pipe or a file gets UTF-8 (Windows would give cp1252, so "→" or "中文" in a reply raised
    UnicodeEncodeError); a terminal keeps the encoding it displays, with characters it lacks written as "?". Streams
    already in UTF-8, and objects that are not `io.TextIOWrapper`s (no `reconfigure`), are left as they are. Call it
    before any console is made; the CLI's `main` does. Follows Python's `TextIOWrapper.reconfigure`."""
    import codecs

    for stream in streams or (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None:
            continue
        try:
            if codecs.lookup(getattr(stream, "encoding", None) or "ascii").name == "utf-8":
                continue
        except LookupError:
            pass
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        try:
            reconfigure(errors="replace") if tty else reconfigure(encoding="utf-8")
        except (ValueError, OSError):  # a closed or detached stream: nothing will be written to it
            continue


def wants_color(stream: TextIO, plain: bool) -> bool:
    """Styled streaming only on a terminal, without --plain and without NO_COLOR."""
    if plain or os.environ.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def err_console() -> Console:
    return make_console(stderr=True)


def write_json(path: str, doc: dict, *, indent: int = 2) -> None:
    """Write `doc` to `path` ('-' = stdout), atomically (`files.write_atomic`: a reader never sees half a
    document; the file gets the mode a plain write would). Raises UsageError when the file cannot be written."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    try:
        files.write_atomic(Path(path), text + "\n", private=False)
    except OSError as e:
        raise UsageError(
            f"Cannot write --json {path}: {e.strerror or e}.", "Give a writable path, or - for stdout."
        ) from None


def progress(console: Console, unit: str = "runs"):
    """A Rich progress bar for long sweeps (tune, bench); hidden when `console` is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


@contextlib.contextmanager
def sweep_task(console: Console, description: str, total: int) -> Iterator[RichTask]:
    """A sweep's progress bar (`progress`) of `total` runs, open for the block, as the one `RichTask` the measuring
    code advances and describes."""
    bar = progress(console)
    with bar:
        yield RichTask(bar, bar.add_task(description, total=total))


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
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns: tuple[ProgressColumn, ...]
        if unit == "bytes":
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
            )
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
