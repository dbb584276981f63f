"""Lanes on a real model: several sequences in one llama.cpp context, their verify passes shared (`server.lanes`).

A shared pass is a larger batch, and llama.cpp's kernels are not batch-invariant: each lane's greedy output must be its
output alone up to numerical near-ties. Where they part, the two tokens' logits are within a near-tie of each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from specdec_cli.core.controller import FixedK
from specdec_cli.core.engine import GenerationConfig, Rows, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.drafters.ngram import NgramDrafter
from specdec_cli.models.llama import LlamaBackend
from specdec_cli.server.lanes import Priority, Scheduler

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function `is_prime(n)` with a docstring.",
    "Rename x to total in:\ndef f(x):\n    y = x + 1\n    return x * y\n",
    "List the planets of the solar system, one per line.",
]
NEAR_TIE = 1.0  # logits: a larger gap at a divergence would be a bug, not rounding


def _tokens(backend, text):
    prompt = backend.format_chat([{"role": "user", "content": text}])
    return backend.tokenize(prompt, add_special=False, parse_special=True)


def _out(records):
    return [t for r in records if isinstance(r, Step) for t in r.emitted]


def _program(engine, prompt, config, got):
    """The engine's steps as a scheduler program: rows out, emitted tokens into `got`."""
    steps, answer = engine.steps(prompt, config), None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration:
            return
        answer = None
        if isinstance(item, Rows):
            answer = yield item
        elif isinstance(item, Step):
            got += item.emitted


def test_three_lanes_sharing_passes_give_each_its_own_greedy_output(smollm2_path):
    alone_backend = LlamaBackend(smollm2_path, n_ctx=512)
    prompts = [_tokens(alone_backend, p) for p in PROMPTS]
    alone = []
    for p in prompts:
        alone_backend.truncate(0)
        alone.append(
            _out(
                SpeculativeEngine(alone_backend, NgramDrafter(1, 3), FixedK(4)).generate(
                    p, GenerationConfig(max_tokens=32)
                )
            )
        )
    shared_backend = LlamaBackend(smollm2_path, n_ctx=512, n_lanes=3)
    # a flat curve (a GPU's): long requests share the passes (on a CPU's they run one at a time)
    sched = Scheduler(shared_backend, 3, curve=VerifyCurve(ms=tuple(50.0 for _ in range(65))))
    out: dict[int, list[int]] = {}
    for i, slot in enumerate(sched.slots):
        engine = SpeculativeEngine(slot.backend, NgramDrafter(1, 3), FixedK(4))
        engine.passes = slot
        out[i] = []
        sched.start(slot, _program(engine, prompts[i], GenerationConfig(max_tokens=32), out[i]), Priority(seq=i))
    while sched.busy:
        sched.step()
    assert max(len(parts) for _, parts in sched.log) >= 2, "no pass was shared"
    for i in range(3):
        a, b = out[i], alone[i]
        part = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if part is None and len(a) == len(b):
            continue
        part = min(len(a), len(b)) if part is None else part  # one of them ended (an end token) where the other went on
        # a divergence: at the context they share, evaluated alone, the two best tokens are a near-tie
        alone_backend.truncate(0)
        logits = alone_backend.decode(np.asarray(prompts[i] + a[:part], np.int32), n_logits=1)[0]
        top2 = np.sort(logits)[-2:]
        assert float(top2[1] - top2[0]) < NEAR_TIE, (i, part, float(top2[1] - top2[0]))
    shared_backend.close()
    alone_backend.close()


@pytest.mark.parametrize(
    ("keys", "want_calls"), [(None, [46, 29, 21]), ([0, 0, 1, 0], [23, 29, 23, 21])], ids=["by-rows", "by-keys"]
)
def test_a_pass_of_unequal_parts_gives_each_part_its_own_logits(smollm2_path, monkeypatch, keys, want_calls):
    """With a KV stream per lane, `decode_many` evaluates unequal parts one `llama_decode` per row count, the parts
    of equal rows together (`_decode_apart`), or apart where their keys (`calls`) differ: every part gets the logits
    of its own rows, in the order the parts were given, the earlier calls' copied."""
    from specdec_cli.models import llama

    solo = LlamaBackend(smollm2_path, n_ctx=512)
    shared = LlamaBackend(smollm2_path, n_ctx=512, n_lanes=4)
    lanes = [shared.lane(i) for i in range(4)]
    prompts = [_tokens(solo, p) for p in [*PROMPTS, PROMPTS[0]]]
    rows = [3, 9, 3, 1]  # rows of each lane's part (logits of all): lanes 0 and 2 share a call
    calls: list[int] = []
    decode = llama.llama_cpp.llama_decode
    monkeypatch.setattr(
        llama.llama_cpp, "llama_decode", lambda ctx, batch: calls.append(batch.n_tokens) or decode(ctx, batch)
    )
    parts = [(lanes[i], np.asarray(prompts[i][: 20 + rows[i]], np.int32), rows[i]) for i in range(4)]
    got = shared.decode_many(parts, keys)
    assert calls == want_calls  # lanes 0 and 2 (23 rows each) together unless their keys differ, lane 1, lane 3
    for i in range(4):
        solo.truncate(0)
        want = solo.decode(np.asarray(prompts[i][: 20 + rows[i]], np.int32), n_logits=rows[i])
        assert got[i].shape == want.shape
        assert (got[i].argmax(-1) == want.argmax(-1)).all() and np.abs(got[i] - want).max() < NEAR_TIE, i
    shared.close()
    solo.close()


def test_a_prompt_prefix_copied_from_another_lane_gives_that_lanes_logits_bit_for_bit(smollm2_path, gemma_path):
    """`copy_prefix`: a lane holding the first tokens of a prompt whose first 40 another lane holds gets those cells
    copied (the peer's KV stream, truncated), and its next rows' logits are the peer's own on the same rows, exactly;
    the peer is unchanged. Fewer than COPY_MIN rows more, or a sliding-window target (Gemma 3), copy nothing."""
    from specdec_cli.models.llama import COPY_MIN

    backend = LlamaBackend(smollm2_path, n_ctx=512, n_lanes=3)
    lanes = [backend.lane(i) for i in range(3)]
    words = _tokens(backend, PROMPTS[0] + " " + PROMPTS[2])
    common, mine, theirs = words[:40], words[40:46], words[46:52]
    lanes[0].decode(np.asarray(common + theirs, np.int32))
    lanes[1].decode(np.asarray(common[:4], np.int32))
    assert lanes[1].copy_prefix(np.asarray(common[4:] + mine, np.int32), lanes) == 36
    assert list(lanes[1].tokens) == common and list(lanes[0].tokens) == common + theirs
    got = lanes[1].decode(np.asarray(mine, np.int32), n_logits=len(mine)).copy()
    lanes[0].truncate(40)
    want = lanes[0].decode(np.asarray(mine, np.int32), n_logits=len(mine))
    assert np.array_equal(got, want)
    lanes[2].decode(np.asarray(common[: 40 - COPY_MIN + 1], np.int32))
    # lanes 0 and 1 both hold common + mine now: 31 rows more of common + theirs
    assert lanes[2].copy_prefix(np.asarray(common[40 - COPY_MIN + 1 :] + theirs, np.int32), lanes) == 0
    assert len(lanes[2].tokens) == 40 - COPY_MIN + 1
    backend.close()
    gemma = LlamaBackend(gemma_path, n_ctx=512, n_lanes=2)
    pair = [gemma.lane(0), gemma.lane(1)]
    pair[0].decode(np.asarray(gemma.tokenize(" ".join(PROMPTS * 2))[:48], np.int32))
    assert len(pair[0].tokens) == 48
    assert pair[1].copy_prefix(pair[0].tokens, pair) == 0 and len(pair[1].tokens) == 0
    gemma.close()


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "unequal-parts"])
def test_an_interrupted_pass_leaves_every_lanes_kv_as_before(smollm2_path, parts):
    """`LlamaBackend.interrupt` (llama.cpp's abort callback) stops a pass: it raises PassInterrupted, every lane of
    the pass keeps its tokens and KV cells as before (the parts evaluated before the stop are rolled back too), and
    once cleared the same rows give what a lane never interrupted gives."""
    from specdec_cli.errors import PassInterrupted

    backend = LlamaBackend(smollm2_path, n_ctx=512, n_lanes=3)
    lanes = [backend.lane(i) for i in range(3)]
    prompts = [_tokens(backend, p) for p in PROMPTS]
    assert backend.interruptible
    for i in range(3):
        backend.decode_many([(lanes[i], np.asarray(prompts[i][:16], np.int32), 0)])
    pass_ = [(lanes[i], np.asarray(prompts[i][16 : 20 + 3 * i], np.int32), 2) for i in range(parts)]
    backend.interrupt()
    with pytest.raises(PassInterrupted):
        backend.decode_many(pass_)
    with pytest.raises(PassInterrupted):
        lanes[0].decode(np.asarray(prompts[0][16:20], np.int32), n_logits=1)
    assert [len(x.tokens) for x in lanes] == [16, 16, 16]
    backend.interrupt(False)
    got = [v.copy() for v in backend.decode_many(pass_)]
    # lane 2, never interrupted, reads lane i's rows as a reference (its own cells replaced, same positions)
    for i in range(parts):
        lanes[2].truncate(0)
        want = lanes[2].decode(np.asarray(prompts[i][: 20 + 3 * i], np.int32), n_logits=2)
        assert (got[i].argmax(-1) == want.argmax(-1)).all() and np.abs(got[i] - want).max() < NEAR_TIE, i
    backend.close()


def test_slots_of_a_hybrid_target_each_keep_their_own_recurrent_state(lfm2_tiny):
    """Three slots of a tiny hybrid (lfm2: snapshots) in one loop: each sequence's recurrent state is its own, so each
    speculative output is plain decoding's alone (random weights: near-ties aside, which a tiny model does not meet
    on these prompts)."""
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 10, 11, 9, 10, 11, 9], [1, 3, 4, 3, 4, 3, 4]]
    alone = LlamaBackend(lfm2_tiny, n_ctx=256)
    plain = []
    for p in prompts:
        alone.truncate(0)
        plain.append(_out(SpeculativeEngine(alone).generate(p, GenerationConfig(max_tokens=24))))
    alone.close()
    backend = LlamaBackend(lfm2_tiny, n_ctx=256, n_lanes=3)
    sched = Scheduler(backend, 3)
    out: dict[int, list[int]] = {}
    for i, slot in enumerate(sched.slots):
        engine = SpeculativeEngine(slot.backend, NgramDrafter(1, 3), FixedK(4))
        engine.passes = slot
        out[i] = []
        sched.start(slot, _program(engine, prompts[i], GenerationConfig(max_tokens=24), out[i]), Priority(seq=i))
    while sched.busy:
        sched.step()
    backend.close()
    assert [out[i] for i in range(3)] == plain


def test_a_lane_shares_the_context_and_none_of_the_roots_sequence_state(lfm2_tiny):
    """`LlamaBackend.lane` shares the model, the context and the batch, and starts its own sequence's state: a lane made
    after the root rolled back by a snapshot holds no tokens and counts no rollback, and its own rollback leaves the
    root's tokens and counters as they were."""
    backend = LlamaBackend(lfm2_tiny, n_ctx=256, n_lanes=2)
    assert backend.rollback == "snapshots"
    prompt = [1, 5, 6, 7, 5, 6, 7]
    backend.decode(prompt, n_logits=1)
    backend.decode([8, 9, 10], n_logits=3)
    backend.truncate(len(prompt) + 1)  # one of the pass's own tokens: a snapshot
    assert backend.n_snapshot_rollbacks == 1
    lane = backend.lane(1)
    assert len(lane.tokens) == 0 and lane.n_decode_calls == 0 and lane.n_snapshot_rollbacks == 0
    lane.decode(prompt, n_logits=1)
    lane.decode([8, 9, 10], n_logits=3)
    lane.truncate(len(prompt) + 2)
    assert lane.n_snapshot_rollbacks == 1 and backend.n_snapshot_rollbacks == 1
    assert list(backend.tokens) == [*prompt, 8] and list(lane.tokens) == [*prompt, 8, 9]
    assert lane.n_vocab == backend.n_vocab and lane.n_ctx == backend.n_ctx
    backend.close()
