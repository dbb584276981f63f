"""Which draft model a generation loads, if any: the catalog's pairing, and where `--method auto` includes one.

A draft model is a cost (a second model to fetch, load and run per drafted token) that pays only when the target's
verify pass is much cheaper per token than a plain step, i.e. on a GPU. On a 2-core CPU a 0.5B draft costs ~48 ms
per token against 63-79 ms for a 1.5B target step, so it never pays there, and `auto` neither fetches nor loads it
unless asked. Rules (`plan`):

* `--method draft`: `--draft`, else the catalog's draft for the target (its `[pairs]` entry, or the default
  draft for the default target); a target without one needs `--draft` (UsageError, before anything is fetched).
* `--method auto`: `--draft` when given; else the target's paired draft when llama.cpp offloads to a GPU, or when
  `specdec tune --save` measured on this machine that the draft model pays; else none, and the reason says why.
* any other method: none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specdec_cli.config import Catalog
from specdec_cli.errors import UsageError
from specdec_cli.spec import Method

CPU_ONLY = "CPU-only llama.cpp: a draft model costs about as much per token as a target step here"


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """name: the draft model to load (a catalog name or a .gguf path), None for none. reason: one line, for the
    stats line and --json ("" when the method never uses a draft model)."""

    name: str | None
    reason: str = ""


def paired_draft(target: str | None, catalog: Catalog) -> str | None:
    """The catalog's draft for `target` (a catalog name, a .gguf path of a catalog file, or None = the default
    target): its `[pairs]` entry, the default draft for the default target; None when the catalog has none."""
    name = target or catalog.default_target
    if name not in catalog.models:  # a path: the catalog model with that file name, if any
        base = os.path.basename(name)
        name = next((m.name for m in catalog.models.values() if m.file == base), name)
    if name == catalog.default_target:
        return catalog.default_draft
    return next((p.draft for p in catalog.pairs.values() if p.target == name), None)


def plan(method: Method | str, target: str | None, draft: str | None, catalog: Catalog, *, gpu_offload: bool,
         tuned_pays: bool) -> DraftPlan:
    """The draft model for `method` (see the module docstring). Raises UsageError for `--method draft` with a
    target the catalog pairs with no draft model and no `--draft`."""
    method = Method(method)
    if method is Method.draft:
        name = draft or paired_draft(target, catalog)
        if name is None:
            raise UsageError(f"--method draft needs a draft model, and the catalog pairs none with {target}.",
                             "Pass --draft NAME (a model with the same tokenizer), or use --method auto.")
        return DraftPlan(name, "--method draft")
    if method is not Method.auto:
        return DraftPlan(None)
    if draft:
        return DraftPlan(draft, "--draft given")
    name = paired_draft(target, catalog)
    if name is None:
        return DraftPlan(None, f"no draft model in the catalog pairs with {target}; --draft NAME adds one")
    if gpu_offload:
        return DraftPlan(name, "llama.cpp offloads to a GPU, where a draft model can pay")
    if tuned_pays:
        return DraftPlan(name, "specdec tune measured that it pays on this machine")
    return DraftPlan(None, f"{CPU_ONLY}; --draft NAME includes one anyway")


def tuned_draft_pays(target_path: str | os.PathLike[str], threads: int | None) -> bool:
    """True when `specdec tune --save` measured on this machine (same build, threads) that `--method draft` beat
    plain decoding with this target (a saved K > 0 or auto, with a speedup > 1)."""
    from specdec_cli.stores import tuned

    try:
        prefix = tuned.model_id(Path(target_path)) + "|"
    except OSError:
        return False
    machine = tuned.machine(threads)["key"]
    for key, entry in tuned.load().items():
        if key.startswith(prefix) and key.endswith(f"|draft|{machine}") and entry.get("k") != 0 \
                and float(entry.get("speedup") or 0.0) > 1.0:
            return True
    return False
