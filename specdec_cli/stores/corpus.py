"""The corpus index of `specdec learn`: the user's code and documents, tokenized, for drafting (REST-style).

REST (He, Zhong, Cai, Lee, He; "REST: Retrieval-Based Speculative Decoding", NAACL 2024) drafts from a datastore:
the corpus's tokens in one array, a suffix array over it, the longest match of the context's suffix found by
binary search, its continuations weighed by frequency. The index here is exactly that, and it is read through the
suffix store's `Corpus` (`specdec_cli.stores.suffix_index`: `longest_match`, `walk`), over memory maps.

One corpus per name and tokenizer, in `<data_dir>/corpus/<fingerprint[:16]>/<name>/`:

    manifest.json          {"format": "specdec-corpus", "version": 2, "fingerprint", "name", "roots": [abs paths],
                            "generation": <hex>, "token_bytes": 3 | 4, "n_tokens", "updated", "files": [[path,
                            size, mtime_ns, start, n_tokens], ...]} (file i's tokens are tokens[start : start +
                            n_tokens], then the separator)
    tokens-<generation>.be24   the files' tokens, each followed by the separator, big-endian unsigned in 3 bytes
                               (every id below 0xFFFFFF; the separator is 0xFFFFFF), or in 4 bytes (`.be32`, the
                               separator 0xFFFFFFFF) for a vocabulary wider than that: big-endian, so the bytes
                               compare as the tokens do and lookups bisect the map itself
    sa-<generation>.i32        int32 native [T]: the suffix array (`suffix_array`: sorted by their first 128 tokens)

7 bytes of index per corpus token (3 + 4; 8 with 4-byte tokens), one separator per file, and the manifest (~100 bytes
a file). Version 1 (4-byte tokens, no "token_bytes") is read as it was, and `specdec learn` rewrites it as version 2
(its tokens kept, nothing tokenized again); any other version is set aside, as a damaged index is. A writer
(`write`) holds `<name>.lock` beside the
directory, writes a new generation's two arrays under new names, then the manifest (each atomically:
`specdec_cli.files.staged`), then deletes the old generations' arrays, best effort: a reader that mapped them keeps
its maps (POSIX unlinks a mapped file; Windows refuses, and the file stays until a later write). An unreadable
manifest or arrays that disagree with it: the directory is renamed `<name>.corrupt-<timestamp>` with a one-line
`CorpusWarning`, as the other stores do, and drafting goes on without it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from specdec_cli import files
from specdec_cli.errors import reason
from specdec_cli.stores.suffix_index import SEP, WINDOW, Corpus, PackedTokens, _be_bytes, _concat, suffix_array

FORMAT = "specdec-corpus"
VERSION = 2
READS = (1, 2)  # version 1: 4-byte tokens (`.be32`), no "token_bytes"; rewritten as version 2 by the next learn
MANIFEST = "manifest.json"
DEFAULT_MAX_TOKENS = 20_000_000  # the size cap of one corpus: 140 MB of index
LOCK_TIMEOUT_S = 30.0
BYTES_PER_TOKEN = 7  # tokens (3) + suffix array (4), for a vocabulary below 0xFFFFFF ids
_WIDE = 0xFFFFFF  # an id at or above this needs 4-byte tokens


class CorpusWarning(UserWarning):
    """A corpus could not be read and was set aside (or not); drafting goes on without it."""


class CorruptCorpus(Exception):
    """The directory is not a readable corpus of this version and tokenizer (the message says why)."""


def root_dir(data_dir: Path) -> Path:
    """Where every corpus lives: one folder per tokenizer under it."""
    return Path(data_dir) / "corpus"


def tokenizer_dir(data_dir: Path, fingerprint: str) -> Path:
    """The corpora of the tokenizer with vocabulary `fingerprint` (`VocabInfo.fingerprint`)."""
    return root_dir(data_dir) / fingerprint[:16]


_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str) -> str:
    """A corpus name from a folder's name: letters, digits, '.', '_' and '-' ("my repo" -> "my_repo")."""
    name = _NAME.sub("_", text).strip("._") or "corpus"
    return name[:64]


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One learnt file: its absolute path, the size and mtime it had when tokenized, and its tokens' place."""

    path: str
    size: int
    mtime_ns: int
    start: int
    n_tokens: int

    def to_list(self) -> list:
        return [self.path, self.size, self.mtime_ns, self.start, self.n_tokens]


@dataclass(frozen=True, slots=True)
class CorpusInfo:
    """What `specdec learn --list` and `specdec cache stats` show of one corpus (from its manifest only)."""

    name: str
    directory: Path
    fingerprint: str
    roots: tuple[str, ...]
    n_files: int
    n_tokens: int
    size_bytes: int
    updated: float


def _check_manifest(meta: object, directory: Path) -> dict:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCorpus("not a specdec corpus")
    if meta.get("version") not in READS:
        raise CorruptCorpus(
            f"format version {meta.get('version')} (this specdec reads versions {', '.join(map(str, READS))})"
        )
    if meta.get("token_bytes", 4) not in (3, 4) or (meta["version"] == 1 and "token_bytes" in meta):
        raise CorruptCorpus(f"{meta.get('token_bytes')}-byte tokens")
    fp = meta.get("fingerprint")
    if not isinstance(fp, str) or not fp or directory.parent.name != fp[:16]:
        raise CorruptCorpus("its tokenizer does not match its folder")
    if not isinstance(meta.get("files"), list) or not isinstance(meta.get("generation"), str):
        raise CorruptCorpus("its manifest lists no files")
    return meta


def read_manifest(directory: Path) -> dict:
    """A corpus's manifest, checked. Raises FileNotFoundError (no corpus there), CorruptCorpus, OSError."""
    path = Path(directory) / MANIFEST
    text = path.read_bytes()
    try:
        meta = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCorpus(f"unreadable manifest ({type(e).__name__})") from e
    return _check_manifest(meta, Path(directory))


def entries(meta: dict) -> list[FileEntry]:
    """The manifest's files. Raises CorruptCorpus when one is malformed."""
    try:
        return [FileEntry(str(p), int(s), int(m), int(a), int(n)) for p, s, m, a, n in meta["files"]]
    except (TypeError, ValueError) as e:
        raise CorruptCorpus("a malformed file entry in its manifest") from e


def token_bytes(meta: dict) -> int:
    """Bytes a token in the manifest's token array: 3 or 4 (version 1: 4)."""
    return int(meta.get("token_bytes", 4))


def _arrays(directory: Path, generation: str, width: int = 3) -> tuple[Path, Path]:
    return directory / f"tokens-{generation}.be{8 * width}", directory / f"sa-{generation}.i32"


def info(directory: Path) -> CorpusInfo:
    """The summary of the corpus in `directory`. Raises FileNotFoundError, CorruptCorpus, OSError."""
    directory = Path(directory)
    meta = read_manifest(directory)
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    return CorpusInfo(
        str(meta.get("name", directory.name)),
        directory,
        meta["fingerprint"],
        tuple(meta.get("roots", ())),
        len(meta["files"]),
        int(meta.get("n_tokens", 0)),
        size,
        float(meta.get("updated", 0.0)),
    )


def list_corpora(data_dir: Path, fingerprint: str | None = None) -> list[Path]:
    """The corpus folders (of one tokenizer, or of every one), sorted; set-aside ones are not listed, nor is a folder
    with no manifest (a forgotten corpus whose arrays a reader still mapped: `remove`)."""
    base = root_dir(data_dir)
    tok_dirs = (
        [tokenizer_dir(data_dir, fingerprint)]
        if fingerprint
        else (sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else [])
    )
    out = []
    for t in tok_dirs:
        if t.is_dir():
            out += sorted(
                p for p in t.iterdir() if p.is_dir() and ".corrupt-" not in p.name and (p / MANIFEST).exists()
            )
    return out


def set_aside_corrupt(directory: Path, err: Exception) -> None:
    """Rename an unusable corpus folder to `<name>.corrupt-<timestamp>` and say so (`CorpusWarning`)."""
    try:
        with files.lock(lock_path(directory), LOCK_TIMEOUT_S):
            aside = files.set_aside(directory)
    except Exception as e:  # OSError, filelock.Timeout
        warnings.warn(
            f"The corpus {directory} is unusable ({err}) and could not be moved aside ({reason(e)}); "
            f"drafting without it. Delete it (specdec learn --forget {directory.name}).",
            CorpusWarning,
            stacklevel=3,
        )
        return
    warnings.warn(
        f"The corpus {directory} was unusable ({err}); moved it to {aside.name}. Learn it again (specdec learn PATH).",
        CorpusWarning,
        stacklevel=3,
    )


def lock_path(directory: Path) -> Path:
    """A corpus's writer lock, beside its folder (so setting the folder aside keeps the lock)."""
    return Path(directory).parent / f"{Path(directory).name}.lock"


# -- reading -----------------------------------------------------------------------------------------------------


class Mapped:
    """One corpus, memory-mapped: `corpus` is a suffix-index `Corpus` over the maps (lookups bisect the token map
    itself: its bytes are big-endian). `files` are the manifest's entries, `generation` the arrays' id."""

    def __init__(self, directory: Path, fingerprint: str | None = None) -> None:
        """Raises FileNotFoundError, CorruptCorpus, OSError."""
        self.directory = Path(directory)
        meta = read_manifest(self.directory)
        if fingerprint is not None and not meta["fingerprint"].startswith(fingerprint[:16]):
            raise CorruptCorpus("it belongs to another tokenizer")
        self.meta = meta
        self.name = str(meta.get("name", self.directory.name))
        self.generation = meta["generation"]
        self.files = entries(meta)
        self.version = int(meta["version"])
        w = token_bytes(meta)
        tok_path, sa_path = _arrays(self.directory, self.generation, w)
        t = sum(e.n_tokens + 1 for e in self.files)
        self._maps: list[mmap.mmap] = []
        if t == 0:
            self.corpus = Corpus.empty()
            return
        tok_map, sa_map = self._map(tok_path, w * t), self._map(sa_path, 4 * t)
        # [T] read as int32, the separator as -1: big-endian int32 over the map, or the 3-byte ids unpacked as read
        tokens = np.frombuffer(tok_map, dtype=">i4") if w == 4 else PackedTokens(cast(bytes, tok_map), 3)
        sa = np.frombuffer(sa_map, dtype=np.int32)  # [T]
        starts = np.array([e.start for e in self.files] + [t], dtype=np.int64)
        ends = starts[1:] - 1  # each file's separator
        if (
            np.any(np.diff(starts) != np.array([e.n_tokens + 1 for e in self.files]))
            or starts[0] != 0
            or np.any(tokens[ends] != SEP)
        ):
            raise CorruptCorpus("its tokens disagree with its manifest")
        lo, hi = (int(sa[0]), int(sa[-1])) if t < 4 else (int(sa.min()), int(sa.max()))
        if lo < 0 or hi >= t:
            raise CorruptCorpus("its suffix array points outside its tokens")
        corpus = Corpus(tokens, starts, np.zeros(len(self.files)), sa, width=w)
        corpus._buf = cast(
            bytes, tok_map
        )  # (a map slices as bytes do) the map's bytes are the lookups' big-endian token string: nothing is copied
        self.corpus = corpus

    def _map(self, path: Path, size: int) -> mmap.mmap:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise CorruptCorpus(f"{path.name} is {os.fstat(f.fileno()).st_size} bytes, its manifest says {size}")
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(m)
        return m

    @property
    def n_tokens(self) -> int:
        return sum(e.n_tokens for e in self.files)

    def segment(self, e: FileEntry) -> np.ndarray:
        """int32 [n] the tokens of one learnt file (a native copy)."""
        return self.corpus.tokens[e.start : e.start + e.n_tokens].astype(np.int32)


def load(directory: Path, fingerprint: str | None = None) -> Mapped | None:
    """The corpus in `directory`, mapped; None when there is none; a corrupt one is set aside (a `CorpusWarning`)
    and None returned. Never raises for a bad corpus."""
    try:
        return Mapped(directory, fingerprint)
    except FileNotFoundError:
        return None
    except CorruptCorpus as e:
        set_aside_corrupt(Path(directory), e)
        return None
    except (OSError, ValueError) as e:
        warnings.warn(
            f"Cannot read the corpus {directory}: {reason(e)}; drafting without it.", CorpusWarning, stacklevel=2
        )
        return None


class CorpusSet:
    """The corpora one drafter reads: every corpus of a tokenizer (`name` None) or the one named. `refresh` maps
    the ones written since (a manifest's mtime and size changed: `specdec serve --learn` learning in the background),
    so a generation that starts after a `learn` finished drafts from it."""

    def __init__(self, data_dir: Path, fingerprint: str, name: str | None = None) -> None:
        self.base = tokenizer_dir(data_dir, fingerprint)
        self.fingerprint = fingerprint
        self.name = name
        self._loaded: dict[Path, tuple[tuple[int, int], Mapped | None]] = {}
        self.mapped: list[Mapped] = []

    def refresh(self) -> list[Mapped]:
        """The corpora now on disk, mapped (cheap when nothing changed: one stat per corpus)."""
        if not self.base.is_dir():
            self._loaded.clear()
            self.mapped = []
            return self.mapped
        dirs = (
            [self.base / self.name]
            if self.name
            else sorted(p for p in self.base.iterdir() if p.is_dir() and ".corrupt-" not in p.name)
        )
        loaded = {}
        for d in dirs:
            try:
                st = (d / MANIFEST).stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            old = self._loaded.get(d)
            loaded[d] = old if old is not None and old[0] == key else (key, load(d, self.fingerprint))
        self._loaded = loaded
        self.mapped = [m for _, m in loaded.values() if m is not None and m.corpus.n_tokens]
        return self.mapped


# -- writing -----------------------------------------------------------------------------------------------------


def write(
    directory: Path,
    *,
    fingerprint: str,
    name: str,
    roots: Sequence[str],
    segments: Sequence[np.ndarray],
    entries_: Sequence[tuple[str, int, int]],
    extra: dict | None = None,
) -> int:
    """Write a corpus: `segments[i]` (int32 [n_i] token ids >= 0) is the file `entries_[i]` = (path, size,
    mtime_ns). Builds the suffix array, writes a new generation (3-byte tokens unless an id is >= 0xFFFFFF) and
    its manifest, deletes the old generation. The caller holds `lock_path(directory)`. Returns the bytes on disk.
    Raises OSError."""
    directory = Path(directory)
    files.private_dir(directory)
    tokens, starts = _concat(segments)  # [T] each file's tokens then -1; [D+1] where each starts
    sa = suffix_array(tokens, WINDOW)
    width = 4 if tokens.size and int(tokens.max()) >= _WIDE else 3
    generation = uuid.uuid4().hex[:12]
    tok_path, sa_path = _arrays(directory, generation, width)
    with files.staged(tok_path) as tmp:
        Path(tmp).write_bytes(_be_bytes(tokens, width))
    with files.staged(sa_path) as tmp:
        sa.astype(np.int32).tofile(tmp)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint,
        "name": name,
        "roots": list(roots),
        "generation": generation,
        "token_bytes": width,
        "n_tokens": int(tokens.size - len(segments)),
        "updated": time.time(),
        "files": [
            FileEntry(p, s, m, int(a), len(seg)).to_list()
            for (p, s, m), a, seg in zip(entries_, starts[:-1], segments, strict=False)
        ],
        **(extra or {}),
    }
    files.write_atomic(directory / MANIFEST, json.dumps(meta))
    keep = {tok_path.name, sa_path.name, MANIFEST}
    for p in directory.iterdir():  # the old generations, and temporaries a killed writer left
        if p.name not in keep and p.is_file():
            _remove_old(p)
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _remove_old(path: Path) -> None:
    """Delete a file of an old generation, best effort: one a reader still maps stays (Windows refuses to delete a
    mapped file: PermissionError) and goes at a later write, when no reader maps it any more."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def delete(directory: Path) -> None:
    """Forget a whole corpus (under its lock: `remove`). Raises OSError."""
    directory = Path(directory)
    with files.lock(lock_path(directory), LOCK_TIMEOUT_S):
        remove(directory)
    if not directory.exists():
        lock_path(directory).unlink(missing_ok=True)


def remove(directory: Path) -> None:
    """Delete a corpus folder, the caller holding its lock: the manifest first (then no reader or list sees a
    corpus there), then the rest, best effort: arrays a reader still maps stay (Windows refuses to delete them) in a
    folder without a manifest, and go when that name is learnt again (`write`). Raises OSError when the manifest
    cannot be deleted."""
    (Path(directory) / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
