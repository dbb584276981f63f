"""`specdec learn PATH...`, `--list`, `--forget PATH`: the corpus index `--method auto` drafts from.

The work is `specdec_cli.learn` (which files, incremental updates) and `specdec_cli.stores.corpus` (the index on
disk); this module finds the target's tokenizer, shows a progress bar and prints the summary. The tokenizer is
loaded only when a file needs tokenizing, and its fingerprint (which names the corpus's folder) is remembered per
model file, so re-learning an unchanged tree loads no model at all.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from specdec_cli.cli.console import human_size as _human
from specdec_cli.errors import UsageError

if TYPE_CHECKING:
    from specdec_cli.learn import LearnOptions
    from specdec_cli.models.llama import VocabOnly


class LazyTokenizer:
    """The target's tokenizer (`models.llama.VocabOnly`), loaded on first use; its fingerprint from the
    per-model-file cache (`<data>/corpus/tokenizers.json`) when known, so an unchanged tree loads nothing."""

    def __init__(self, model_path: Path, data_dir: Path) -> None:
        self.model_path = Path(model_path)
        self.cache = data_dir / "corpus" / "tokenizers.json"
        st = self.model_path.stat()
        self.key = f"{self.model_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        self._tok: VocabOnly | None = None

    def _load(self):
        if self._tok is None:
            from specdec_cli.models.llama import VocabOnly

            self._tok = VocabOnly(self.model_path)
        return self._tok

    def fingerprint(self) -> str:
        from specdec_cli import files

        try:
            known = json.loads(self.cache.read_text())
        except (OSError, ValueError):
            known = {}
        fp = known.get(self.key) if isinstance(known, dict) else None
        if isinstance(fp, str) and len(fp) >= 16:
            return fp
        fp = self._load().vocab_info().fingerprint
        try:
            files.private_dir(self.cache.parent)
            files.write_atomic(self.cache, json.dumps({**(known if isinstance(known, dict) else {}), self.key: fp}))
        except OSError:
            pass  # remembered next time, perhaps
        return fp

    def __call__(self, text: str) -> list[int]:
        return self._load().tokenize(text, add_special=False, parse_special=False)

    def close(self) -> None:
        if self._tok is not None:
            self._tok.close()
            self._tok = None


def summary(report) -> str:
    """One line: "learnt myrepo: 412 files, 1,234,567 tokens, 9.9 MB on disk, 38.2 s (312 tokenized at 1.9 M
    tokens/min, 100 unchanged, 3 forgotten; skipped 2 binary, 1 huge)"."""
    rate = report.tokenized_tokens / report.seconds * 60 if report.seconds > 0 else 0.0
    parts = [
        f"{report.tokenized_files} tokenized"
        + (f" at {rate / 1e6:.1f} M tokens/min" if report.tokenized_tokens else "")
    ]
    if report.unchanged:
        parts.append(f"{report.unchanged} unchanged")
    if report.forgotten:
        parts.append(f"{report.forgotten} gone, forgotten")
    if report.upgraded:
        parts.append("rewritten in the new index format")
    if report.skipped:
        parts.append("skipped " + ", ".join(f"{n} {why}" for why, n in sorted(report.skipped.items())))
    per = f", {report.size_bytes / report.tokens:.1f} bytes/token" if report.tokens else ""
    verb = "learnt" if report.written else "unchanged"
    return (
        f"{verb} {report.name}: {report.files:,} files, {report.tokens:,} tokens, {_human(report.size_bytes)} on "
        f"disk{per}, {report.seconds:.1f} s ({'; '.join(parts)})"
    )


def execute(
    paths: Sequence[Path], *, target: str | None, options: LearnOptions, list_: bool, forget: str | None
) -> int:
    from specdec_cli.cli.console import RichReporter, err_console, make_console, progress
    from specdec_cli.config import data_dir, load_catalog
    from specdec_cli.learn import learn

    err = err_console()
    if list_:
        show_list(make_console(), err)
        return 0
    if forget is not None:
        from specdec_cli.learn import forget as forget_path

        rep = forget_path(forget, data_dir())
        if not rep.corpora_deleted and not rep.files_forgotten:
            raise UsageError(
                f"Nothing learnt is named {forget!r} or lies under it.", "See what is learnt with specdec learn --list."
            )
        for c in rep.corpora_deleted:
            err.print(Text(f"forgot the corpus {c}"))
        if rep.files_forgotten:
            err.print(Text(f"forgot {rep.files_forgotten} file(s) under {forget}"))
        return 0
    if not paths:
        raise UsageError("specdec learn needs a folder or file to learn.", "For example: specdec learn .")
    for p in paths:
        if not Path(p).exists():
            raise UsageError(f"{p} does not exist.", "Give a folder or a file to learn.")
    from specdec_cli.models.resolver import resolve

    catalog = load_catalog()
    model_path = resolve(target or catalog.default_target, catalog, reporter=RichReporter(err))
    tok = LazyTokenizer(model_path, data_dir())
    try:
        fingerprint = tok.fingerprint()
        with progress(err, unit="files") as bar:
            task = bar.add_task("learning", total=None)

            def advance(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            report = learn(
                paths, tokenize=tok, fingerprint=fingerprint, data_dir=data_dir(), options=options, progress=advance
            )
    finally:
        tok.close()
    err.print(Text(summary(report)))
    if report.skipped.get("size cap"):
        err.print(
            Text(
                f"note: the corpus reached its size cap ({options.max_tokens:,} tokens); raise it with --max-tokens, "
                "or narrow it with --include/--exclude.",
                style="spec.warn",
            )
        )
    err.print(
        Text(
            f"--method auto now drafts from it (specdec run, chat, serve; --corpus {report.name} to use only "
            "it, --corpus off for none).",
            style="spec.label",
        )
    )
    return 0


def corpus_table(title: str = "corpora") -> Table | None:
    """Every corpus `specdec learn` made (all tokenizers), one row each; None when there is none."""
    from specdec_cli.config import data_dir
    from specdec_cli.stores import corpus as store

    dirs = store.list_corpora(data_dir())
    if not dirs:
        return None
    table = Table(title=title, title_justify="left")
    for col, justify in (
        ("name", "left"),
        ("tokenizer", "left"),
        ("files", "right"),
        ("tokens", "right"),
        ("size", "right"),
        ("updated", "left"),
        ("roots", "left"),
    ):
        table.add_column(col, justify=cast(JustifyMethod, justify), overflow="fold")
    for d in dirs:
        try:
            i = store.info(d)
        except (store.CorruptCorpus, OSError) as e:
            table.add_row(
                d.name,
                d.parent.name,
                "",
                "",
                "",
                "",
                Text(f"unusable: {e}; set aside on its next use", style="spec.bad"),
            )
            continue
        table.add_row(
            i.name,
            d.parent.name,
            f"{i.n_files:,}",
            f"{i.n_tokens:,}",
            _human(i.size_bytes),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(i.updated)),
            "\n".join(i.roots),
        )
    return table


def show_list(out, err) -> None:
    from specdec_cli.config import data_dir
    from specdec_cli.stores import corpus as store

    table = corpus_table()
    if table is None:
        err.print(Text(f"Nothing learnt yet in {store.root_dir(data_dir())}: specdec learn PATH indexes a folder."))
        return
    out.print(table)
