"""Which draft model a generation loads, if any: the catalog's pairing, and where `--method auto` includes one.

A draft model is a cost (a second model to fetch, load and run per drafted token) that pays only when the target's
verify pass is much cheaper per token than a plain step, i.e. on a GPU. On a CPU a draft token costs nearly as much
as a target step, so it never pays there, and `auto` neither fetches nor loads it unless asked. Rules (`plan`):

* `--method draft`: `--draft`, else the catalog's draft for the target (its `[pairs]` entry, or the default
  draft for the default target); a target without one needs `--draft` (UsageError, before anything is fetched).
* `--method auto`: `--draft` when given; else the target's paired draft when llama.cpp offloads to a GPU, or when
  `specdec tune --save` measured on this machine that the draft model pays; else none, and the reason says why.
* any other method: none.

Where a GPU put the paired draft in, `open_session` then times one draft-model token and keeps the model only when
that cost pays against the target's measured verify curve at a prior acceptance (`draft_pays`); the reason says
the ratio either way (docs/gpu.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec_cli.config import Catalog
from specdec_cli.core.cost_model import DEFAULT_K_MAX, MARGIN, best_k, expected_ms, expected_tokens
from specdec_cli.errors import UsageError
from specdec_cli.spec import Method

PRIOR_ACCEPTANCE = 0.7  # a paired draft model's acceptance before any is measured (Qwen2.5-Coder 0.5B -> 1.5B: 0.6-0.8)
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


def plan(
    method: Method | str,
    target: str | None,
    draft: str | None,
    catalog: Catalog,
    *,
    gpu_offload: bool,
    tuned_pays: bool,
) -> DraftPlan:
    """The draft model for `method` (see the module docstring). Raises UsageError for `--method draft` with a
    target the catalog pairs with no draft model and no `--draft`."""
    method = Method(method)
    if method is Method.draft:
        name = draft or paired_draft(target, catalog)
        if name is None:
            raise UsageError(
                f"--method draft needs a draft model, and the catalog pairs none with {target}.",
                "Pass --draft NAME (a model with the same tokenizer), or use --method auto.",
            )
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


def draft_pays(
    draft_ms: float,
    verify_ms: Sequence[float] | np.ndarray,
    *,
    acceptance: float = PRIOR_ACCEPTANCE,
    margin: float = MARGIN,
) -> tuple[bool, str]:
    """Would a draft model whose drafted token costs `draft_ms` (ms) beat plain decoding on the target's verify curve
    `verify_ms` (float [m], v(b) ms for b = 1..m, m >= 2) at `acceptance` per position? The best K's expected
    tokens per ms (`cost_model.expected_tokens` / `expected_ms`, every draft filled) against 1 / v(1), by `margin`.
    Returns (pays, one line with the ratio draft_ms / v(1) and the expected speedup at the best K)."""
    v = np.asarray(verify_ms, dtype=np.float64)[: DEFAULT_K_MAX + 1]  # [k_max + 1]
    k_max = len(v) - 1
    a = np.full(k_max, acceptance)
    rates = expected_tokens(a) / expected_ms(v, draft_ms, 0.0, np.ones(k_max))  # [k_max + 1] tokens per ms by K
    k = best_k(rates, margin)
    ratio = draft_ms / float(v[0])
    speedup = float(rates[k] / rates[0])
    if k > 0:
        return True, (
            f"a draft token costs {draft_ms:.2f} ms, {ratio:.2f} x the target's pass: "
            f"{speedup:.2f}x expected at K = {k} and {acceptance:.0%} acceptance"
        )
    best = float(rates[1:].max() / rates[0])
    return False, (
        f"a draft token costs {draft_ms:.2f} ms, {ratio:.2f} x the target's pass: at {acceptance:.0%} "
        f"acceptance even its best K would run at {best:.2f}x plain decoding"
    )


def tuned_draft_pays(target_path: str | os.PathLike[str], threads: int | None) -> bool:
    """True when `specdec tune --save` measured on this machine (same build, threads) that `--method draft` beat
    plain decoding with this target (a saved K > 0 or auto, with a speedup > 1)."""
    from specdec_cli.stores import tuned

    try:
        prefix = tuned.model_id(Path(target_path)) + "|"
    except OSError:
        return False
    mark = f"|draft|{tuned.machine(threads)['key']}"  # then the placement, on a build that offloads
    for key, entry in tuned.load().items():
        if (
            key.startswith(prefix)
            and (key.endswith(mark) or f"{mark}|" in key)
            and entry.get("k") != 0
            and float(entry.get("speedup") or 0.0) > 1.0
        ):
            return True
    return False
