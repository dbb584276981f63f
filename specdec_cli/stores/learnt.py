"""What `--k auto` learnt, kept across runs: the verify curve this machine measured, the verify costs timed since,
drafting costs, acceptance by match length.

`specdec run` is one process per prompt. Without this, every run would start from nothing: a plain step to time
v(1), probes, and a slow start in each match-length bucket before the long drafts of a repeated workload are trusted
(on a CPU that warm-up can cost more than a short reply's drafts save). A session saves each `AdaptiveK` it used
when it closes (`Session.close`), and the next session with the same target, draft model, method, K limit and
machine starts from it (`AdaptiveK.restore`). Within one session (chat turns, benchmarks) the controller is simply
kept (`Assembler.make_controller`).

The file, `data_dir()/learnt.json` (mode 0o600, written atomically under a file lock, like tuned.json):

    {"version": 1,
     "entries": {
       "<target id>|<draft id or ->|<method>|<machine id>|k_max=16": {   # keys as in specdec_cli.stores.tuned
         "state": {"model": {"k_max": 64, "verify": [[b, ms, n, verified], ...], "draft": [5 floats],
                             "acc": [[...], [...]], "fill": [[...], [...]], "acc_model": [[...], [...]],
                             "fill_model": [[...], [...]], "acc_by_source": {"prompt": [[[...], [...]], ...], ...}},
                   "evidence": true, "evidence_ms": [0.2, ...]},
         "target": "...gguf", "method": "suffix", "saved_at": "2026-...Z"}},
     "curves": {
       "<target id>|<machine id>|llama-cpp-python <version>": {   # the measured verify curve (verify_curve.py)
         "curve": {"ms": [v(1), ..., v(65)], "spread": [...], "repeats": 2, "context": 256, "seconds": 48.2,
                   "sizes": [1, ..., 17, 24, ..., 64], "depth": 640, "depth_ms": [per pass, per row],
                   "measured_at": "2026-...Z", "stale": false, "stale_why": "", "disturbed": "",
                   "provisional": false, "measured_for": "..."},
         "timed": {"cpu": "...", "threads": "2", "build": "...", "placement": "..."},
         "target": "...gguf", "saved_at": "2026-...Z"}}}

A curve is kept per model file, machine (CPU, threads, llama.cpp's system info: the build's features),
llama-cpp-python version and placement (the device and the layers offloaded, on a build that can offload); a
session whose passes drift from its prediction at their depth (`verify_curve.CurveWatch`) marks it stale, with the
reason, and the next session measures it again, saying why (`why_measure`; `VERIFY_ENV=off`, e.g. for tests, never
measures).

A stored state is a prior, not a verdict: restored, each estimate keeps its value but at most `MAX_WEIGHT`
observations of evidence, so a few steps measured today outweigh it. Nothing here stops a generation: a file that
cannot be read or does not fit is ignored with a `LearntWarning`, and so is a save that fails.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec_cli.config import data_dir

if TYPE_CHECKING:
    from specdec_cli.core.controller import AdaptiveK
    from specdec_cli.core.verify_curve import VerifyCurve

FILE_NAME = "learnt.json"
VERIFY_ENV = "SPECDEC_VERIFY_CURVE"  # "off": never measure a verify curve (v(b) is then learnt from the passes made)
VERSION = 1
MAX_WEIGHT = 8.0  # observations of evidence a restored estimate keeps at most
_LOCK_TIMEOUT_S = 10.0


class LearntWarning(UserWarning):
    """learnt.json could not be read or saved; --k auto starts from its defaults (the message says the fix)."""


def learnt_path() -> Path:
    """data_dir()/learnt.json."""
    return data_dir() / FILE_NAME


def entry_key(
    target_path: str | os.PathLike[str],
    draft_path: str | os.PathLike[str] | None,
    method: str,
    threads: int | None,
    k_max: int,
    placement: str = "",
) -> str | None:
    """The learnt.json key of a pair, method, machine, placement (`stores.tuned.machine`) and K limit; None when a
    model file cannot be read (a fake or vanished model: nothing is kept for it)."""
    from specdec_cli.stores.tuned import machine, setting_key

    if not Path(target_path).is_file():  # before `machine`, which asks llama.cpp
        return None
    try:
        return f"{setting_key(target_path, draft_path, method, machine(threads, placement)['key'])}|k_max={k_max}"
    except OSError:
        return None


def _warn(message: str) -> None:
    warnings.warn(message, LearntWarning, stacklevel=3)


def _entries(path: Path, section: str = "entries") -> dict[str, Any]:
    """A section of learnt.json: "entries" (controllers) or "curves" ({} when there is none). A broken file:
    `LearntWarning` and {}."""
    fix = f"Delete {path}; --k auto then learns afresh."
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _warn(
            f"Ignoring what --k auto learnt in earlier runs: cannot read {path} "
            f"({getattr(e, 'strerror', None) or e}). {fix}"
        )
        return {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("entries"), dict):
        _warn(f"Ignoring what --k auto learnt in earlier runs: {path} is not a version-{VERSION} learnt.json. {fix}")
        return {}
    found = doc.get(section, {})
    return found if isinstance(found, dict) else {}


def restore(controller: AdaptiveK, key: str | None) -> bool:
    """Start `controller` from what was saved under `key`; True when it did. Never raises: an entry that does not
    fit is ignored with a `LearntWarning`."""
    if key is None:
        return False
    path = learnt_path()
    entry = _entries(path).get(key)
    if entry is None:
        return False
    try:
        controller.restore(entry["state"], MAX_WEIGHT)
    except (ValueError, TypeError, KeyError) as e:
        _warn(
            f"Ignoring what --k auto learnt for this model and method in {path}: it does not fit ({e}). "
            f"Delete {path}; --k auto then learns afresh."
        )
        return False
    return True


def save(
    controllers: dict[str, AdaptiveK],
    details: dict[str, dict[str, Any]] | None = None,
    *,
    curves: dict[str, dict[str, Any]] | None = None,
) -> Path | None:
    """Save each controller's state under its key, and each of `curves` ({key: {"curve": VerifyCurve.to_dict(), ...}},
    `curve_key`), keeping the other entries; return the file (None: nothing to save, or the save failed with a
    `LearntWarning`)."""
    if not controllers and not curves:
        return None
    import filelock

    from specdec_cli import files

    path = learnt_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with files.lock(f"{path}.lock", _LOCK_TIMEOUT_S):
            files.remove_temporaries(path.parent, path.name)  # what a killed writer left
            with warnings.catch_warnings(record=True) as broken:
                warnings.simplefilter("always", LearntWarning)
                entries, kept = dict(_entries(path)), dict(_entries(path, "curves"))
            if broken and path.exists():  # kept for inspection, not overwritten: as the suffix store does
                aside = files.set_aside(path)
                _warn(f"{broken[0].message} Set aside as {aside.name}; it is written afresh.")
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for key, ctrl in controllers.items():
                entries[key] = {"state": ctrl.state(), **(details or {}).get(key, {}), "saved_at": stamp}
            for key, entry in (curves or {}).items():  # merged: a curve and the flash-attention choice share a key
                kept[key] = {**kept.get(key, {}), **entry, "saved_at": stamp}
            files.write_atomic(
                path, json.dumps({"version": VERSION, "entries": entries, "curves": kept}, ensure_ascii=False) + "\n"
            )
    except (OSError, filelock.Timeout) as e:
        _warn(
            f"Could not save what --k auto learnt to {path} ({getattr(e, 'strerror', None) or e}); the next run "
            f"learns afresh. Make {path.parent} writable, or set SPECDEC_HOME."
        )
        return None
    return path


# --------------------------------------------------------------------------------------------------------------
# The measured verify curve (`specdec_cli.core.verify_curve`)


def curve_key(target_path: str | os.PathLike[str], threads: int | None, placement: str = "") -> str | None:
    """The learnt.json key of a target's verify curve on this machine, build and placement (`stores.tuned.machine`:
    the device and the layers offloaded; "" on a build that cannot offload, whose key is an older specdec's); None
    for a file that cannot be read (a fake model) or when `VERIFY_ENV` is "off"."""
    from specdec_cli.models.machine import package_version
    from specdec_cli.stores.tuned import machine, model_id

    if os.environ.get(VERIFY_ENV, "").strip().lower() in ("off", "0", "no") or not Path(target_path).is_file():
        return None
    try:
        return f"{model_id(target_path)}|{machine(threads, placement)['key']}|llama-cpp-python {package_version()}"
    except OSError:
        return None


def timed_on(threads: int | None, placement: str = "") -> dict[str, str]:
    """What a curve is timed on, kept beside it so that the next measurement can say why it is needed (`why_measure`):
    {"cpu", "threads", "build", "placement"}."""
    from specdec_cli.models.machine import package_version
    from specdec_cli.stores.tuned import machine

    m = machine(threads, placement)
    plan = ", extra-bufts off" if "extra-bufts-off" in m["key"].split("|") else ""
    return {
        "cpu": str(m.get("cpu", "?")),
        "threads": str(m.get("threads", threads)),
        "build": f"system info {m.get('system_info_sha256', '?')}, llama-cpp-python {package_version()}{plan}",
        "placement": placement,
    }


_CHANGES = {
    "build": "another llama.cpp build",
    "threads": "other threads",
    "placement": "another device or offload",
    "cpu": "another CPU",
}


def why_measure(key: str | None, kept: VerifyCurve | None, timed: dict[str, str] | None = None) -> str:
    """Why the curve under `key` is to be measured now, one phrase; "" when `kept` (the curve kept under it, stale
    ones included) serves. A kept curve is measured again when it is stale (`stale_why`), provisional (timed on a
    busy machine: once) or timed at one depth of context only (an older specdec); without one, the phrase names
    what differs from the nearest curve kept for the same model file (`timed`: `timed_on` here): another build,
    threads, device or offload, CPU; or that none was kept."""
    if key is None:
        return ""
    if kept is not None:
        if kept.stale:
            return f"the kept curve is stale: {kept.stale_why or 'marked so by an earlier run'}"
        if kept.provisional:
            return f"the kept curve is provisional, timed on a busy machine ({kept.disturbed})"
        if not kept.depth and not kept.sizes:
            return "the kept curve was timed at one depth of context (by an older specdec)"
        return ""
    model, here = key.split("|", 1)[0] + "|", timed or {}
    nearest: list[str] | None = None
    for other, entry in all_curves().items():
        if other == key or not other.startswith(model) or not isinstance(entry, dict) or "curve" not in entry:
            continue
        theirs = entry.get("timed")
        placement = here.get("placement", "")
        if not isinstance(theirs, dict):  # an older specdec's: no device in its key
            older = placement and other == key.replace(f"|{placement}|llama-cpp-python", "|llama-cpp-python")
            diff = [
                f"{_CHANGES['placement']} ({placement} here; the kept curve does not say where it was timed)"
                if older
                else "another build or machine"
            ]
        else:
            diff = [
                f"{_CHANGES[f]} ({here[f] or 'the CPU'} here, {theirs.get(f) or 'the CPU'} kept)"
                for f in _CHANGES
                if f in here and theirs.get(f, "") != here[f]
            ] or ["another build or machine"]
        if nearest is None or len(diff) < len(nearest):
            nearest = diff
    return "; ".join(nearest) if nearest else "none kept for this model, machine and device yet"


def load_curve(key: str | None, *, stale_ok: bool = False) -> VerifyCurve | None:
    """The verify curve saved under `key` (None: none, one marked stale unless `stale_ok`, or one that does not
    parse, which warns)."""
    from specdec_cli.core.verify_curve import VerifyCurve

    if key is None:
        return None
    entry = _entries(learnt_path(), "curves").get(key)
    if entry is None or "curve" not in entry:
        return None
    try:
        curve = VerifyCurve.from_dict(entry["curve"])
    except (ValueError, TypeError, KeyError) as e:
        _warn(f"Ignoring the verify curve saved in {learnt_path()}: it does not parse ({e}); it is measured again.")
        return None
    return curve if stale_ok or not curve.stale else None


def save_curve(
    key: str | None, curve: VerifyCurve, target: str | os.PathLike[str], timed: dict[str, str] | None = None
) -> Path | None:
    """Keep `curve` under `key` (None: nothing to do), with what it was timed on (`timed_on`) where given."""
    if key is None:
        return None
    entry: dict[str, Any] = {"curve": curve.to_dict(), "target": Path(target).name}
    if timed is not None:
        entry["timed"] = timed
    return save({}, curves={key: entry})


def forget_curve(key: str | None, why: str = "") -> None:
    """Mark the curve kept under `key` stale (it is measured again at the next need), `why` (one phrase) kept as its
    `stale_why`; nothing when there is none."""
    from dataclasses import replace

    curve = load_curve(key, stale_ok=True)
    if key is not None and curve is not None:
        save(
            {},
            curves={
                key: {
                    "curve": replace(curve, stale=True, stale_why=why).to_dict(),
                    "target": _entries(learnt_path(), "curves")[key].get("target", "?"),
                }
            },
        )


def save_flash_attn(key: str | None, choice: dict[str, Any]) -> Path | None:
    """Keep the measured flash-attention choice (`measure.flash_attn.Choice.to_dict()`) beside the curve of `key`."""
    if key is None:
        return None
    return save({}, curves={key: {"flash_attn": choice}})


def load_flash_attn(key: str | None) -> dict[str, Any] | None:
    """The flash-attention choice kept under `key` ({"on": bool, ...}), or None (none measured, or not a dict with a
    bool "on")."""
    if key is None:
        return None
    entry = _entries(learnt_path(), "curves").get(key)
    choice = entry.get("flash_attn") if isinstance(entry, dict) else None
    return choice if isinstance(choice, dict) and isinstance(choice.get("on"), bool) else None


def all_curves() -> dict[str, dict[str, Any]]:
    """Every saved curve entry by key (for `specdec doctor`)."""
    return dict(_entries(learnt_path(), "curves"))
