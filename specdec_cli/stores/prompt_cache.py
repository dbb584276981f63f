"""The prompt cache: KV states saved across runs, restored for the longest shared token prefix.

Each `specdec run` is a new process, so a prompt that was evaluated before is evaluated again from scratch (slow on a
CPU for a long prompt). Like llama.cpp's `--prompt-cache FILE` (tools/main: load the session file,
keep the matching token prefix, `llama_memory_seq_rm` the rest) and llama-cpp-python's `LlamaDiskCache`, this saves
the KV state of sequence 0 after a prefill and, on a later prompt that shares a long enough token prefix with a saved
one, restores it and truncates it to the shared prefix; the caller evaluates only the rest:

    n_restored, ms = cache.restore(backend, context)   # backend.tokens == context[:n_restored]
    sync(backend, context)                              # evaluates context[n_restored:]
    cache.save(backend)                                 # after the prefill

Keying: a state is restored only into the thing it was made by. The key is the model file's identity (real path,
size, mtime, sha256 of its first MiB) plus `backend.state_key()` (llama.cpp build and system info, n_ctx, n_batch,
K/V types, flash attention, RoPE; not threads nor offload). Entries of one key are found by file name; among them
the one sharing the longest token prefix with the new context wins, if it shares at least `min_tokens`.

On-disk format (directory $SPECDEC_PROMPT_CACHE, else `config.cache_dir()/prompts`, 0o700; every file 0o600):

    <key16>-<tok16>.state   llama.cpp's sequence-state file (`LlamaBackend.save_state`): magic, version, n_tokens,
                            int32 tokens [n], the KV cells; written and read by llama.cpp in a streaming way
    <key16>-<tok16>.json    the header: {"format": "specdec-prompt-cache", "version": 1, "key": {...},
                            "key_digest": <blake2b-128 hex of the key's canonical JSON>, "model": <file name>,
                            "n_tokens", "tokens": [ids], "tokens_digest": <blake2b-128 hex of int32 tokens>,
                            "state_bytes", "state_blake2b": <blake2b-256 hex of the .state file>, "created"}
    .lock                   `filelock` lock: every read of a state and every write or deletion happens under it

key16/tok16 are the first 16 hex digits of key_digest/tokens_digest. The header is written last (temp file, fsync,
`os.replace`): an entry exists only once its header does, so a crash mid-write leaves temp files or a state without
header, which the next save removes. A restore checks the header (format, key, digests), the state's size and
checksum, then the token list llama.cpp read back from the state; a bad, foreign or truncated entry is deleted
with a `PromptCacheWarning` and never loaded.

Bounded: after each save, entries are evicted least recently used first (the header's mtime, touched on every
restore) until the directory holds at most `max_bytes`. A new state that shares all but an eighth of its tokens
(`NEW_SHARE`) with a saved one, as a prefix, is not written (the saved one is touched): an editor's completion (the
last one's state with its last few hundred tokens changed) and a conversation's next turn are not written again, a
whole state on the serving loop's thread each time, until an eighth of them is new, so a restart evaluates at most
an eighth of a context again. Saved states that are a prefix of a new one written are replaced by it. A recurrent or
hybrid model's state (`Backend.rollback` not "kv") cannot be cut, so for it only a state that is a whole prefix of the
context is restored, and the engine saves the prompt's state after the prefill rather than the output's.

Nothing here raises for a bad file, a full disk or a busy lock: it warns (`PromptCacheWarning`) and the generation
goes on with a cold prefill.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import filelock
import numpy as np

from specdec_cli import files
from specdec_cli.errors import CacheTrimError, StateError, reason
from specdec_cli.models.backend import common_prefix

FORMAT = "specdec-prompt-cache"
VERSION = 1
DEFAULT_MAX_BYTES = 4 * 1024**3  # 4 GiB
DEFAULT_MIN_TOKENS = 32  # a shorter shared prefix is cheaper to evaluate than to look up and load
NEW_SHARE = 1 / 8  # a state is written only when more than this share of its tokens is in no saved entry's prefix
LOCK_TIMEOUT_S = 10.0
HEAD_BYTES = 1 << 20  # the model file's identity hashes its first MiB (GGUF header, metadata, first tensors)
MAX_HEADER_BYTES = 64 << 20  # a header larger than this is not one of ours
_CHUNK = 1 << 20


class PromptCacheWarning(UserWarning):
    """A prompt-cache entry was unusable (deleted) or could not be written; the run goes on with a cold prefill."""


class StatefulBackend(Protocol):
    """What the prompt cache needs from a backend (`LlamaBackend` implements it; tests use a fake)."""

    path: str

    @property
    def tokens(self) -> np.ndarray:
        """int32 [n]: the tokens held in the KV cache."""
        ...

    def truncate(self, n: int) -> None: ...

    def state_key(self) -> dict[str, str | int]:
        """JSON-serialisable: everything a saved state depends on besides the model file and the tokens."""
        ...

    def save_state(self, path: str | Path) -> int:
        """Write the KV state and token list to `path`; the bytes written. Raises StateError."""
        ...

    def load_state(self, path: str | Path) -> int:
        """Replace the KV cache by the state in `path`; the tokens restored. Raises StateError (cache left empty)."""
        ...


def _whole_only(backend: StatefulBackend) -> bool:
    """A backend whose state cannot be cut at any position (`Backend.rollback` not "kv": a recurrent or hybrid
    model): its saved states are restored only when they are a whole prefix of the context, never loaded then
    trimmed, and a longer state does not stand in for its prefixes."""
    return getattr(backend, "rollback", "kv") != "kv"


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One entry as `PromptCache.stats` sees it.

    Attributes:
        name: the file stem (<key16>-<tok16>).
        model: the model file's name ("?" when the header is unreadable).
        n_tokens: tokens in the saved state.
        n_bytes: header + state, in bytes on disk.
        last_used: last save or restore (Unix seconds).
        problem: why the entry is unusable ("" when it looks fine; the checksum is not verified here).
    """

    name: str
    model: str
    n_tokens: int
    n_bytes: int
    last_used: float
    problem: str = ""


@dataclass(frozen=True, slots=True)
class PromptCacheStats:
    """The cache directory's summary: `entries` most recently used first, `n_bytes` = every entry and stray file."""

    directory: Path
    max_bytes: int
    entries: tuple[EntryInfo, ...]
    n_bytes: int


class _Corrupt(Exception):
    """An entry's header or state is unusable (the message says why)."""


@dataclass(frozen=True, slots=True)
class _Entry:
    header: Path
    key: dict
    key_digest: str
    model: str
    tokens: np.ndarray  # int32 [n]
    state_bytes: int
    state_blake2b: str

    @property
    def state(self) -> Path:
        return self.header.with_suffix(".state")


def default_directory() -> Path:
    """$SPECDEC_PROMPT_CACHE, else `config.cache_dir()/prompts` ($SPECDEC_CACHE/prompts, else
    ~/.cache/specdec/prompts)."""
    from specdec_cli.config import cache_dir

    if value := os.environ.get("SPECDEC_PROMPT_CACHE"):
        return Path(value).expanduser()
    return cache_dir() / "prompts"


def key_digest(key: dict) -> str:
    """blake2b-128 hex of the key's canonical JSON (sorted keys, no spaces)."""
    canon = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canon.encode("utf-8"), digest_size=16).hexdigest()


def tokens_digest(tokens: np.ndarray) -> str:
    """blake2b-128 hex of the tokens as little-endian int32."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).hexdigest()


_identities: dict[tuple[str, int, int], dict] = {}


def model_identity(path: str | Path) -> dict[str, str | int]:
    """The model file's identity: real path, size, mtime (ns) and sha256 of its first MiB (cached per process).
    Raises OSError when the file cannot be read."""
    real = os.path.realpath(path)
    st = os.stat(real)
    memo = (real, st.st_size, st.st_mtime_ns)
    if memo not in _identities:
        with open(real, "rb") as f:
            head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
        _identities[memo] = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_sha256": head}
    return dict(_identities[memo])


def _file_blake2b(path: Path) -> tuple[int, str]:
    """(size in bytes, blake2b-256 hex), read in 1 MiB chunks so memory stays flat."""
    h = hashlib.blake2b(digest_size=32)
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _read_header(path: Path) -> _Entry:
    """Parse and validate a header file. Raises _Corrupt, or OSError (FileNotFoundError when it vanished)."""
    size = path.stat().st_size
    if size > MAX_HEADER_BYTES:
        raise _Corrupt(f"its header is {size} bytes")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Corrupt(f"its header is not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _Corrupt("its header is not a specdec prompt-cache header")
    if doc.get("version") != VERSION:
        raise _Corrupt(f"format version {doc.get('version')!r} (this specdec reads version {VERSION})")
    key, toks = doc.get("key"), doc.get("tokens")
    ok = (
        isinstance(key, dict) and isinstance(toks, list) and all(type(t) is int and 0 <= t < 2**31 for t in toks)
        and doc.get("n_tokens") == len(toks) and type(doc.get("state_bytes")) is int and doc["state_bytes"] > 0
        and isinstance(doc.get("state_blake2b"), str) and isinstance(doc.get("model"), str)
    )  # fmt: skip
    if not ok or not isinstance(key, dict):  # (the second test for the type checker: `ok` holds it)
        raise _Corrupt("its header is incomplete")
    tokens = np.array(toks, dtype=np.int32)
    digest = key_digest(key)
    stem = path.name.removesuffix(".json")
    if doc.get("key_digest") != digest or not stem.startswith(digest[:16] + "-"):
        raise _Corrupt("its key does not match its name (a foreign or renamed file)")
    tdigest = tokens_digest(tokens)
    if doc.get("tokens_digest") != tdigest or stem != f"{digest[:16]}-{tdigest[:16]}":
        raise _Corrupt("its token list does not match its name")
    return _Entry(path, key, digest, doc["model"], tokens, doc["state_bytes"], doc["state_blake2b"])


class PromptCache:
    """KV states on disk, restored for the longest shared token prefix (see the module docstring).

    Args:
        directory: where entries live (created 0o700 on the first save); None = `default_directory()`.
        max_bytes: bound on the entries' total size on disk, in bytes (default 4 GiB); least recently used evicted.
        min_tokens: the shortest shared prefix worth restoring (default 32 tokens).
        lock_timeout: seconds to wait for another process's save before going on without the cache (with a warning).

    Methods never raise for bad files, I/O failures or a busy lock: they emit a `PromptCacheWarning` and act as a
    miss (restore) or a no-op (save). Raises ValueError on construction for max_bytes < 1 or min_tokens < 1.
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        lock_timeout: float = LOCK_TIMEOUT_S,
    ) -> None:
        if max_bytes < 1 or min_tokens < 1:
            raise ValueError(f"max_bytes and min_tokens must be >= 1, got {max_bytes}, {min_tokens}")
        self.directory = Path(directory) if directory is not None else default_directory()
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.lock_timeout = lock_timeout
        self._filelock: filelock.FileLock | None = None
        self.scope: str | None = None
        """Whose states these are (`specdec serve`: a digest of the client's API key): part of every entry's key, so
        one client never restores another's prompt. None: shared (one user)."""

    # -- restoring ------------------------------------------------------------------------------------------------

    def restore(self, backend: StatefulBackend, tokens: Sequence[int] | np.ndarray, *,
                align: int | None = None) -> tuple[int, float]:  # fmt: skip
        """Restore the longest prefix of `tokens` that a saved state of this backend's key holds.

        Args:
            backend: the backend whose KV cache (sequence 0) is replaced on a hit.
            tokens: int [n], the context the caller is about to evaluate (e.g. the prompt without its last token).
            align: when a strict prefix of `tokens` is restored, cut it down to a multiple of `align` tokens. With
                align = backend.n_batch, the rest is then evaluated in the same n_batch chunks as a cold prefill, so
                the logits are bit-identical to a run without the cache (llama.cpp's numerics depend on how tokens
                are batched: the rest as one odd-sized batch moves logits enough to flip near-ties), at the cost of
                up to align - 1 more tokens evaluated. None: restore the whole shared prefix (fastest; differences
                are near-ties). A restore of all of `tokens` is never cut.

        Returns:
            (n_restored, ms): on a hit, `backend.tokens == tokens[:n_restored]` with min_tokens <= n_restored <= n;
            0 on a miss (nothing saved shares min_tokens, or no more than the backend already holds): the backend is
            then untouched, except after an unusable entry (warned about), when it may be left empty. ms = wall time
            of the whole call, in milliseconds.
        """
        t0 = time.perf_counter()
        want = np.asarray(tokens, dtype=np.int32).ravel()
        if align is not None and align < 1:
            raise ValueError(f"align must be >= 1, got {align}")
        usable = len(want) >= self.min_tokens and self.directory.is_dir()
        n = self._restore(backend, want, align or 1) if usable else 0
        return n, (time.perf_counter() - t0) * 1e3

    def _restore(self, backend: StatefulBackend, want: np.ndarray, align: int) -> int:
        try:
            key = self.key(backend)
            digest = key_digest(key)
            with self._lock():
                found = []
                whole = _whole_only(backend)
                for e in self._entries(digest, key):
                    shared = min(common_prefix(e.tokens, want), len(want))
                    if whole:  # a recurrent state is used whole, never loaded then trimmed
                        found.append((shared if shared == len(e.tokens) else 0, e))
                        continue
                    found.append((shared if shared == len(want) else shared // align * align, e))
                found.sort(key=lambda se: (-se[0], len(se[1].tokens)))  # longest shared prefix, then smallest state
                held = backend.tokens
                kept = common_prefix(held, want)
                if whole and kept < len(held):
                    kept = 0  # the held state cannot be cut to its shared part: sync would start again
                for shared, entry in found:
                    if shared < self.min_tokens or shared <= kept:
                        break
                    if self._load(backend, entry, shared):
                        return shared
        except filelock.Timeout:
            self._warn(f"The prompt cache {self.directory} is locked by another specdec process; evaluating the "
                       f"prompt without it.")  # fmt: skip
        except OSError as e:
            self._warn(f"Cannot read the prompt cache {self.directory} ({reason(e)}); evaluating the prompt without "
                       f"it. Fix its permissions or run `specdec cache clear`.")  # fmt: skip
        return 0

    def _load(self, backend: StatefulBackend, entry: _Entry, shared: int) -> bool:
        """Check and load one entry, then truncate to `shared` tokens. False (entry deleted, warned) when unusable."""
        try:
            size, checksum = _file_blake2b(entry.state)
        except FileNotFoundError:
            return self._discard(entry, "its state file is missing")
        if size != entry.state_bytes:
            return self._discard(entry, f"its state file has {size} bytes, its header says {entry.state_bytes}")
        if checksum != entry.state_blake2b:
            return self._discard(entry, "its state file fails its checksum")
        try:
            backend.load_state(entry.state)
        except StateError as e:
            return self._discard(entry, e.message)
        if not np.array_equal(backend.tokens, entry.tokens):  # the state's own token list, as llama.cpp read it
            backend.truncate(0)
            return self._discard(entry, "the token list inside its state differs from its header's")
        if shared < len(entry.tokens) and _whole_only(backend):  # never reached: `_restore` asks for whole states
            backend.truncate(0)
            return False
        try:
            backend.truncate(shared)
        except CacheTrimError:  # recurrent/hybrid models: only whole states can be used
            backend.truncate(0)
            return False
        os.utime(entry.header)  # last use, for LRU eviction
        return True

    # -- saving ---------------------------------------------------------------------------------------------------

    def save(self, backend: StatefulBackend) -> int:
        """Save the backend's KV state (all of `backend.tokens`) as an entry, then evict down to `max_bytes`.

        Returns the bytes written (header + state); 0 when nothing was written: fewer than `min_tokens` tokens, a
        saved entry already holds all but `NEW_SHARE` of these tokens as a shared prefix (it is touched instead; a
        recurrent state: the same tokens), or a failure (warned about).
        """
        toks = np.array(backend.tokens, dtype=np.int32)
        if len(toks) < self.min_tokens:
            return 0
        try:
            key = self.key(backend)
            digest = key_digest(key)
            files.private_dir(self.directory)
            whole = _whole_only(backend)  # a recurrent state covers only itself, not its prefixes
            with self._lock():
                self._remove_orphans()
                entries = list(self._entries(digest, key))
                for e in entries:  # one that stands for it (a recurrent state: only the same one) is touched
                    shared = common_prefix(e.tokens, toks)
                    new = len(toks) - shared
                    if (new == 0 and len(e.tokens) == len(toks)) if whole else new <= NEW_SHARE * len(toks):
                        os.utime(e.header)
                        return 0
                header, written = self._write(backend, toks, key, digest)
                for e in entries if not whole else ():  # states that are a prefix of the new one: it covers them
                    if len(e.tokens) < len(toks) and np.array_equal(toks[: len(e.tokens)], e.tokens):
                        self._delete(e.header)
                if not self._evict(keep=header):
                    self._delete(header)
                    self._warn(f"The KV state of {len(toks)} tokens ({written:,} bytes) is larger than the prompt "
                               f"cache's cap ({self.max_bytes:,} bytes); it was not kept.")  # fmt: skip
                    return 0
        except filelock.Timeout:
            self._warn(f"The prompt cache {self.directory} is locked by another specdec process; this prompt's KV "
                       f"state was not saved.")  # fmt: skip
            return 0
        except (OSError, StateError) as e:
            self._warn(f"Could not save a KV state in the prompt cache {self.directory} ({reason(e)}); make it "
                       f"writable or free disk space.")  # fmt: skip
            return 0
        return written

    def _write(self, backend: StatefulBackend, toks: np.ndarray, key: dict, digest: str) -> tuple[Path, int]:
        """Write state then header, each to a 0o600 temp file (`files.staged`: fsync, os.replace), the state renamed
        into place first and the header last. Returns (header path, bytes)."""
        stem = f"{digest[:16]}-{tokens_digest(toks)[:16]}"
        header = self.directory / f"{stem}.json"
        state = self.directory / f"{stem}.state"
        with files.staged(header) as tmp_header, files.staged(state) as tmp_state:  # inner (state) commits first
            backend.save_state(tmp_state)  # llama.cpp writes the 0o600 file `staged` created
            size, checksum = _file_blake2b(tmp_state)
            doc = {
                "format": FORMAT,
                "version": VERSION,
                "key": key,
                "key_digest": digest,
                "model": Path(backend.path).name,
                "n_tokens": len(toks),
                "tokens": toks.tolist(),
                "tokens_digest": tokens_digest(toks),
                "state_bytes": size,
                "state_blake2b": checksum,
                "created": time.time(),
            }
            data = json.dumps(doc, separators=(",", ":")).encode("utf-8")
            tmp_header.write_bytes(data)
        return header, size + len(data)  # the entry exists from the header's rename on

    def _evict(self, keep: Path) -> bool:
        """Delete least recently used entries until the total is <= max_bytes; False if `keep` alone is too big."""
        listed = self._listing()
        total = sum(size for _, size, _ in listed)
        for header, size, _ in sorted(listed, key=lambda hsm: hsm[2]):
            if total <= self.max_bytes:
                break
            if header != keep:
                self._delete(header)
                total -= size
        return total <= self.max_bytes

    # -- inspecting and clearing ----------------------------------------------------------------------------------

    def stats(self) -> PromptCacheStats:
        """Every entry's summary, from the headers (no checksum is computed). Never raises for bad entries."""
        infos: list[EntryInfo] = []
        n_bytes = 0
        if self.directory.is_dir():
            n_bytes = sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file() and p.name != ".lock")
            for header, size, mtime in self._listing():
                stem = header.name.removesuffix(".json")
                try:
                    e = _read_header(header)
                    problem = "" if e.state.exists() else "its state file is missing"
                    infos.append(EntryInfo(stem, e.model, len(e.tokens), size, mtime, problem))
                except (_Corrupt, OSError) as err:
                    infos.append(EntryInfo(stem, "?", 0, size, mtime, str(err) if isinstance(err, _Corrupt)
                                           else reason(err)))  # fmt: skip
        infos.sort(key=lambda i: -i.last_used)
        return PromptCacheStats(self.directory, self.max_bytes, tuple(infos), n_bytes)

    def clear(self) -> int:
        """Delete every entry and stray file (under the lock). Returns the number of files deleted; raises OSError
        or filelock.Timeout when that fails."""
        if not self.directory.is_dir():
            return 0
        n = 0
        with self._lock():
            for p in self.directory.iterdir():
                if p.is_file() and p.name != ".lock":
                    p.unlink(missing_ok=True)
                    n += 1
        return n

    # -- helpers --------------------------------------------------------------------------------------------------

    def key(self, backend: StatefulBackend) -> dict:
        """The entry key for `backend`: {"model": model_identity(path), "backend": backend.state_key()}. Raises
        OSError when the model file cannot be read."""
        key = {"model": model_identity(backend.path), "backend": backend.state_key()}
        return key if self.scope is None else {**key, "scope": self.scope}

    def _entries(self, digest: str, key: dict) -> Iterator[_Entry]:
        """The valid entries of `key` (its files are named by its digest); corrupt ones are deleted with a warning."""
        for header in sorted(self.directory.glob(f"{digest[:16]}-*.json")):
            try:
                entry = _read_header(header)
            except FileNotFoundError:
                continue
            except _Corrupt as e:
                self._delete(header)
                self._warn(f"Deleted the prompt-cache entry {header.name}: {e}.")
                continue
            if entry.key == key:  # a different key with the same 64-bit prefix is another model's: left alone
                yield entry

    def _listing(self) -> list[tuple[Path, int, float]]:
        """(header, header + state bytes, header mtime) of every entry in the directory."""
        out = []
        for header in self.directory.glob("*.json"):
            try:
                st = header.stat()
            except FileNotFoundError:
                continue
            try:
                state_size = header.with_suffix(".state").stat().st_size
            except FileNotFoundError:
                state_size = 0
            out.append((header, st.st_size + state_size, st.st_mtime))
        return out

    def _discard(self, entry: _Entry, why: str) -> bool:
        self._delete(entry.header)
        self._warn(f"Deleted the prompt-cache entry {entry.header.name} ({entry.model}, {len(entry.tokens)} tokens): "
                   f"{why}. The prompt is evaluated instead.")  # fmt: skip
        return False

    @staticmethod
    def _delete(header: Path) -> None:
        """Delete an entry: its header first (so it stops existing), then its state."""
        header.unlink(missing_ok=True)
        header.with_suffix(".state").unlink(missing_ok=True)

    def _remove_orphans(self) -> None:
        """Temp files of a killed writer and states without a header (we hold the lock: no write is in progress)."""
        files.remove_temporaries(self.directory)
        for state in self.directory.glob("*.state"):
            if not state.with_suffix(".json").exists():
                state.unlink(missing_ok=True)

    def _lock(self) -> filelock.FileLock:
        """The directory's lock (`.lock`, 0o600); one reentrant instance per cache object."""
        if self._filelock is None:
            self._filelock = files.lock(self.directory / ".lock", self.lock_timeout)
        return self._filelock

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, PromptCacheWarning, stacklevel=3)
