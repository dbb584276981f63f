"""`--method mtp` on llama.cpp: the tiny random-weight qwen35 carries one MTP (nextn) block, so the target's own block
drafts (through an MTP context, `models.llama.LlamaMtp`) and the target, a hybrid rolled back by snapshots, verifies.
Random weights make the block a poor drafter, but a deterministic one: the output must be plain decoding's."""

from __future__ import annotations

import json

import pytest

from specdec_cli.__main__ import main

pytestmark = pytest.mark.real

PROMPT = "one two three four one two three four one two three four one two three"


def run(capsys, tmp_path, path, *args):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    code = main(["run", str(prompt), "-t", str(path), "-n", "40", "--raw", "--json", "-", "--no-prompt-cache", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.mark.parametrize("k", ["4", "16"])
def test_the_mtp_block_drafts_and_the_output_is_plain_decodings(qwen35_tiny, tmp_path, capsys, k) -> None:
    code, plain, err = run(capsys, tmp_path, qwen35_tiny, "--method", "none")
    assert code == 0, err
    code, mtp, err = run(capsys, tmp_path, qwen35_tiny, "--method", "mtp", "--k", k)
    assert code == 0, err
    assert mtp["tokens"] == plain["tokens"]
    sources = mtp["stats"]["by_source"]
    assert set(sources) == {"mtp"} and sources["mtp"]["drafted"] >= 8  # every draft the block's


def test_auto_on_a_target_with_an_mtp_block_gives_plain_decodings_output(qwen35_tiny, tmp_path, capsys) -> None:
    code, plain, err = run(capsys, tmp_path, qwen35_tiny, "--method", "none")
    assert code == 0, err
    code, auto, err = run(capsys, tmp_path, qwen35_tiny)
    assert code == 0, err
    assert auto["tokens"] == plain["tokens"]


def test_mtp_on_a_model_without_a_block_is_one_line_with_the_fix(lfm2_tiny, tmp_path, capsys) -> None:
    code, _, err = run(capsys, tmp_path, lfm2_tiny, "--method", "mtp")
    assert code != 0
    assert "needs a target with an MTP block" in err and "Traceback" not in err
