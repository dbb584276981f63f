"""benchmarks/gpu_check.py on this CPU (`--no-build`: the installed llama-cpp-python) with a tiny random GGUF: every
step runs and the one table comes out. Real llama.cpp passes, so `real` (slow on a CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real
ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_runs_end_to_end_on_the_cpu(tmp_path) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    edit = tmp_path / "edit.txt"  # a short copy-heavy edit: the tiny model's tokenizer spends a token a character
    edit.write_text((ROOT / "specdec_cli/prompts/edit/posixpath_rename.txt").read_text()[:600])
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--no-build",
            "--shape",
            "tiny",
            "--tokens",
            "16",
            "--no-real",
            "--edit",
            str(edit),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    table = p.stdout
    assert p.returncode == 0, table + p.stderr[-2000:]
    for row in (
        "card",
        "build",
        "random-tiny.gguf",
        "specdec doctor --measure",
        "v(1)",
        "GPU lines",
        "specdec run EDIT",
        "x plain",
        "host work per pass",
        "energy per token",
        "serve --parallel 4 --method auto",
        "serve --parallel 4 --method none",
        "replies at once equal",
    ):
        assert row in table, row
    assert (tmp_path / "work" / "gpu_check.txt").read_text().strip() == table.strip()
