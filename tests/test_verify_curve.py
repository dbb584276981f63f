"""The measured verify curve: measuring it, keeping it, and K chosen on its cheap sizes.

Deterministic: the fake backend's passes advance a virtual clock by a scripted, non-monotone cost, like llama.cpp's
tiled CPU kernels (a batch one token past a tile boundary pays for a slow remainder path).
"""

from __future__ import annotations

import numpy as np
import pytest

from fakes import Clock, FakeBackend, greedy_reference
from specdec_cli.core.controller import AdaptiveK
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.suffix import SuffixDrafter
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.stats import summarize
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.core.verify_timing import measure


def tiled(b: int) -> float:
    """ms of a pass over b tokens: 20 ms, then 5 ms a token in tiles of 8, and 45 ms more for a partial tile (b = 8,
    16, 24, ... are cheap: v(16) = 100 < v(15) = 140)."""
    return 20.0 if b == 1 else 20.0 + 5.0 * b + (45.0 if b % 8 else 0.0)


CURVE = VerifyCurve(ms=tuple(tiled(b) for b in range(1, 66)))


def test_cheap_sizes_are_those_no_larger_pass_undercuts():
    assert CURVE.cheap_sizes() == [1, 8, 16, 24, 32, 40, 48, 56, 64, 65]
    assert CURVE.at(16) == 100.0 and CURVE.floor(15) == 100.0 and CURVE.waste_ms(15) == 40.0
    assert CURVE.cheap(16) and not CURVE.cheap(15) and not CURVE.cheap(17)
    flat = VerifyCurve(ms=(20.0,) * 8)
    assert flat.cheap_sizes() == list(range(1, 9))  # where extra tokens cost nothing, every size is cheap
    linear = VerifyCurve(ms=tuple(10.0 * b for b in range(1, 9)))
    assert linear.cheap_sizes() == list(range(1, 9))  # and where each costs something, too
    assert linear.at(12) == pytest.approx(120.0)  # extrapolated with the last quarter's slope
    assert VerifyCurve.from_dict(CURVE.to_dict()) == CURVE
    with pytest.raises(ValueError):
        VerifyCurve(ms=(20.0, 0.0))


def test_measure_times_every_size_on_the_backend_and_leaves_its_cache_empty():
    clock = Clock()
    target = FakeBackend(n_ctx=512, n_batch=128, clock=clock, cost=tiled)
    target.decode([5, 6, 7])
    seen = []
    curve = measure(target, repeats=2, context=64, clock=clock, progress=lambda done, total: seen.append(done))
    assert curve.ms == pytest.approx(CURVE.ms) and curve.b_max == 65 and curve.repeats == 2
    assert seen == list(range(1, 131)) and len(target.tokens) == 0
    assert curve.seconds == pytest.approx((tiled(64) + sum(2 * tiled(b) for b in range(1, 66)) + tiled(65)
                                           + tiled(1) + 4 * tiled(1)) / 1e3)  # b = 1 twice before, twice after
    assert curve.disturbed == ""


def copying_target(prompt: list[int], every: int = 23):
    """A target that writes its prompt again (token i of the reply is prompt token i), with an edit every `every`
    tokens (token 31, never in the prompt): copy runs that prompt lookup drafts, broken where the copy was edited."""

    def fn(prefix):
        logits = np.zeros(32, np.float32)
        i = len(prefix) - len(prompt)
        logits[31 if i % every == every - 1 else prompt[i % len(prompt)] if i >= 0 else 2] = 5.0
        return logits

    return fn


def run_copy(curve: VerifyCurve | None, every: int = 23, clock: Clock | None = None) -> list[Step]:
    prompt = [int(t) for t in np.random.default_rng(1).integers(2, 30, 400)]
    clock = clock or Clock()
    target = FakeBackend(copying_target(prompt, every), n_ctx=1024, n_batch=128, clock=clock, cost=tiled)
    engine = SpeculativeEngine(target, AutoDrafter(SuffixDrafter(None)), AdaptiveK(curve=curve), clock=clock,
                               curve=curve)
    records = list(engine.generate(np.asarray(prompt, np.int32), GenerationConfig(max_tokens=360)))
    steps = [r for r in records if isinstance(r, Step)]
    assert [t for s in steps for t in s.emitted] == greedy_reference(target.fn, prompt, 360)
    return steps


def test_k_lands_on_the_cheap_sizes_of_a_measured_curve():
    steps = run_copy(CURVE)
    drafting = [s for s in steps if s.drafted]
    on_cheap = [s for s in drafting if CURVE.cheap(s.batch_size)]
    assert len(on_cheap) >= 0.6 * len(drafting), sorted(s.batch_size for s in drafting)
    assert all(s.cheap == CURVE.cheap(s.batch_size) and s.curve_ms == tiled(s.batch_size) for s in steps)
    stats = summarize(steps)
    assert stats.curve_passes == len(steps) and stats.cheap_passes >= len(on_cheap)


def test_without_the_curve_k_lands_past_the_tile_boundaries():
    # the control: learning v(b) from the sizes it happens to use, the controller finds the cheap ones less often
    # than with the measured curve, and the same replies take longer. Over edits every 17-27 tokens: the realigned copy
    # drafts each run whole, so a run's natural pass is its length + 1, and where that is a tile (every 23: 24) it is
    # cheap with or without the curve; elsewhere, without it 0-14 % of drafting passes land on a cheap size, with it
    # 84-89 %. In total 28.5 against 27.8 virtual s. (Not at every spacing: every 19 tokens, b = 16 on the curve
    # leaves 4 tokens of each run to a dear pass of their own, 5.86 against 5.64 s.)
    spent = {"without": 0.0, "with": 0.0}
    for every in (17, 19, 21, 23, 27):
        clocks = {"without": Clock(), "with": Clock()}
        without = [s for s in run_copy(None, every=every, clock=clocks["without"]) if s.drafted]
        with_curve = [s for s in run_copy(CURVE, every=every, clock=clocks["with"]) if s.drafted]
        for name, clock in clocks.items():
            spent[name] += clock()

        def share(steps):
            return sum(CURVE.cheap(s.batch_size) for s in steps) / len(steps)

        if CURVE.cheap(every + 1):
            continue
        assert share(without) <= 0.5 * share(with_curve), every
    assert spent["with"] < spent["without"], spent


def test_the_curve_learnt_json_keeps_is_measured_again_once_stale(tmp_path, monkeypatch):
    from specdec_cli.stores import learnt

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    monkeypatch.setattr("specdec_cli.stores.tuned.machine", lambda threads: {"key": f"cpu|{threads}|abc"})
    key = learnt.curve_key(model, 2)
    assert key is not None and key != learnt.curve_key(model, 4)  # per thread count (and build, CPU, model file)
    assert learnt.load_curve(key) is None
    learnt.save_curve(key, CURVE, model)
    assert learnt.load_curve(key) == CURVE
    from dataclasses import replace

    learnt.save_curve(key, replace(CURVE, stale=True), model)
    assert learnt.load_curve(key) is None and learnt.load_curve(key, stale_ok=True).stale
    monkeypatch.setenv(learnt.VERIFY_ENV, "off")
    assert learnt.curve_key(model, 2) is None


def test_a_session_measures_its_curve_once_with_progress_and_keeps_it(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from specdec_cli.session import Session
    from specdec_cli.stores import learnt

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    monkeypatch.setattr("specdec_cli.stores.tuned.machine", lambda threads: {"key": f"cpu|{threads}|abc"})

    class Reporter:
        lines, advanced = [], []

        def say(self, text):
            self.lines.append(text)

        @contextmanager
        def progress(self, description, total, *, unit="bytes"):
            class Task:
                def advance(task, n=1):
                    self.advanced.append(n)
            yield Task()

    def session():
        clock = Clock()
        target = FakeBackend(n_ctx=512, n_batch=128, clock=clock, cost=tiled)
        return Session(target=target, target_path=model, reporter=Reporter(), clock=clock), target

    first, target = session()
    assert first.verify_curve().b_max == 65
    assert target.n_decode_calls == 1 + 2 + 2 + 130 + 2  # context, warm-up, b = 1 before, sizes, b = 1 after
    assert len(Reporter.advanced) == 130 and "measured" in Reporter.lines[0]
    again, target = session()
    assert again.verify_curve().to_dict() == first.verify_curve().to_dict()  # kept in learnt.json: not measured again
    assert target.n_decode_calls == 0


def test_real_passes_rescale_the_curve_and_a_drift_of_v1_is_noticed():
    from specdec_cli.core.cost_model import CostModel

    model = CostModel(16, curve=CURVE)
    assert model.verify_curve()[15] == 100.0 and model.verify_curve()[14] == 140.0  # the shape as measured
    for _ in range(20):  # this machine is twice as slow today, at b = 1
        model.observe(Step(index=0, k=0, drafted=(), n_accepted=0, target_token=1, emitted=(1,), segments=(),
                           draft_ms=0.0, verify_ms=40.0))
    v = model.verify_curve()
    assert v[0] == pytest.approx(40.0, rel=0.1) and v[15] < v[14]  # rescaled, the tile boundary kept
    assert model.drifted()


@pytest.mark.real
def test_measure_gives_a_positive_curve_and_leaves_the_cache_empty(smollm2_path):
    from specdec_cli.models.llama import LlamaBackend

    backend = LlamaBackend(smollm2_path, n_ctx=512, n_batch=128)
    try:
        curve = measure(backend, b_max=12, repeats=1, context=32)
        assert len(backend.tokens) == 0
    finally:
        backend.close()
    assert curve.b_max == 12 and all(x > 0 for x in curve.ms) and curve.seconds > 0
