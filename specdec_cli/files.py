"""The one way specdec writes a file that must survive a crash: every store (the prompt cache, the suffix store,
tuned.json, learnt.json), the CLI's --json writer and chat's /save call it.

    with staged(path) as tmp:      # tmp = <dir>/.<name>.tmp-<pid>-<8 hex>, created 0o600 (O_EXCL)
        write tmp ...              # by us, numpy or llama.cpp
    # on success: tmp fsynced, os.replace'd over path, the directory fsynced; on any exception: tmp deleted

    write_atomic(path, text)       # the same for a str or bytes
    with lock(dir / ".lock", timeout=10):   # filelock.FileLock, the lock file 0o600
    set_aside(path)                # <name>.corrupt-<YYYYmmdd-HHMMSS>[-i]: a corrupt file kept for inspection

A reader never sees a half-written file: a crash leaves the old file (or none) and at worst a temporary, which
`remove_temporaries` (called by a writer holding the lock) deletes. Files are private (0o600) unless the caller
writes a user's output (`private=False`: a --json file keeps the mode a plain write would give it).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import filelock

PRIVATE = 0o600  # files: the user only
PRIVATE_DIR = 0o700


def fsync_dir(directory: Path) -> None:
    """Flush `directory`'s entries to disk, so a rename into it survives a crash. POSIX only (Windows cannot open a
    directory as a file, and its renames need no such flush); best effort: a platform or file system that refuses
    loses that durability and nothing else."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - not supported on every file system
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk through a handle opened for writing (Windows refuses to flush a read-only one:
    EBADF). Raises OSError."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(directory: Path) -> Path:
    """`directory`, created (with its parents) 0o700 when missing. Raises OSError."""
    directory = Path(directory)
    if not directory.is_dir():
        directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        os.chmod(directory, PRIVATE_DIR)
    return directory


def temporary_name(path: Path) -> Path:
    """A fresh temporary name next to `path`: `.<name>.tmp-<pid>-<8 hex>` (`remove_temporaries` finds it)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_temporaries(directory: Path, name: str = "*") -> None:
    """Delete the temporaries a killed writer left for files named `name` (a glob; "*" = every file) in
    `directory`. Call it holding the files' lock, so no write is in progress."""
    for tmp in Path(directory).glob(f".{name}.tmp-*"):
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged(path: Path, *, mode: int = PRIVATE) -> Iterator[Path]:
    """Yield a new, empty temporary file next to `path` (created with `mode`, exclusively) for the block to write;
    when the block returns, fsync it, `os.replace` it over `path` and fsync the directory; when it raises, delete
    it. Nested blocks commit innermost first (the prompt cache renames its state before its header).

    Raises OSError (and whatever the block raises); `path` is then unchanged."""
    path = Path(path)
    tmp = temporary_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))  # a writer that reopens it keeps the mode
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: str | bytes, *, private: bool = True) -> int:
    """Replace `path` with `data` (str: UTF-8) atomically (`staged`); return the bytes written.

    private: the file is 0o600. False (a user's output, e.g. --json): it keeps the mode of the file it replaces, or
    gets the default mode of a new file (0o666 minus the umask). A `path` that exists and is not a regular file
    (/dev/stdout, a FIFO) is written in place: it cannot be replaced. Raises OSError; on failure `path` is unchanged
    and no temporary is left."""
    path = Path(path)
    if not private and path.exists() and not path.is_file():
        _write(path, data)
        return len(data.encode("utf-8") if isinstance(data, str) else data)
    with staged(path, mode=PRIVATE if private else _public_mode(path)) as tmp:
        _write(tmp, data)
    return len(data.encode("utf-8") if isinstance(data, str) else data)


def _write(path: Path, data: str | bytes) -> None:
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)


def _public_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def lock(lockfile: str | Path, timeout: float) -> filelock.FileLock:
    """A file lock on `lockfile` (created 0o600), waiting at most `timeout` seconds (then filelock.Timeout).
    Reentrant within one instance: keep one per store, as a second instance in the same process would wait for
    the first."""
    return filelock.FileLock(str(lockfile), timeout=timeout, mode=PRIVATE)


def set_aside(path: Path) -> Path:
    """Rename an unusable file to `<name>.corrupt-<YYYYmmdd-HHMMSS>` (`-1`, `-2`, ... when taken) next to it, so a
    fresh one can start and the old one can still be inspected; return the new path. Raises OSError."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    i = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{i}")
        i += 1
    os.replace(path, aside)
    return aside
