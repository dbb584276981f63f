"""`SPECDEC_PASS_LOG` (`server.pass_log`): every pass of the serving loop on disk, as the scheduler made it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import PROMPT_TOKENS, chat, serving  # noqa: E402
from specdec_cli.errors import UsageError  # noqa: E402
from specdec_cli.server.pass_log import PASS_LOG_ENV, PassFile, pass_log  # noqa: E402


def test_the_file_holds_every_pass_a_prefill_wanting_no_logits_and_a_verify_step_all(tmp_path, monkeypatch):
    path = tmp_path / "passes.jsonl"
    monkeypatch.setenv(PASS_LOG_ENV, str(path))
    with serving() as s:
        spec = chat(s.client(), max_tokens=40).model_extra["specdec"]
        made = s.worker.scheduler.passes
    passes = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(passes) == made
    assert all(p["ms"] >= 0 and len(p["parts"]) == 1 for p in passes)  # one request: one slot a pass
    parts = [p["parts"][0] for p in passes]
    prefill = [(rows, logits) for _, rows, logits in parts[: len(parts) - spec["target_passes"]]]
    steps = [(rows, logits) for _, rows, logits in parts[len(parts) - spec["target_passes"] :]]
    # the prompt but its last token, which the first step evaluates with its drafts
    assert sum(rows for rows, _ in prefill) == len(PROMPT_TOKENS) - 1 and all(logits == 0 for _, logits in prefill)
    assert all(rows == logits for rows, logits in steps)  # a verify step wants every row's logits
    assert sum(rows for rows, _ in steps) == spec["target_passes"] + spec["drafted"]  # each: its drafts + the bonus


def test_a_path_that_cannot_be_appended_to_is_one_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv(PASS_LOG_ENV, str(tmp_path / "missing" / "passes.jsonl"))
    with pytest.raises(UsageError, match="cannot append to it.*unset it"):
        pass_log()
    monkeypatch.setenv(PASS_LOG_ENV, "")
    assert pass_log() is None


def test_it_keeps_the_last_passes_as_the_scheduler_log_does(tmp_path):
    log = PassFile(tmp_path / "p.jsonl")
    for i in range(300):
        log.append((float(i), ((0, 1, 1),)))
    assert len(log) == 256 and log[0][0] == 44.0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 300


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full (every write: no space left)")
def test_a_write_that_fails_ends_the_file_never_the_pass():
    log = PassFile(Path("/dev/full"))
    log.append((1.0, ((0, 1, 1),)))  # ENOSPC: the pass goes on
    log.append((2.0, ((0, 1, 1),)))
    assert [ms for ms, _ in log] == [1.0, 2.0]
