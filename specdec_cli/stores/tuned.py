"""Settings saved by `specdec tune --save`: the best K for a model pair, a method and a machine.

`run` (and `chat`) use the saved setting when `--k` is not given; `--k auto` or `--k N` given explicitly always win.
The saved setting is either a fixed K (0..64; 0 = plain decoding was fastest) or "auto" (the adaptive controller
was best, or within `specdec_cli.measure.tune.AUTO_MARGIN` of the best fixed K, since it also adapts to prompts
the tune did not see). `lookup` returns the K, or None for "auto" and for nothing saved: both mean AdaptiveK.

The file, `config_dir()/tuned.json` (mode 0o600, written atomically: temp file, fsync, os.replace, under a file lock):

    {"version": 1,
     "settings": {
       "<target id>|<draft id or ->|<method>|<machine id>": {
         "k": 6 | "auto",
         "target": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "draft": "...gguf" | null, "method": "draft",
         "machine": {"cpu": "...", "threads": 2, "system_info_sha256": "..."},
         "speedup": 1.31, "tokens_per_s": 21.4, "plain_tokens_per_s": 16.3,   # the tune's measurements
         "prompts": ["colorsys_type_hints", ...], "max_tokens": 128, "repeats": 1, "saved_at": "2025-...Z"}}}

Keys:
    model id    "<file name>:<size in bytes>:<sha256 of the first and last MiB, 16 hex digits>". Hashing a whole
                1 GB model would cost seconds on every `run`; the ends (GGUF header + tokenizer, last tensors) and
                the size tell a re-quantised or replaced file from the one that was tuned at a glance.
    machine id  "<CPU model>|<threads>|<sha256 of llama.cpp's system info line, 12 hex digits>[|<placement>]": the
                system info names the build's CPU features and backends, so a rebuilt llama-cpp-python gets tuned
                afresh; on a build that can offload, the placement ("Vulkan0 llvmpipe (...), 29 layers offloaded",
                "CPU, 0 layers offloaded": the device and the layers that went to it) keeps a K tuned on the GPU
                from a run on the CPU.

A file that cannot be read or parsed, or an entry that does not validate, is ignored with a `TunedWarning`
(shown on stderr): a broken cache of measurements must never stop a generation. `save` sets a corrupt file aside
(`tuned.json.corrupt-<time>`) and starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from specdec_cli import files
from specdec_cli.config import config_dir
from specdec_cli.models.machine import cpu_model, default_threads

FILE_NAME = "tuned.json"
VERSION = 1
K_LIMIT = 64
_CHUNK = 1 << 20  # bytes hashed at each end of a model file
_LOCK_TIMEOUT_S = 10.0


class TunedWarning(UserWarning):
    """tuned.json could not be used (unreadable, not JSON, wrong schema); the saved setting is ignored."""


def tuned_path() -> Path:
    """config_dir()/tuned.json."""
    return config_dir() / FILE_NAME


# --------------------------------------------------------------------------------------------------------------
# Keys


def model_id(path: str | os.PathLike[str]) -> str:
    """ "<name>:<size>:<sha256(first MiB + last MiB)[:16]>" of a model file. Raises OSError if it cannot be read."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(_CHUNK))
        if size > _CHUNK:
            f.seek(max(_CHUNK, size - _CHUNK))
            h.update(f.read(_CHUNK))
    return f"{p.name}:{size}:{h.hexdigest()[:16]}"


def machine(threads: int | None, placement: str = "") -> dict[str, Any]:
    """{"cpu", "threads", "system_info", "system_info_sha256", "load_plan", "placement", "key"}: what a tuned
    setting (and a verify curve, `stores.learnt`) is valid for.

    threads: the generation threads (None = llama.cpp's default for this process, `machine.default_threads()`, as in
    `machine.describe`). placement: where the target's passes run (`models.devices.placement`: the device and the
    layers offloaded; "" on a build that cannot offload, whose keys are those of an older specdec).
    """
    from specdec_cli.models.llama import system_info

    info = system_info()
    desc: dict[str, Any] = {
        "cpu": cpu_model(),
        "threads": int(threads or default_threads()[0]),
        "system_info": info,
        "system_info_sha256": hashlib.sha256(info.encode()).hexdigest()[:12],
    }
    desc["key"] = f"{desc['cpu']}|{desc['threads']}|{desc['system_info_sha256']}"
    from specdec_cli.models import host

    plan = host.current_plan()  # how models were loaded (the AMX guard): a tune of the slow path is its own setting
    desc["load_plan"] = plan.to_dict() if plan is not None else None
    if plan is not None and not plan.extra_bufts:
        desc["key"] += "|extra-bufts-off"
    desc["placement"] = placement
    if placement:
        desc["key"] += f"|{placement}"
    return desc


def setting_key(
    target_path: str | os.PathLike[str], draft_path: str | os.PathLike[str] | None, method: str, machine_key: str
) -> str:
    """The tuned.json key of a model pair, method and machine (see the module docstring)."""
    draft = model_id(draft_path) if draft_path is not None else "-"
    return f"{model_id(target_path)}|{draft}|{method}|{machine_key}"


# --------------------------------------------------------------------------------------------------------------
# Reading


def _warn(message: str) -> None:
    warnings.warn(message, TunedWarning, stacklevel=3)


def _valid_k(k: Any) -> bool:
    return k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= K_LIMIT)


def load(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The saved settings by key ({} when there is no file). A broken file: `TunedWarning` and {}; never raises."""
    path = path or tuned_path()
    fix = f"Delete {path} or run `specdec tune --save` again to rewrite it."
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        _warn(f"Ignoring saved tune settings: cannot read {path} ({getattr(e, 'strerror', None) or e}). {fix}")
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        _warn(f"Ignoring saved tune settings: {path} is not valid JSON ({e.msg} at line {e.lineno}). {fix}")
        return {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("settings"), dict):
        _warn(f"Ignoring saved tune settings: {path} is not a version-{VERSION} tuned.json. {fix}")
        return {}
    return doc["settings"]


def lookup(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None,
    method: str,
    threads: int | None,
    placement: str = "",
) -> int | None:
    """The K `specdec tune --save` found best for this pair, method and machine; None = use AdaptiveK.

    None covers both "nothing saved" and a saved "auto". `draft_path` is None for methods without a draft model
    (ngram, suffix). `threads`: the generation threads (None = the default); `placement`: where the target's passes
    run (`machine`). Never raises for a broken tuned.json (a `TunedWarning` instead).
    """
    settings = load()
    if not settings:
        return None
    try:
        key = setting_key(target_path, draft_path, method, machine(threads, placement)["key"])
    except OSError:
        return None  # a model file that cannot be read fails to load anyway, with a better message
    entry = settings.get(key)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not _valid_k(entry.get("k")):
        _warn(
            f"Ignoring the saved tune setting for {Path(target_path).name} ({method}) in {tuned_path()}: "
            f'its "k" must be "auto" or a whole number 0..{K_LIMIT}. Run `specdec tune --save` again.'
        )
        return None
    return None if entry["k"] == "auto" else int(entry["k"])


# --------------------------------------------------------------------------------------------------------------
# Writing


def save(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None,
    method: str,
    machine_desc: dict[str, Any],
    k: int | str,
    details: dict[str, Any] | None = None,
) -> Path:
    """Record K (an int 0..64 or "auto") for this pair, method and machine; return the file written.

    Other entries are kept; a corrupt file is set aside (`files.set_aside`, with a `TunedWarning`) and a killed
    writer's temporaries are deleted, under the file lock. The write is atomic and
    the file is created 0o600. Raises ValueError for a bad K, OSError when the directory is not writable.
    """
    if not _valid_k(k):
        raise ValueError(f"k must be 'auto' or 0..{K_LIMIT}, got {k!r}")
    path = tuned_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = setting_key(target_path, draft_path, method, machine_desc["key"])
    entry = {
        "k": k,
        "target": Path(target_path).name,
        "draft": Path(draft_path).name if draft_path is not None else None,
        "method": method,
        "machine": {m: machine_desc.get(m, "") for m in ("cpu", "threads", "system_info_sha256", "placement")},
        **(details or {}),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with files.lock(f"{path}.lock", _LOCK_TIMEOUT_S):
        files.remove_temporaries(path.parent, path.name)  # what a killed writer left
        with warnings.catch_warnings(record=True) as broken:
            warnings.simplefilter("always", TunedWarning)
            settings = dict(load(path))
        if broken and path.exists():  # kept for inspection, not overwritten
            aside = files.set_aside(path)
            _warn(f"{broken[0].message} Set aside as {aside.name}; {path.name} holds only this setting now.")
        settings[key] = entry
        files.write_atomic(
            path, json.dumps({"version": VERSION, "settings": settings}, indent=2, ensure_ascii=False) + "\n"
        )
    return path
