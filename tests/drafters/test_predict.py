"""The predicted-outputs drafter: alignment pointer, re-sync after edits, token-boundary differences, the engine
(lossless, every draft accepted when the prediction is the output), and reading a prediction file."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeBackend, greedy_reference, hashed_logits
from specdec_cli.cli.inputs import read_prediction, read_prompt
from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.sampling import GREEDY
from specdec_cli.drafters.predict import PredictionDrafter
from specdec_cli.errors import UsageError

# A toy code vocabulary: id -> text.
VOCAB = {
    2: "def",
    3: " f",
    4: "(",
    5: "x",
    6: "):",
    7: "\n",
    8: "    ",
    9: "a",
    10: " =",
    11: " compute",
    12: "b",
    13: " 2",
    14: "c",
    15: " 3",
    16: "return",
    17: " x",
    18: "d",
    19: " 4",
    20: " foo",
    21: " foo(",
    22: ")",
    23: "z",
    24: " 9",
    25: " 7",
    26: "```",
    27: "python",
    28: "e",
    29: " 5",
}
(
    DEF,
    F,
    LP,
    X,
    RPC,
    NL,
    IND,
    A,
    EQ,
    COMP,
    B,
    TWO,
    C,
    THREE,
    RET,
    SX,
    D,
    FOUR,
    FOO,
    FOO_LP,
    RP,
    Z,
    NINE,
    SEVEN,
    FENCE,
    PY,
    E,
    FIVE,
) = range(2, 30)
PROMPT = np.array([5, 9, 3, 17], dtype=np.int32)  # any prompt: the drafter only looks at the output after it


def piece(t: int) -> bytes:
    return VOCAB[int(t)].encode()


def tokenize(text: str) -> list[int]:
    """Greedy longest match over VOCAB (a stand-in for the target's tokenizer)."""
    by_text = {v: k for k, v in VOCAB.items()}
    out, i = [], 0
    while i < len(text):
        j = max(j for j in range(i + 1, len(text) + 1) if text[i:j] in by_text)
        out.append(by_text[text[i:j]])
        i = j
    return out


L0 = [DEF, F, LP, X, RPC, NL]  # def f(x):
L1 = [IND, A, EQ, COMP, LP, X, RP, NL]  #     a = compute(x)
L2 = [IND, B, EQ, COMP, LP, TWO, RP, NL]  #     b = compute( 2)
L3 = [IND, C, EQ, COMP, LP, THREE, RP, NL]  #     c = compute( 3)
L4 = [IND, D, EQ, COMP, LP, FOUR, RP, NL]  #     d = compute( 4)
L5 = [IND, RET, SX, NL]  #     return x
PRED = np.array(L0 + L1 + L2 + L3 + L4 + L5, dtype=np.int32)
INSERTED = [IND, Z, EQ, NINE, NL]  #     z = 9


def make(pred=PRED, **kw) -> PredictionDrafter:
    d = PredictionDrafter(np.asarray(pred, dtype=np.int32), piece=piece, **kw)
    d.begin(PROMPT)
    return d


def propose(d: PredictionDrafter, output: list[int], k: int = 6):
    context = np.concatenate((PROMPT, np.asarray(output, dtype=np.int32)))
    return d.propose(context, k, GREEDY, np.random.default_rng(0))


def drafts_after_each_token(d: PredictionDrafter, output: list[int], k: int = 6, *, full: bool = False) -> list:
    """Feed the output one token per step (a plain decoding step each time) and collect every draft (its tokens,
    or the `Draft` with full=True)."""
    drafts = [propose(d, output[:i], k) for i in range(len(output) + 1)]
    return drafts if full else [x.tokens.tolist() for x in drafts]


def test_tokenize_helper_spells_the_vocabulary():
    assert tokenize("    a = compute(x)\n") == L1
    assert b"".join(map(piece, PRED)).decode().splitlines()[2] == "    b = compute( 2)"


def test_drafts_from_the_first_token_at_the_start_with_evidence_one():
    d = make()
    draft = propose(d, [], k=4)
    assert draft.tokens.tolist() == PRED[:4].tolist()
    assert draft.tokens.dtype == np.int32
    assert draft.match_len == 1  # never 0: 0 means "no evidence" to the controller
    assert draft.dists is None and draft.source == "predict" and 0.0 < draft.score <= 1.0


def test_pointer_advances_while_the_output_follows_the_prediction():
    d = make()
    assert propose(d, [], 4).tokens.tolist() == PRED[0:4].tolist()
    # the engine accepted 2 drafts and the target added the third: the pointer is after 3 tokens
    draft = propose(d, PRED[:3].tolist(), 4)
    assert draft.tokens.tolist() == PRED[3:7].tolist()
    assert draft.match_len == 3
    draft = propose(d, PRED[:8].tolist(), 4)
    assert draft.tokens.tolist() == PRED[8:12].tolist()
    assert draft.match_len == 8 and draft.score == 1.0
    assert d.pointer == 8


def test_without_begin_the_first_context_is_taken_as_the_prompt():
    d = PredictionDrafter(PRED, piece=piece)
    d.reset()
    assert d.propose(PROMPT, 3, GREEDY, np.random.default_rng(0)).tokens.tolist() == PRED[:3].tolist()
    ctx = np.concatenate((PROMPT, PRED[:2]))
    assert d.propose(ctx, 3, GREEDY, np.random.default_rng(0)).tokens.tolist() == PRED[2:5].tolist()


def test_reset_and_prefill_restart_at_the_prediction_start():
    d = make()
    propose(d, PRED[:10].tolist())
    d.reset()
    d.prefill(PROMPT)
    assert propose(d, [], 3).tokens.tolist() == PRED[:3].tolist()


def test_deleted_line_resyncs_on_the_next_token():
    # The output drops L2: after "    c" (L3's first tokens) the draft continues L3, then L4.
    output = L0 + L1 + L3 + L4 + L5
    drafts = drafts_after_each_token(make(), output, k=6)
    at = len(L0 + L1) + 2  # the output so far ends "...\n    c": one token past the divergence
    assert drafts[at] == (L3 + L4)[2:8]
    # and from there on every draft is the output's own continuation
    for i in range(at, len(output)):
        assert drafts[i] == output[i : i + 6]


def test_inserted_line_resyncs_when_it_ends():
    # The output inserts a new line before L2; right after its "\n" the draft is L2 again.
    output = L0 + L1 + INSERTED + L2 + L3 + L4 + L5
    d = make()
    drafts = drafts_after_each_token(d, output, k=6)
    end = len(L0 + L1 + INSERTED)
    assert drafts[end] == (L2 + L3)[:6]
    for i in range(end, len(output)):
        assert drafts[i] == output[i : i + 6]
    assert d.pointer == len(PRED)


def test_a_resync_guess_contradicted_at_once_leaves_the_anchor_in_place():
    # Short lines: inside the inserted "    z = 9", " =" re-syncs (a guess) to L2's " =", and " 9" contradicts it at
    # once. The near window must stay centred where the prediction was left (L2's start), so that after the
    # inserted line's "\n" the nearest "\n" is L1's end (draft L2), not L2's end 3 bytes after the guess (draft L3).
    s1, s2, s3 = [IND, A, EQ, FIVE, NL], [IND, B, EQ, TWO, NL], [IND, C, EQ, THREE, NL]
    output = L0 + s1 + INSERTED + s2 + s3
    drafts = drafts_after_each_token(make(L0 + s1 + s2 + s3), output, k=5)
    end = len(L0 + s1 + INSERTED)
    assert drafts[end - 2] == [TWO, NL, IND, C, EQ]  # the guess after "    z ="
    assert drafts[end] == s2


def test_inserted_line_that_looks_like_a_changed_next_line_costs_two_steps():
    # "z = compute( 9)" reads like L2 with two changes, so the drafter first takes it for a changed L2 and drafts
    # L3 after it; the inserted line is recognised when the output's next line starts with "    b".
    inserted = [IND, Z, EQ, COMP, LP, NINE, RP, NL]
    output = L0 + L1 + inserted + L2 + L3 + L4 + L5
    drafts = drafts_after_each_token(make(), output, k=6)
    end = len(L0 + L1 + inserted)
    assert drafts[end] == (L3 + L4)[:6]  # the changed-line reading
    assert drafts[end + 2] == (L2 + L3)[2:8]  # after "    b": L2 again
    for i in range(end + 2, len(output)):
        assert drafts[i] == output[i : i + 6]


def test_changed_line_resyncs_at_its_end():
    changed = [IND, B, EQ, COMP, LP, SEVEN, RP, NL]  # "b = compute( 7)" instead of "( 2)"
    output = L0 + L1 + changed + L3 + L4 + L5
    drafts = drafts_after_each_token(make(), output, k=6)
    assert drafts[len(L0 + L1) + 6] == []  # the output ends "( 7": nothing like it in the prediction
    after = len(L0 + L1) + 7  # the output ends "( 7)": its ")" re-syncs inside the changed line
    assert drafts[after] == (L2 + L3)[7:13]
    for i in range(after, len(output)):
        assert drafts[i] == output[i : i + 6]


def test_resync_prefers_the_occurrence_nearest_the_pointer():
    # L2 occurs twice; the output deletes L1, so "    b" must resume at the first L2 (followed by L3), not the
    # second one (followed by L4).
    pred = L0 + L1 + L2 + L3 + L2 + L4 + L5
    output = L0 + L2
    d = make(pred)
    drafts = drafts_after_each_token(d, output, k=8)
    assert drafts[len(L0) + 2] == (L2 + L3)[2:10]


def test_resync_searches_the_whole_prediction_when_the_near_window_has_no_match():
    # A small near window (2 tokens behind, 4 ahead): the output jumps from L0 to L5, 32 tokens ahead.
    output = L0 + L5
    d = make(ahead=4, behind=2)
    drafts = drafts_after_each_token(d, output, k=4)
    assert drafts[len(L0) + 2] == [SX, NL]  # after "    return": continue L5
    assert propose(d, output, 4).tokens.tolist() == []  # the prediction is used up


def test_global_resync_needs_more_than_one_token_of_evidence():
    # Only the last token ("return") would match far away; a one-token match outside the window is not trusted.
    d = make(ahead=2, behind=0)
    assert propose(d, [E, RET], 4).tokens.tolist() == []
    assert propose(d, [E, RET, SX], 4).tokens.tolist() == [NL]  # " return x" now matches 2 tokens: L5


def test_output_splitting_a_prediction_token_drafts_the_rest_of_it():
    # The prediction has " foo(" as one token; the output writes " foo" then "(": the draft right after " foo" is
    # the rest of " foo(" re-tokenized ("("), then the prediction's tokens.
    pred = L0 + [IND, A, EQ, FOO_LP, X, RP, NL] + L5
    output = L0 + [IND, A, EQ, FOO, LP, X, RP, NL] + L5
    full = drafts_after_each_token(make(pred, tokenize=tokenize), output, k=4, full=True)
    drafts = [x.tokens.tolist() for x in full]
    at = len(L0) + 4  # the output ends "    a = foo"
    assert drafts[at] == [LP, X, RP, NL]
    for i in range(at, len(output)):
        assert drafts[i] == output[i : i + 4]
    assert full[at].match_len == at  # the byte match covers the whole output so far (it agrees with the prediction)


def test_split_token_without_tokenize_waits_one_step():
    pred = L0 + [IND, A, EQ, FOO_LP, X, RP, NL]
    output = L0 + [IND, A, EQ, FOO, LP, X, RP, NL]
    drafts = drafts_after_each_token(make(pred), output, k=3)
    at = len(L0) + 4
    assert drafts[at] == []  # the rest of " foo(" cannot be spelled without a tokenizer
    assert drafts[at + 1] == [X, RP, NL]  # after "(", the prediction's own tokens again


def test_output_merging_prediction_tokens_continues_after_them():
    # The prediction has " foo" + "(", the output writes " foo(" as one token.
    pred = L0 + [IND, A, EQ, FOO, LP, X, RP, NL] + L5
    output = L0 + [IND, A, EQ, FOO_LP, X, RP, NL] + L5
    drafts = drafts_after_each_token(make(pred), output, k=4)
    at = len(L0) + 4  # the output ends "    a = foo("
    assert drafts[at] == [X, RP, NL, IND]


def test_reply_opening_with_a_code_fence_resyncs_at_the_prediction_start():
    output = [FENCE, PY, NL] + PRED.tolist()
    drafts = drafts_after_each_token(make(), output, k=4)
    assert drafts[0] == PRED[:4].tolist()
    assert drafts[3] == PRED[:4].tolist()  # after "```python\n": the prediction's first line


def test_empty_prediction_drafts_nothing():
    d = make(np.zeros(0, dtype=np.int32))
    assert len(propose(d, [], 4)) == 0
    assert len(propose(d, L0, 4)) == 0


def test_prediction_must_be_one_dimensional():
    with pytest.raises(ValueError, match="one-dimensional"):
        PredictionDrafter(np.zeros((2, 2), np.int32), piece=piece)


def test_context_is_not_modified():
    d = make()
    context = np.concatenate((PROMPT, np.asarray(L0 + [IND, Z], np.int32)))
    before = context.copy()
    d.propose(context, 4, GREEDY, np.random.default_rng(0))
    assert np.array_equal(context, before)


# -- through the engine, on the fake backend --------------------------------------------------------------------------

ENGINE_PROMPT = [5, 9, 3, 17, 4, 22, 8]


def generate(target, drafter, k, max_tokens):
    steps = [
        r
        for r in SpeculativeEngine(target, drafter, FixedK(k)).generate(
            ENGINE_PROMPT, GenerationConfig(max_tokens=max_tokens)
        )
        if isinstance(r, Step)
    ]
    return steps, [t for s in steps for t in s.emitted]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_prediction_equal_to_the_output_accepts_every_draft(k):
    reference = greedy_reference(hashed_logits, ENGINE_PROMPT, 40)
    assert len(reference) == 40
    target = FakeBackend(hashed_logits)
    drafter = PredictionDrafter(np.array(reference, np.int32), piece=target.piece)
    steps, tokens = generate(target, drafter, k, 40)
    assert tokens == reference
    for s in steps:
        assert s.n_accepted == len(s.drafted) == s.k  # every step drafted all it was asked for, all accepted
        if s.k:
            assert s.source == "predict"
    assert len(steps) == -(-40 // (k + 1))  # k accepted + 1 target token per pass


def test_edited_prediction_through_the_engine_stays_lossless_and_realigns():
    reference = greedy_reference(hashed_logits, ENGINE_PROMPT, 60)
    # the prediction differs from the output: 3 tokens deleted at 10, 2 inserted at 30, one changed at 45
    pred = (
        reference[:10] + reference[13:30] + [7, 7] + reference[30:45] + [(reference[45] + 1) % 28 + 2] + reference[46:]
    )
    target = FakeBackend(hashed_logits)
    steps, tokens = generate(target, PredictionDrafter(np.array(pred, np.int32), piece=target.piece), 4, 60)
    assert tokens == reference
    assert any(s.n_accepted < len(s.drafted) for s in steps)  # the edits were really met
    assert steps[-2].n_accepted == len(steps[-2].drafted) == 4  # and the drafter was aligned again at the end
    assert sum(s.n_accepted for s in steps) >= 40


# -- reading the prediction file --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"x = 1\x00\n", "The prediction in {} looks binary (it contains NUL bytes). Give a UTF-8 text file."),
        (b"caf\xe9\n", "The prediction in {} is not UTF-8 (invalid byte at offset 3)."),
        (b"  \n", "The prediction in {} is empty. Write something in it."),
    ],
)
def test_bad_prediction_file_is_one_usage_error(tmp_path, data, message):
    path = tmp_path / "original.py"
    path.write_bytes(data)
    with pytest.raises(UsageError) as e:
        read_prediction(str(path))
    assert str(e.value).startswith(message.format(path))
    assert "\n" not in str(e.value)


def test_missing_or_directory_prediction_file(tmp_path):
    with pytest.raises(UsageError) as e:
        read_prediction(str(tmp_path / "nope.py"))
    assert (
        str(e.value) == f"Prediction file {tmp_path / 'nope.py'} does not exist. Give a path to a text file, or - "
        "for stdin."
    )
    with pytest.raises(UsageError, match="is a directory"):
        read_prediction(str(tmp_path))


def test_prediction_file_is_read_like_a_prompt(tmp_path):
    path = tmp_path / "original.py"
    path.write_bytes("\ufeffdef f():\n    return 'é'\n".encode())
    assert read_prediction(str(path)) == "def f():\n    return 'é'\n"
    # the prompt reader's messages are unchanged
    with pytest.raises(UsageError, match=r"^Prompt file .* does not exist\."):
        read_prompt(str(tmp_path / "nope.txt"))


# -- the packaged edit prompts ----------------------------------------------------------------------------------------


def test_packaged_predict_prompts_quote_their_original_whole():
    from specdec_cli.prompts import builtin, predict_cases

    cases = predict_cases()
    assert [c.name for c in cases] == ["add_parameter", "change_line", "rename"]
    for c in cases:
        assert 150 <= c.prediction.count("\n") <= 300
        assert f"```python\n{c.prediction}```\n" in c.prompt  # the file to edit, whole, in the prompt
        assert "complete module" in c.prompt
    assert all(c.kind != "predict" for c in builtin())  # not part of the tune/bench classes
