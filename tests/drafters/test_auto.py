"""`--method auto`: the controller chooses each step's source (free lookup drafts, a draft model, or a plain step)
by expected tokens/s from costs it measures. Deterministic: a virtual clock advances by a made-up cost per forward
pass, so the verify curve is whatever the test says (flat like a GPU's, linear like a small CPU's)."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import Clock, FakeBackend, cpu, hashed_logits, step
from specdec_cli.core.controller import AdaptiveK
from specdec_cli.core.draft import Draft
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.stats import summarize
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.model import ModelDrafter
from specdec_cli.drafters.predict import PredictionDrafter
from specdec_cli.drafters.suffix import SuffixDrafter


def timed(clock: Clock, cost) -> FakeBackend:
    """A FakeBackend whose forward pass over b tokens advances `clock` by cost(b) ms."""
    return FakeBackend(hashed_logits, n_ctx=2048, clock=clock, cost=cost)


def run_auto(verify_ms, draft_ms_per_token: float, *, max_tokens: int = 300):
    clock = Clock()
    target = timed(clock, verify_ms)
    draft = timed(clock, lambda b: draft_ms_per_token * b)  # same model: its greedy drafts are always right
    drafter = AutoDrafter(SuffixDrafter(None), ModelDrafter(draft))
    engine = SpeculativeEngine(target, drafter, AdaptiveK(), clock=clock)
    records = list(engine.generate(np.arange(2, 12, dtype=np.int32), GenerationConfig(max_tokens=max_tokens)))
    steps = [r for r in records if isinstance(r, Step)]
    return steps, summarize(records)


def test_a_flat_verify_curve_makes_auto_draft_with_the_model():
    # A GPU: a pass costs 20 ms for 1 or 17 tokens, a draft token 2 ms. Drafting long with the model pays.
    steps, stats = run_auto(lambda b: 20.0, 2.0)
    model_steps = [s for s in steps if s.source == "draft"]
    assert len(model_steps) > 0.8 * len(steps[10:])  # after the first measurements, nearly every step
    assert stats.tokens_per_pass > 4.0
    assert max(s.k for s in model_steps) >= 8


def test_a_linear_verify_curve_makes_auto_stop_using_the_model():
    # A small CPU: a pass over b tokens costs 20 + 10 (b - 1) ms, so free drafts would pay, but a draft token costs
    # 15 ms: even drafts that are always right lose (K = 1: 2 tokens in 45 ms against 1 in 20). The controller
    # tries the model (its prior knows no draft cost), measures, and stops.
    steps, stats = run_auto(lambda b: 20.0 + 10.0 * (b - 1), 15.0)
    model_steps = [s.index for s in steps if s.source == "draft"]
    assert model_steps and max(model_steps) < 60, model_steps
    assert stats.tokens_per_pass < 1.3


def test_lookup_drafts_win_over_the_model_where_they_are_longer_and_free():
    # A flat curve, and a reply that copies its prompt: lookup drafts (free, long) are chosen over the model's.
    clock = Clock()
    copied = [int(t) for t in np.random.default_rng(0).integers(2, 30, 200)]

    def echo(prefix):  # the target repeats the prompt: token i of the reply is prompt token i
        logits = np.zeros(32, np.float32)
        n = len(prefix) - 200
        logits[copied[n % 200] if n >= 0 else 2] = 5.0
        return logits

    target = timed(clock, lambda b: 20.0)
    target.fn = echo
    draft = timed(clock, lambda b: 5.0 * b)
    draft.fn = lambda prefix: np.roll(echo(prefix), 1)  # a draft model that is always wrong
    engine = SpeculativeEngine(target, AutoDrafter(SuffixDrafter(None), ModelDrafter(draft)), AdaptiveK(), clock=clock)
    records = list(engine.generate(np.asarray(copied, np.int32), GenerationConfig(max_tokens=150)))
    steps = [r for r in records if isinstance(r, Step)]
    out = [t for s in steps for t in s.emitted]
    assert out == copied[:150]
    by_source = {}
    for s in steps:
        by_source[s.source] = by_source.get(s.source, 0) + s.n_accepted
    assert by_source.get("prompt", 0) > 100 and by_source.get("draft", 0) == 0
    assert summarize(records).tokens_per_pass > 5


def test_choose_compares_each_lookup_draft_by_its_source_evidence():
    ctrl = AdaptiveK()
    from dataclasses import replace

    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for _ in range(12):  # "predict" drafts after 9-token matches were always right; "store" ones never
        for source, right in (("predict", True), ("store", False)):
            d = Draft(tokens=np.arange(8, dtype=np.int32), source=source, match_len=9)
            keep = ctrl.trim(d)
            ctrl.observe(
                replace(
                    step(keep, keep, keep if right else 0, 0.02, cpu(keep + 1)), source=source, match_len=d.match_len
                )
            )
    ctrl.next_k()
    store = Draft(tokens=np.arange(8, dtype=np.int32), source="store", match_len=9)
    predict = Draft(tokens=np.arange(8, dtype=np.int32) + 1, source="predict", match_len=9)
    k, chosen = ctrl.choose([store, predict], False, 64)
    assert chosen is not None and chosen.source == "predict" and k >= 1
    k, plain = ctrl.choose([store], False, 64)
    assert k == 0 and not len(plain)  # the store's drafts alone are not worth a pass


def test_a_prediction_that_is_the_output_is_drafted_from_the_first_token():
    target = FakeBackend(hashed_logits, n_ctx=1024)
    prompt = np.arange(2, 8, dtype=np.int32)
    plain = [
        t
        for r in SpeculativeEngine(target, None).generate(prompt, GenerationConfig(max_tokens=60))
        if isinstance(r, Step)
        for t in r.emitted
    ]
    drafter = AutoDrafter(predictor=lambda p: PredictionDrafter(p, piece=target.piece), name="predict")
    from specdec_cli.core.controller import FixedK

    engine = SpeculativeEngine(target, drafter, FixedK(8))
    config = GenerationConfig(max_tokens=60, prediction=tuple(plain))
    steps = [r for r in engine.generate(prompt, config) if isinstance(r, Step)]
    assert [t for s in steps for t in s.emitted] == plain
    assert steps[0].source == "predict" and steps[0].n_accepted == 8  # from the very first step
    assert sum(s.n_accepted for s in steps) >= 60 - len(steps)
    # without a prediction, the same drafter drafts nothing: plain decoding
    steps = [r for r in engine.generate(prompt, GenerationConfig(max_tokens=20)) if isinstance(r, Step)]
    assert all(not s.drafted for s in steps)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_is_lossless_with_every_source(temperature):
    from specdec_cli.core.sampling import SamplingParams

    target = FakeBackend(hashed_logits, n_ctx=1024)
    prompt = np.arange(2, 40, dtype=np.int32) % 7 + 2  # repeats: prompt lookup finds matches
    sampling = SamplingParams(temperature=temperature, seed=3)
    plain = [
        t
        for r in SpeculativeEngine(target, None).generate(prompt, GenerationConfig(max_tokens=80, sampling=sampling))
        if isinstance(r, Step)
        for t in r.emitted
    ]
    drafter = AutoDrafter(
        SuffixDrafter(None),
        ModelDrafter(FakeBackend(hashed_logits, n_ctx=1024)),
        predictor=lambda p: PredictionDrafter(p, piece=target.piece),
    )
    config = GenerationConfig(max_tokens=80, sampling=sampling, prediction=tuple(plain[:30]))
    out = [
        t
        for r in SpeculativeEngine(target, drafter, AdaptiveK()).generate(prompt, config)
        if isinstance(r, Step)
        for t in r.emitted
    ]
    assert out == plain  # greedy: exactly the target's output; seeded sampling: plain decoding's with that seed


def test_a_prediction_is_drafted_long_from_its_first_token_on_a_cpu():
    # On a CPU curve a 1-token prompt-lookup match waits for evidence, but a prediction's first drafts are verified
    # at once and grow by slow start (3, 6, 12, ...): its evidence is the user's statement, not an n-gram.
    from dataclasses import replace

    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    lookup = Draft(tokens=np.arange(64, dtype=np.int32), source="prompt", match_len=1)
    k, plain = ctrl.choose([lookup], False, 64)
    assert k == 0 and not len(plain)  # a plain step (the empty draft keeps its evidence for `observe`)
    ks = []
    for _ in range(5):
        d = Draft(tokens=np.arange(64, dtype=np.int32), source="predict", match_len=1 + sum(ks))
        k, chosen = ctrl.choose([d], False, 64)
        ks.append(k)
        ctrl.observe(replace(step(k, k, k, 0.02, cpu(k + 1)), source="predict", match_len=d.match_len))
    assert ks[0] >= 3 and ks[-1] >= 24, ks


def test_the_stream_styles_accepted_tokens_by_their_source():
    from specdec_cli.cli.render import legend, segment_style
    from specdec_cli.core.records import ACCEPTED, REJECTED, TARGET

    assert segment_style(ACCEPTED, "predict") == "spec.accepted.predict"
    assert segment_style(ACCEPTED, "store") == "spec.accepted.store"
    assert segment_style(ACCEPTED, "draft") == "spec.accepted.draft"
    assert segment_style(ACCEPTED, "prompt") == segment_style(ACCEPTED, "ngram") == "spec.accepted"
    assert segment_style(TARGET, "predict") == "spec.target" and segment_style(REJECTED, "store") == "spec.rejected"
    spans = {str(legend("auto"))[s.start : s.end]: str(s.style) for s in legend("auto").spans}
    assert spans["prediction"] == "spec.accepted.predict" and spans["past outputs"] == "spec.accepted.store"
    assert "accepted draft" in str(legend("ngram"))


def test_notes_say_why_no_draft_model_and_when_a_prediction_went_unused():
    from pathlib import Path

    from specdec_cli.assemble import notes
    from specdec_cli.core.stats import RunStats
    from specdec_cli.draft_policy import DraftPlan
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions

    session = Session(target=FakeBackend(), target_path=Path("t.gguf"), draft_plan=DraftPlan(None, "CPU-only: why"))
    used = RunStats(by_source={"predict": {"steps": 1, "drafted": 4, "accepted": 4}})
    unused = RunStats(by_source={"prompt": {"steps": 1, "drafted": 4, "accepted": 4}})
    auto = SpecOptions(method="auto")
    assert notes(session, auto, used, predicted=True) == ("no draft model: CPU-only: why.",)
    assert any("prediction was never drafted from" in n for n in notes(session, auto, unused, predicted=True))
    assert notes(session, SpecOptions(method="ngram"), unused, predicted=False) == ()


def test_a_copy_run_is_realigned_past_a_renamed_word():
    # the reply copies the prompt, but writes token 99 where the prompt has prompt[30] (a rename): right after it,
    # prompt lookup matches only the new token, while the realigned copy continues the prompt at prompt[31]
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, 90, 80).astype(np.int32)
    drafter = SuffixDrafter(None)
    drafter.begin(prompt)
    reply = list(prompt[:30])
    for i in range(8, 30):  # the copy run, as the engine would look it up step by step
        drafter.continuations(np.concatenate((prompt, reply[:i])).astype(np.int32), 16, more=True)
    context = np.concatenate((prompt, reply, [99])).astype(np.int32)
    local, _, _, realigned = drafter.continuations(context, 16, more=True)
    assert realigned.tokens.tolist() == prompt[31:47].tolist() and realigned.match_len == 8
    assert not len(local.tokens) or local.tokens[0] != prompt[31]
    (draft,) = [d for d in AutoDrafter(drafter).lookup(context, 16, None, None) if d.source == "realign"]
    assert draft.tokens.tolist() == prompt[31:47].tolist()
