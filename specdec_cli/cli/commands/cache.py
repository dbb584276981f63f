"""`specdec cache stats | clear | export`: the suffix drafter's stores of past outputs, and the prompt cache.

One suffix store per tokenizer lives in `data_dir()/suffix/<fingerprint[:16]>.npz` (format:
`specdec_cli.stores.suffix_store`); the prompt cache's KV states live in
`specdec_cli.stores.prompt_cache.default_directory()` (format: `specdec_cli.stores.prompt_cache`). Tables go to stdout,
notes to stderr; errors are SpecdecError subclasses left to propagate to `main()`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from specdec_cli.cli.console import err_console, human_size, make_console
from specdec_cli.errors import UsageError


def _help(*paragraphs: str, examples: list[str]) -> str:
    """Help text: one line per paragraph (Typer rewraps them), then examples."""
    return "\n\n".join([*paragraphs, "Examples:", *(f"  {e}" for e in examples)])


cache_app = typer.Typer(
    help=_help(
        "Inspect, export or delete the suffix drafter's stores of past outputs (one per tokenizer), and inspect or "
        "delete the prompt cache (saved KV states of evaluated prompts).",
        "--method suffix learns from every generation: outputs are kept in $SPECDEC_HOME/data/suffix "
        "(else ~/.local/share/specdec/suffix), at most 2M tokens per tokenizer, oldest dropped first.",
        "The prompt cache keeps the KV state of evaluated prompts in $SPECDEC_PROMPT_CACHE (else "
        "~/.cache/specdec/prompts), at most 4 GiB, least recently used dropped first.",
        examples=["specdec cache stats", "specdec cache export outputs.jsonl", "specdec cache clear --yes"],
    ),
    no_args_is_help=True,
)


def suffix_dir() -> Path:
    from specdec_cli.config import data_dir

    return data_dir() / "suffix"


def _stores(d: Path) -> list[Path]:
    from specdec_cli.stores.suffix_store import SUFFIX

    return sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []


_human = human_size


@cache_app.command(
    "stats",
    help=_help(
        "Show each suffix store: its file, tokenizer fingerprint, documents, tokens, size on disk and last change; "
        "then the corpora `specdec learn` made (files, tokens, size on disk); then the prompt cache: each saved KV "
        "state's model, tokens, size on disk and last use, and the total.",
        "Only headers are read, so this is instant even for large stores.",
        examples=["specdec cache stats", "SPECDEC_HOME=/tmp/specdec specdec cache stats"],
    ),
)
def stats() -> None:
    from specdec_cli.stores.suffix_store import CorruptStore, read_info

    d = suffix_dir()
    paths = _stores(d)
    if not paths:
        err_console().print(Text(f"No suffix stores in {d} yet: run with --method suffix to start one."))
    out = make_console()
    for p in paths:  # one small table per store: it fits 80 columns with the full path and fingerprint
        table = Table(title=p.name, title_justify="left", show_header=False)
        table.add_column("field", style="spec.label", no_wrap=True)
        table.add_column("value", overflow="fold")
        table.add_row("path", Text(str(p)))
        try:
            info = read_info(p)
        except (CorruptStore, OSError) as e:
            table.add_row("status", Text(f"unusable: {e}; set aside on its next use", style="spec.bad"))
        else:
            table.add_row("tokenizer", Text(info.fingerprint))
            table.add_row("documents", f"{info.n_docs:,}")
            table.add_row("tokens", f"{info.n_tokens:,}")
            table.add_row("size on disk", _human(info.size_bytes))
            table.add_row("last modified", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.modified)))
        out.print(table)
    aside = sorted(d.glob("*.corrupt-*"))
    if aside:
        err_console().print(Text(f"{len(aside)} unusable store(s) set aside ({', '.join(a.name for a in aside)}); "
                          f"`specdec cache clear` deletes them."))  # fmt: skip
    _corpus_stats(out)
    _prompt_stats()


def _corpus_stats(out) -> None:
    """The corpora `specdec learn` made (`specdec learn --list`'s table)."""
    from specdec_cli.cli.commands.learn import corpus_table

    table = corpus_table("corpora (specdec learn)")
    if table is None:
        err_console().print(Text("No corpora learnt yet: specdec learn PATH indexes your code for --method auto."))
        return
    out.print(table)


def _prompt_stats() -> None:
    from specdec_cli.stores.prompt_cache import PromptCache

    s = PromptCache().stats()
    if not s.entries:
        err_console().print(Text(f"No prompt-cache entries in {s.directory} yet."))
        return
    table = Table(title=f"prompt cache: {s.directory}", title_justify="left",
                  caption=f"{len(s.entries)} entries, {_human(s.n_bytes)} of {_human(s.max_bytes)}",
                  caption_justify="left")  # fmt: skip
    for name, justify in (("model", "left"), ("tokens", "right"), ("size", "right"), ("last used", "left")):
        table.add_column(name, justify=cast(JustifyMethod, justify), overflow="fold")
    for e in s.entries:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        model = Text(e.model) if not e.problem else Text(f"{e.model} (unusable: {e.problem})", style="red")
        table.add_row(model, f"{e.n_tokens:,}", _human(e.n_bytes), used)
    make_console().print(table)


@cache_app.command(
    "clear",
    help=_help(
        "Delete every suffix store (and stores set aside as corrupt), and every prompt-cache entry. The suffix "
        "drafter then starts from scratch, and the next run of each prompt evaluates it in full.",
        "--only suffix or --only prompts deletes one of the two. Asks for confirmation unless --yes is given.",
        examples=["specdec cache clear", "specdec cache clear --yes", "specdec cache clear --only prompts --yes"],
    ),
)
def clear(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    only: Annotated[
        str | None,
        typer.Option(
            "--only", metavar="suffix|prompts", help="Delete only the suffix stores, or only the prompt cache."
        ),  # fmt: skip
    ] = None,
) -> None:
    from filelock import Timeout

    from specdec_cli.stores.prompt_cache import PromptCache
    from specdec_cli.stores.suffix_store import SuffixStore

    if only not in (None, "suffix", "prompts"):
        raise typer.BadParameter(f"{only!r} is neither suffix nor prompts.", param_hint="--only")
    d = suffix_dir()
    paths = _stores(d) if only != "prompts" else []
    aside = sorted(d.glob("*.corrupt-*")) if d.is_dir() and only != "prompts" else []
    prompts = PromptCache()
    n_prompts = len(prompts.stats().entries) if only != "suffix" else 0
    if not paths and not aside and not n_prompts:
        err_console().print(Text(f"Nothing to clear in {d} nor {prompts.directory}."))
        return
    if not yes:
        what = [f"{len(paths) + len(aside)} suffix store file(s) in {d}"] if paths or aside else []
        what += [f"{n_prompts} prompt-cache entries in {prompts.directory}"] if n_prompts else []
        typer.confirm(f"Delete {' and '.join(what)}?", abort=True, err=True)
    if n_prompts:
        try:
            n_files = prompts.clear()
        except (OSError, Timeout) as e:
            why = "another specdec process holds its lock" if isinstance(e, Timeout) else (e.strerror or str(e))
            raise UsageError(f"Cannot delete the prompt cache in {prompts.directory}: {why}.",
                             "Retry when the other run ends, or delete the directory by hand.") from None  # fmt: skip
        err_console().print(
            Text(f"Deleted {n_prompts} prompt-cache entries ({n_files} file(s)) in {prompts.directory}.")
        )
    if not paths and not aside:
        return
    try:
        for p in paths:
            SuffixStore(p).clear()  # under the store's lock, so a concurrent save is not torn
        for p in aside:
            p.unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"Cannot delete the suffix stores in {d}: {e.strerror or e}.",
                         f"Check the permissions of {d}, or delete it by hand.") from None  # fmt: skip
    err_console().print(Text(f"Deleted {len(paths) + len(aside)} file(s) in {d}."))


@cache_app.command(
    "export",
    help=_help(
        "Write every document of the suffix stores as JSON lines: "
        '{"tokenizer": <fingerprint>, "doc": <index, 0 = oldest>, "added": <Unix time>, "tokens": <list of ids>}.',
        "Token ids only (the stores do not know the model, so they cannot detokenize). PATH - writes to stdout.",
        examples=["specdec cache export outputs.jsonl", "specdec cache export - | head -n 3"],
    ),
)
def export(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="Output file (.jsonl), or - for stdout.")],
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="Only the store whose fingerprint starts with this.")
    ] = None,
) -> None:
    from specdec_cli.stores.suffix_store import CorruptStore, read_info, read_store

    d = suffix_dir()
    paths = [p for p in _stores(d) if tokenizer is None or p.name.startswith(tokenizer[:16])]
    to_stdout = str(path) == "-"
    try:
        f = sys.stdout if to_stdout else open(path, "w", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"Cannot write {path}: {e.strerror or e}.", "Choose a path in a writable directory.") from None
    n_docs = 0
    try:
        for p in paths:
            try:
                fingerprint = read_info(p).fingerprint
                corpus, _ = read_store(p)
            except (CorruptStore, OSError) as e:
                err_console().print(Text(f"skipped {p.name}: {e}", style="spec.warn"))
                continue
            for i, doc in enumerate(corpus.documents()):
                row = {"tokenizer": fingerprint, "doc": i, "added": float(corpus.added[i]), "tokens": doc.tolist()}
                f.write(json.dumps(row) + "\n")
                n_docs += 1
    except BrokenPipeError:  # `specdec cache export - | head`: the reader is gone, which is fine
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not complain
        return
    except OSError as e:
        raise UsageError(f"Cannot write {path}: {e.strerror or e}.", "Check the free space and permissions.") from None
    finally:
        if not to_stdout:
            f.close()
    where = "stdout" if to_stdout else path
    err_console().print(Text(f"Exported {n_docs} document(s) from {len(paths)} store(s) to {where}."))
