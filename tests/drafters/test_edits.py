"""Learnt edits (`drafters/edits.py`): a reply that copies the prompt with a word renamed everywhere is drafted with
the new word after its first occurrence, through prompt lookup and the realigned copy; an edit the reply stops making
stops being drafted; the output stays the target's."""

from __future__ import annotations

import numpy as np

from fakes import Clock, FakeBackend
from specdec_cli.core.controller import AdaptiveK, FixedK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.edits import CopyEdits
from specdec_cli.drafters.suffix import SuffixDrafter

A, ITEMS = 7, 8  # `a` renamed to `items`: one token for one
KEY, KEY_FN = 11, (12, 13)  # `key` renamed to `key_fn`: one token for two
FENCE = [2, 3, 4, 5]  # "```python\n": the reply opens with it, as the prompt's code block does


def code(seed: int = 1, lines: int = 40) -> list[int]:
    """Code-like tokens: lines of 8 tokens (20..399), one of them `a` (70 %) or `key`, then a newline (19)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        toks = [int(t) for t in rng.integers(20, 400, 8)]
        toks[int(rng.integers(8))] = A if rng.random() < 0.7 else KEY
        out += toks + [19]
    return out


def renamed(tokens: list[int]) -> list[int]:
    out = []
    for t in tokens:
        out += [ITEMS] if t == A else list(KEY_FN) if t == KEY else [t]
    return out


PROMPT = np.array([30, 31, 32] + FENCE + code() + [6], dtype=np.int32)  # an instruction, the code block, its end
REPLY = FENCE + renamed(code())


def tokens_per_pass(drafter: SuffixDrafter, k: int = 32) -> float:
    """Drive the lookups as the engine would, verifying against `REPLY`: each pass keeps the longest agreeing
    prefix of any candidate plus the bonus token (an oracle for the controller's choice)."""
    auto = AutoDrafter(drafter)
    drafter.begin(PROMPT)
    out, passes = [], 0
    while len(out) < len(REPLY):
        ctx = np.concatenate((PROMPT, np.array(out, dtype=np.int32))).astype(np.int32)
        best = 0
        for d in auto.lookup(ctx, k, None, None):
            want = REPLY[len(out) : len(out) + len(d.tokens)]
            agree = [a == b for a, b in zip(d.tokens.tolist(), want, strict=False)]
            n = agree.index(False) if False in agree else len(agree)
            best = max(best, n)
        out += REPLY[len(out) : len(out) + best + 1]
        passes += 1
    return len(REPLY) / passes


def test_a_renamed_word_is_drafted_renamed_after_its_first_occurrences():
    plain = SuffixDrafter(None)
    plain.edits.draft = lambda k: np.zeros(0, dtype=np.int32)  # the drafter as it was: no learnt edits
    plain.edits.apply = lambda tokens: tokens
    before, after = tokens_per_pass(plain), tokens_per_pass(SuffixDrafter(None))
    assert before < 4  # each occurrence breaks the copy
    assert after > 3 * before, (before, after)


def test_edits_are_learnt_one_for_one_one_for_two_and_as_insertions_and_drafted_once_seen_twice():
    e = CopyEdits()
    prompt = [40, 41, 42, A, 43, 44, KEY, 45, 46, 47, A, 48, 49, KEY, 50, 51, 52, A, 53, KEY, 54, 55, 56, 57]
    e.begin(np.array(prompt, dtype=np.int32))
    e.anchor(0)
    out = [40, 41, 42, ITEMS, 43, 44, *KEY_FN, 45, 46]
    e.update(np.array(prompt + out, dtype=np.int32))
    assert {(x.old, x.new) for x in e.edits.values()} == {((A,), (ITEMS,)), ((KEY,), KEY_FN)}
    assert e.draft(8).tolist() == [47, A, 48, 49, KEY, 50, 51, 52]  # seen once: a one-off is not repeated
    out += [47, ITEMS, 48, 49, *KEY_FN, 50, 51]
    e.update(np.array(prompt + out, dtype=np.int32))
    assert e.draft(8).tolist() == [52, ITEMS, 53, *KEY_FN, 54, 55, 56]  # seen twice: both applied ahead
    assert e.apply(np.array([A, 60, KEY], dtype=np.int32)).tolist() == [ITEMS, 60, KEY_FN[0]]  # at most k tokens

    ins = CopyEdits()  # `x` -> `x: int`: an insertion, kept with the token before it
    prompt = [40, 41, 60, 42, 43, 44, 60, 45, 46, 47, 60, 48, 49]
    ins.begin(np.array(prompt, dtype=np.int32))
    ins.anchor(0)
    ins.update(np.array(prompt + [40, 41, 60, 70, 71, 42, 43, 44, 60, 70, 71, 45, 46], dtype=np.int32))
    assert [(x.old, x.new, x.hits) for x in ins.edits.values()] == [((60,), (60, 70, 71), 2)]
    assert ins.draft(5).tolist() == [47, 60, 70, 71, 48]
    assert ins.apply(np.array([60, 47], dtype=np.int32)).tolist() == [60, 47]  # a copy of the output has it already


def test_an_edit_the_reply_stops_making_is_no_longer_drafted():
    e = CopyEdits()
    prompt = [40, A, 41, 42, 43, 44, A, 45, 46, A, 47, 48, A, 49, 50, A, 51, 52, A, 53, 54]
    e.begin(np.array(prompt, dtype=np.int32))
    e.anchor(0)
    out = [40, ITEMS, 41, 42, 43, 44, ITEMS, 45, 46]  # learnt, seen twice
    e.update(np.array(prompt + out, dtype=np.int32))
    assert e.draft(3).tolist() == [ITEMS, 47, 48]
    out += [A, 47, 48, A, 49, 50, A]  # kept three times: two hits against three misses
    e.update(np.array(prompt + out, dtype=np.int32))
    (edit,) = e.edits.values()
    assert (edit.hits, edit.misses) == (2, 3) and not edit.trusted
    assert e.draft(4).tolist() == [51, 52, A, 53]
    assert e.apply(np.array([A], dtype=np.int32)).tolist() == [A]


def scripted(prompt: np.ndarray, reply: list[int], vocab: int = 512):
    """logits(prefix) peaking at the reply's next token (then the end token 1): its greedy decode is `reply`."""

    def fn(prefix):
        i = len(prefix) - len(prompt)
        logits = np.zeros(vocab, dtype=np.float32)
        logits[reply[i] if 0 <= i < len(reply) else 1] = 5.0
        return logits

    return fn


def test_through_the_engine_the_output_is_the_targets_in_fewer_passes():
    fn = scripted(PROMPT, REPLY)
    runs = {}
    for name, ctrl in (("none", None), ("fixed", FixedK(16)), ("auto", AdaptiveK())):
        clock = Clock()  # a CPU-like verify curve on a virtual clock: 60 ms + 4 ms a token
        target = FakeBackend(fn, vocab=512, n_ctx=2048, n_batch=64, clock=clock, cost=lambda b: 60.0 + 4.0 * b)
        drafter = None if ctrl is None else AutoDrafter(SuffixDrafter(None))
        steps = [
            r
            for r in SpeculativeEngine(target, drafter, ctrl, clock=clock).generate(
                PROMPT.tolist(), GenerationConfig(max_tokens=len(REPLY))
            )
            if isinstance(r, Step)
        ]
        runs[name] = ([t for s in steps for t in s.emitted], len(steps))
    assert runs["fixed"][0] == runs["auto"][0] == runs["none"][0] == REPLY
    # 373 passes plain; 31 at K = 16 and 21 under --k auto with the edits learnt (103 and 93 without them)
    assert runs["fixed"][1] * 5 < runs["none"][1] and runs["auto"][1] * 5 < runs["none"][1], runs
