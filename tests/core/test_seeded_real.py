"""A seeded sampled run on llama.cpp gives the same text speculative or not (`core.sampling`: keyed noise per
position), on a tiny random-weight hybrid (lfm2) and on SmolLM2."""

from __future__ import annotations

import json

import pytest

from specdec_cli.__main__ import main

pytestmark = pytest.mark.real

PROMPT = "one two three four one two three four one two three four one two three"


@pytest.mark.parametrize("model", ["lfm2_tiny", "smollm2_path"])
def test_a_seeded_sampled_run_gives_the_same_text_speculative_or_not(model, request, tmp_path, capsys):
    path = request.getfixturevalue(model)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    runs = []
    # plain decoding, prompt lookup at a fixed K (it drafts whatever a pass costs), then the default (auto chooses)
    for method in (["--method", "none"], ["--method", "ngram", "--k", "4"], []):
        code = main(
            [
                "run",
                str(prompt),
                "-t",
                str(path),
                "-n",
                "24",
                "--raw",
                "--json",
                "-",
                "--no-prompt-cache",
                "--temperature",
                "0.8",
                "--seed",
                "7",
                *method,
            ]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        runs.append(json.loads(out))
    plain, spec, auto = runs
    assert spec["stats"]["n_drafted"] > 0  # drafts were verified (and rejected, which consumes randomness)
    assert spec["text"] == plain["text"] and spec["tokens"] == plain["tokens"]
    assert auto["tokens"] == plain["tokens"]
