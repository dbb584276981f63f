"""Reports that leave the terminal (a pipe, a file) are whole: tables take the width they need, never "…".

Before, Rich assumed 80 columns (or $COLUMNS) for anything that is not a terminal, and `specdec bench > report.txt`
read `spee…`, `acce…`, `peak …`. Every command that prints a table goes through `render.make_console`.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.table import Table

from fakes import bench_doc, run
from specdec_cli.__main__ import main
from specdec_cli.cli.console import make_console
from specdec_cli.measure import bench as B

# ---- reports through a pipe: whole cells


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # what a pipe or a file got before: Rich's default width


def test_a_table_written_to_a_file_takes_the_width_it_needs(narrow):
    buf = io.StringIO()
    table = Table()
    for name in (
        "configuration",
        "decode tok/s",
        "speedup over none",
        "acceptance",
        "mean accepted length",
        "time to first token",
        "peak RSS",
    ):
        table.add_column(name, no_wrap=True)
    table.add_row("auto (the default)", "29.9", "1.57×", "78 %", "12.30", "1.43 s", "1.90 GiB")
    make_console(file=buf).print(table)
    text = buf.getvalue()
    assert "…" not in text and "speedup over none" in text and "1.90 GiB" in text
    assert max(map(len, text.splitlines())) > 80
    assert all(line == line.rstrip() or "│" in line for line in text.splitlines())  # not padded to the width


def test_bench_report_through_a_pipe_has_no_ellipsis(narrow, capsys, tmp_path):
    configs = B.configs_for(["none", "auto", "ngram", "suffix"], peer=True)
    prompts = [
        ("textwrap_rename", "edit"),
        ("colorsys_type_hints", "edit"),
        ("shlex_quote", "explain"),
        ("lighthouse_story", "write"),
        ("sched_rename_method", "rewrite"),
    ]
    runs = []
    for repeat in (0, 1):
        for name, _ in prompts:
            for i, c in enumerate(configs):
                runs.append(run(c.label, name, 17.5 + i, repeat=repeat, tokens=(1, 2, 3), rss=1990000))
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_doc(runs, configs, prompts)), encoding="utf-8")
    assert main(["bench", "--from-json", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "…" not in out
    for header in ("speedup", "accept", "peak RSS", "= none", "sched_rename_method", "1.90 GiB"):
        assert header in out, header


def test_models_list_through_a_pipe_has_no_ellipsis(narrow, capsys):
    assert main(["models", "list"]) == 0
    out, _ = capsys.readouterr()
    assert "…" not in out and "qwen2.5-coder-1.5b" in out
    assert "SmolLM2-135M-Instruct, Q4_1: tiny, for fast tests" in out  # one line: not folded to fit 80 columns
