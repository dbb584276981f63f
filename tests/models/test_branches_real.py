"""Two branches in one llama.cpp pass, on real models.

A second branch lives in sequence 1 of a unified KV cache and shares the committed prefix's cells (llama.cpp's
examples/speculative does the same with -kvu). What must hold: the branch's rows score what a one-branch pass over
it scores (up to batched-evaluation numerics: the same argmax where the gap is not a near-tie), either branch can be
kept, and afterwards the cache continues exactly as if that branch had been decoded alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_cli.models.backend import branch_rows
from specdec_cli.models.llama import LlamaBackend

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def model(request, smollm2_path, gemma_path):
    backend = LlamaBackend(smollm2_path if request.param == "smollm2" else gemma_path, n_ctx=512, n_batch=128)
    yield backend
    backend.close()


def agree(a: np.ndarray, b: np.ndarray, margin: float = 0.5) -> bool:
    """Same argmax in every row whose top-2 gap (in b) is not a near-tie."""
    top = np.sort(b, axis=1)[:, -2:]
    clear = top[:, 1] - top[:, 0] > margin
    return bool((a.argmax(1) == b.argmax(1))[clear].all())


def test_a_second_branch_scores_what_a_one_branch_pass_scores(model):
    prompt = model.tokenize("The quick brown fox jumps over the lazy dog. " * 6)
    prefix, last = prompt[:-1], prompt[-1]
    a = np.array(model.tokenize(" The quick brown fox", add_special=False), np.int32)
    b = np.array(model.tokenize(" A slow red cat sleeps", add_special=False), np.int32)
    model.truncate(0)
    model.decode(prefix)
    logits = model.decode_branches([last, *a], b).copy()
    rows_a, rows_b = branch_rows(a, b)
    assert model.branches and logits.shape[0] == 1 + len(a) + len(b) - int(a[0] == b[0])
    model.truncate(len(prefix) + 1 + 3, branch=True)  # keep b's first three tokens
    assert list(model.tokens) == [*prefix, last, *b[:3]]
    after_branch = model.decode([int(b[3])], n_logits=1).copy()
    for branch, rows in ((a, rows_a), (b, rows_b)):
        model.truncate(len(prefix))
        alone = model.decode([last, *branch], n_logits=len(branch) + 1)
        assert agree(logits[rows], alone)
    model.truncate(0)
    model.decode([*prefix, last, *b[:3]])
    assert agree(after_branch, model.decode([int(b[3])], n_logits=1))  # the kept cells are b's, at b's positions
    model.truncate(len(prefix))
    model.decode_branches([last, *a], b)
    model.truncate(len(prefix) + 2)  # keep the main path's first token: the branch is gone
    assert list(model.tokens) == [*prefix, last, int(a[0])]
    model.decode([int(a[1])], n_logits=1)  # sequence 1 was dropped: nothing left to collide with


def test_the_multi_sequence_context_decodes_one_sequence_bit_identically(smollm2_path):
    # n_seq_max = 2 with a unified KV cache must not change plain decoding's numerics
    rows = []
    for branches in (True, False):
        backend = LlamaBackend(smollm2_path, n_ctx=512, n_batch=128, branches=branches)
        assert backend.branches == branches
        prompt = backend.tokenize("Once upon a time, in a land far away, " * 4)
        backend.decode(prompt[:-1])
        rows.append(backend.decode(prompt[-1:] + prompt[:9], n_logits=10).copy())
        backend.close()
    np.testing.assert_array_equal(rows[0], rows[1])
