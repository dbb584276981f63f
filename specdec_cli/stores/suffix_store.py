"""The global store of SuffixDecoding: past outputs, one persistent store per tokenizer.

The documents and their suffix array are a `specdec_cli.stores.suffix_index.Corpus` (the index and how drafts are
read from it are described there); this module keeps one on disk.

On-disk format (`<fingerprint[:16]>.npz`, an uncompressed numpy zip; every member is CRC-checked when read):

    meta     uint8   [*]    UTF-8 JSON: {"format": "specdec-suffix", "version": 1, "fingerprint": <sha256 hex>,
                            "window": 128, "n_docs", "n_tokens", "write_id", "updated" (Unix seconds)}
    tokens, offsets, added, sa: the `Corpus` arrays (int32 [T], int64 [D+1], float64 [D], int32 [T])

Persistence (`specdec_cli.files`): writes go to a temp file in the same directory, are fsynced, then
`os.replace`d over the store; a file lock (`<store>.lock`) serialises writers, and a writer re-reads the file under
the lock and appends its own new documents to what is there, so concurrent runs all keep their additions. Files are
0o600 in a 0o700 directory. A corrupt, truncated, other-version or other-tokenizer file is renamed to
`<name>.corrupt-<timestamp>` and a fresh store started. Nothing here raises for a bad store or a failed save: it
emits a one-line `SuffixStoreWarning` (`warnings.warn`; the CLI decides how to show it) and the generation goes on.

Eviction: the store holds at most `max_tokens` document tokens. Documents are kept in the order they were added;
when a save or an addition goes over the bound, the oldest documents are dropped first (FIFO). A single document
longer than `max_tokens` keeps only its first `max_tokens` tokens.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import filelock
import numpy as np

from specdec_cli import files
from specdec_cli.errors import reason
from specdec_cli.stores.suffix_index import SEP, WINDOW, Corpus

FORMAT = "specdec-suffix"
VERSION = 1
SUFFIX = ".npz"
DEFAULT_MAX_TOKENS = 2_000_000
LOCK_TIMEOUT_S = 10.0


class SuffixStoreWarning(UserWarning):
    """A suffix store could not be read or saved; the run goes on without it (the message says the fix)."""


def store_path(data_dir: Path, fingerprint: str) -> Path:
    """Where the store for the tokenizer with vocabulary `fingerprint` (`VocabInfo.fingerprint`) lives."""
    return Path(data_dir) / "suffix" / f"{fingerprint[:16]}{SUFFIX}"


# -- files ------------------------------------------------------------------------------------------------------


class CorruptStore(Exception):
    """The file is not a readable store of this version and tokenizer (the message says why)."""


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """What `specdec cache stats` shows for one store file (read from its `meta` member only).

    Attributes:
        path: the store file.
        fingerprint: the tokenizer's vocabulary fingerprint (sha256 hex).
        n_docs: documents held.
        n_tokens: document tokens held.
        size_bytes: size of the file on disk, in bytes.
        modified: last modification (Unix seconds).
    """

    path: Path
    fingerprint: str
    n_docs: int
    n_tokens: int
    size_bytes: int
    modified: float


def _npz(f) -> np.lib.npyio.NpzFile:
    """Open a store file (a binary file object) as an npz archive; CorruptStore when it is not a zip at all."""
    if f.read(4) != b"PK\x03\x04":
        raise CorruptStore("not a store file (no zip header)")
    f.seek(0)
    return np.load(f, allow_pickle=False)


def _check_meta(meta: object, path: Path, fingerprint: str | None) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptStore("not a specdec suffix store")
    if meta.get("version") != VERSION or meta.get("window") != WINDOW:
        raise CorruptStore(f"format version {meta.get('version')} (this specdec reads version {VERSION})")
    fp = meta.get("fingerprint")
    if not isinstance(fp, str) or len(fp) < 16:
        raise CorruptStore("it names no tokenizer")
    if fingerprint is not None and not (fp.startswith(fingerprint) or fingerprint.startswith(fp)):
        raise CorruptStore(f"it belongs to another tokenizer ({fp[:16]}, expected {fingerprint[:16]})")
    if not path.name.startswith(fp[:16]):
        raise CorruptStore(f"its tokenizer {fp[:16]} does not match its file name")
    return meta


def read_info(path: Path) -> StoreInfo:
    """Read a store's summary without loading its arrays. Raises `CorruptStore` or `OSError`."""
    path = Path(path)
    st = path.stat()
    try:
        with open(path, "rb") as f, _npz(f) as z:
            meta = _check_meta(json.loads(bytes(z["meta"]).decode("utf-8")), path, None)
    except (OSError, CorruptStore):
        raise
    except Exception as e:  # BadZipFile, KeyError, ValueError, UnicodeDecodeError, JSONDecodeError, ...
        raise CorruptStore(f"unreadable ({type(e).__name__}: {e})") from e
    return StoreInfo(path, meta["fingerprint"], int(meta["n_docs"]), int(meta["n_tokens"]), st.st_size, st.st_mtime)


def read_store(path: Path, fingerprint: str | None = None) -> tuple[Corpus, str]:
    """Load and validate a store file: (corpus, write_id). Raises `CorruptStore`, or `OSError` when the file cannot
    be opened (FileNotFoundError when it does not exist)."""
    path = Path(path)
    try:
        with open(path, "rb") as f, _npz(f) as z:
            meta = _check_meta(json.loads(bytes(z["meta"]).decode("utf-8")), path, fingerprint)
            tokens, offsets, added, sa = z["tokens"], z["offsets"], z["added"], z["sa"]
    except (FileNotFoundError, PermissionError, IsADirectoryError, CorruptStore):
        raise
    except Exception as e:  # a truncated zip, a bad CRC, garbage, missing members: all mean "corrupt"
        raise CorruptStore(f"unreadable ({type(e).__name__}: {e})") from e
    t, d = len(tokens), len(offsets) - 1
    ok = (
        tokens.dtype == np.int32 and offsets.dtype == np.int64 and added.dtype == np.float64
        and sa.dtype == np.int32 and tokens.ndim == offsets.ndim == added.ndim == sa.ndim == 1
        and d >= 0 and len(added) == d and len(sa) == t and offsets[0] == 0 and offsets[-1] == t
        and bool(np.all(np.diff(offsets) >= 2))
    )  # fmt: skip
    if ok and t:
        ok = (
            bool(np.all(tokens[offsets[1:] - 1] == SEP))
            and int(np.count_nonzero(tokens == SEP)) == d
            and int(tokens.min()) >= SEP
            and int(sa.min()) >= 0
            and int(sa.max()) < t
        )
    if not ok or meta.get("n_docs") != d or meta.get("n_tokens") != t - d:
        raise CorruptStore("its arrays are inconsistent")
    return Corpus(tokens, offsets, added, sa), str(meta.get("write_id", ""))


def _read_write_id(path: Path) -> str | None:
    """The write_id of the file on disk (None when missing, "" when unreadable)."""
    try:
        with open(path, "rb") as f, _npz(f) as z:
            return str(json.loads(bytes(z["meta"]).decode("utf-8")).get("write_id", ""))
    except FileNotFoundError:
        return None
    except Exception:
        return ""


class SuffixStore:
    """The persistent global store for one tokenizer: documents (past outputs) and their suffix array.

    Args:
        path: the store file; `store_path(data_dir, fingerprint)` gives the standard one.
        fingerprint: the tokenizer's `VocabInfo.fingerprint` (recommended). A file for another tokenizer is set
            aside. When None, the file name's 16 hex digits stand for it (`store_path` names files that way).
        max_tokens: bound on the document tokens held; the oldest documents are evicted first.
        lock_timeout: seconds to wait for another process's save before giving up (with a warning).

    Nothing is read at construction: the file is loaded on the first access to `corpus` (the drafter's first
    propose), in a few ms for 300k tokens. Documents given to `add` are searchable at once and written by `save`.
    Bad files and failed saves emit a `SuffixStoreWarning` and never raise.
    """

    def __init__(
        self,
        path: Path,
        *,
        fingerprint: str | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        lock_timeout: float = LOCK_TIMEOUT_S,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.max_tokens = max_tokens
        self.lock_timeout = lock_timeout
        self._corpus: Corpus | None = None  # None = not loaded yet
        self._disk_id: str | None = None  # write_id of the file version `_corpus` was built from (None = no file)
        self._pending: list[tuple[np.ndarray, float]] = []  # added since the last save, oldest first
        self._filelock: filelock.FileLock | None = None
        self._loader: threading.Thread | None = None  # `preload`'s thread
        self._loaded: tuple[Corpus, str | None] | None = None  # what it read
        self._deferred: list[str] = []  # its warnings, emitted by the thread that collects its result

    # -- reading ------------------------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._corpus is not None

    @property
    def pending(self) -> int:
        """Documents added and not saved yet."""
        return len(self._pending)

    @property
    def corpus(self) -> Corpus:
        """The documents on disk plus those added since, loading the file on first access (or waiting for
        `preload`'s thread)."""
        if self._corpus is None:
            base, self._disk_id = self._join_preload() or self._load()
            self._corpus = self._merge(base, self._pending)
        return self._corpus

    def preload(self) -> None:
        """Start reading the file in a background thread, e.g. while the models load and the prompt is evaluated;
        `corpus` waits for it, so drafts stay deterministic. Warnings are emitted when the result is collected.
        Idempotent; does nothing once loaded."""
        if self._corpus is not None or self._loader is not None:
            return

        def run() -> None:
            self._loaded = self._load(warn=self._deferred.append)

        self._loader = threading.Thread(target=run, name="specdec-suffix-load", daemon=True)
        self._loader.start()

    def _join_preload(self) -> tuple[Corpus, str | None] | None:
        """Wait for `preload`'s thread; its result (None when there was none), its warnings emitted here."""
        if self._loader is None:
            return None
        self._loader.join()
        loaded, self._loader, self._loaded = self._loaded, None, None
        for message in self._deferred:
            self._warn(message)
        self._deferred.clear()
        return loaded

    def _load(self, warn: Callable[[str], None] | None = None) -> tuple[Corpus, str | None]:
        """Read the file; set it aside when corrupt. Never raises."""
        warn = warn or self._warn
        try:
            corpus, write_id = read_store(self.path, self.fingerprint)
            return corpus, write_id
        except FileNotFoundError:
            return Corpus.empty(), None
        except CorruptStore as e:
            return self._set_aside(e, warn)
        except OSError as e:
            warn(f"Cannot read the suffix store {self.path}: {reason(e)}; drafting without it this run. "
                       f"Fix its permissions or delete it (specdec cache clear).")  # fmt: skip
            return Corpus.empty(), ""

    def _set_aside(self, err: CorruptStore, warn: Callable[[str], None]) -> tuple[Corpus, str | None]:
        """Rename a corrupt file to <name>.corrupt-<timestamp> (under the lock, after re-checking it)."""
        try:
            with self._lock():
                try:
                    return read_store(self.path, self.fingerprint)  # another process replaced it meanwhile
                except CorruptStore as again:
                    err = again
                except FileNotFoundError:
                    return Corpus.empty(), None
                aside = files.set_aside(self.path)
        except Exception as e:  # OSError, filelock.Timeout
            warn(f"The suffix store {self.path} is unusable ({err}) and could not be moved aside "
                       f"({reason(e)}); drafting without it this run. Delete it (specdec cache clear).")  # fmt: skip
            return Corpus.empty(), ""
        warn(f"The suffix store {self.path} was unusable ({err}); moved it to {aside.name} "
             f"and started a fresh store.")  # fmt: skip
        return Corpus.empty(), None

    def documents(self) -> Iterator[np.ndarray]:
        """Every document (int32 [n_i]), oldest first."""
        return self.corpus.documents()

    # -- writing ------------------------------------------------------------------------------------------------

    def add(self, tokens: np.ndarray) -> None:
        """Add one document (int32 [n] token ids >= 0). Documents shorter than 2 tokens teach nothing and are
        skipped; longer than `max_tokens`, cut to the first `max_tokens`. Searchable at once when loaded (merged
        into the suffix array, not rebuilt); written by `save`. Raises ValueError on ids < 0."""
        self.extend([tokens])

    def extend(self, docs: Sequence[np.ndarray]) -> None:
        """Add several documents, oldest first, with one merge (see `add`)."""
        now = time.time()
        items = []
        for tokens in docs:
            doc = np.array(tokens, dtype=np.int32).ravel()[: self.max_tokens]  # a copy: callers reuse arrays
            if len(doc) >= 2:
                if int(doc.min()) < 0:
                    raise ValueError("token ids must be >= 0")
                items.append((doc, now))
        self._pending.extend(items)
        if self._corpus is not None and items:
            self._corpus = self._merge(self._corpus, items)

    def _merge(self, base: Corpus, items: Sequence[tuple[np.ndarray, float]]) -> Corpus:
        if items:
            base = base.with_documents([d for d, _ in items], [t for _, t in items])
        return base.evicted(self.max_tokens)

    def save(self) -> bool:
        """Write the documents added since the last save; True on success (or nothing to do).

        Under the file lock: re-read the file if another process wrote it since we read it, append our new
        documents, evict, write atomically (temp file, fsync, os.replace). A failure (read-only directory, disk
        full, lock timeout) emits a `SuffixStoreWarning`, keeps the documents in memory, and returns False.
        """
        if not self._pending:
            return True
        if self._loader is not None:
            _ = self.corpus  # collect `preload`'s result first: one reader of the file at a time
        try:
            files.private_dir(self.path.parent)
            with self._lock():
                self._remove_orphans()
                on_disk = _read_write_id(self.path)
                if self._corpus is not None and on_disk == self._disk_id and on_disk != "":
                    merged = self._corpus  # nobody wrote since we read: memory already holds disk + pending
                else:  # another process wrote (or cleared) the file: append our documents to what is there now
                    try:
                        base, _ = read_store(self.path, self.fingerprint)
                    except FileNotFoundError:
                        base = Corpus.empty()
                    except CorruptStore as e:
                        base, _ = self._set_aside(e, self._warn)
                    merged = self._merge(base, self._pending)
                write_id = uuid.uuid4().hex
                self._write(merged, write_id)
        except Exception as e:  # OSError (EROFS, EACCES, ENOSPC), filelock.Timeout
            what = "another specdec process holds its lock" if isinstance(e, filelock.Timeout) else reason(e)
            self._warn(f"Could not save the suffix store {self.path} ({what}); this run's output was not learned. "
                       f"Make {self.path.parent} writable (or free disk space), or set SPECDEC_HOME to a writable "
                       f"directory.")  # fmt: skip
            return False
        self._corpus, self._disk_id, self._pending = merged, write_id, []
        return True

    def clear(self) -> None:
        """Delete the store file (under the lock) and forget everything in memory. Raises OSError on failure."""
        if self._loader is not None:
            self._loader.join()
            self._loader, self._loaded = None, None
            self._deferred.clear()
        if self.path.exists():
            with self._lock():
                self.path.unlink(missing_ok=True)
        self._corpus, self._disk_id, self._pending = None, None, []

    def close(self) -> None:
        """Save pending documents (warnings, never exceptions)."""
        self.save()

    def info(self) -> StoreInfo:
        """The file's summary (see `read_info`)."""
        return read_info(self.path)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _write(self, corpus: Corpus, write_id: str) -> None:
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": self._fingerprint_to_write(),
            "window": WINDOW,
            "n_docs": corpus.n_docs,
            "n_tokens": corpus.n_tokens,
            "write_id": write_id,
            "updated": time.time(),
        }
        with files.staged(self.path) as tmp, open(tmp, "wb") as f:
            np.savez(
                f,
                meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8),
                tokens=cast(np.ndarray, corpus.tokens),  # (a store's corpus is never packed)
                offsets=corpus.offsets,
                added=corpus.added,
                sa=corpus.sa,
            )

    def _fingerprint_to_write(self) -> str:
        """The longest fingerprint known: the one given, else the file's, else the file name's 16 hex digits."""
        known = [f for f in (self.fingerprint, _fingerprint_from_disk(self.path)) if f]
        return max(known, key=len) if known else self.path.name.removesuffix(SUFFIX)

    def _lock(self) -> filelock.FileLock:
        """The store's lock (`<store>.lock`, 0o600). One reentrant instance per store: a second FileLock on the same
        file in the same process would wait for the first."""
        if self._filelock is None:
            self._filelock = files.lock(f"{self.path}.lock", self.lock_timeout)
        return self._filelock

    def _remove_orphans(self) -> None:
        """Temp files left by a killed writer (we hold the lock, so no write is in progress)."""
        files.remove_temporaries(self.path.parent, self.path.name)

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, SuffixStoreWarning, stacklevel=3)


def _fingerprint_from_disk(path: Path) -> str | None:
    try:
        return read_info(path).fingerprint
    except Exception:
        return None
