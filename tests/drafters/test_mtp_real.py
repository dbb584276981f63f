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


def test_an_mtp_head_catches_up_on_its_lanes_passes_beside_another_lane(qwen35_tiny) -> None:
    """Under `specdec serve --parallel` the first slot's passes go through `decode_many`: the MTP head following that
    lane catches up on each of them (the other lane's rows never reach it), so it drafts what it drafts after the
    same tokens through `decode` on a context of one sequence. Without the catch-up it drafted from a stale state."""
    import numpy as np

    from specdec_cli.models.llama import LlamaBackend, LlamaMtp

    def backend(n_lanes: int) -> LlamaBackend:
        return LlamaBackend(
            qwen35_tiny, n_ctx=256, n_batch=64, n_threads=2, n_gpu_layers=0, extra_bufts=False, n_lanes=n_lanes
        )

    prompt = np.asarray([5, 9, 13, 17, 21, 25, 29, 33, 5, 9, 13, 17], np.int32)
    other = np.asarray([40 + i for i in range(12)], np.int32)  # as long, and first: one call for both but for the head
    first = lambda logits, i: int(np.argmax(logits))  # noqa: E731

    alone = backend(1)
    alone_head = LlamaMtp(alone)
    alone.decode(prompt, 1)
    want = alone_head.draft(int(prompt[-1]), len(prompt), 4, first)

    shared = backend(2)
    head = LlamaMtp(shared)
    shared.decode_many([(shared.lane(1), other, 1), (shared, prompt, 1)])
    assert (head._h_start, len(head._h)) == (0, len(prompt))  # its lane's call, not the other's
    assert head.draft(int(prompt[-1]), len(prompt), 4, first) == want
    for b in (alone_head, alone, head, shared):
        b.close()
