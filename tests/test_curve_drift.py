"""A verify curve that stays true (issue 46, docs/gpu.md): a measurement the machine disturbed is repeated or not
kept, and passes that drift from a kept curve mark it stale; `tune` measures a stale one again. On the fake
backend's virtual clock: a pass of b tokens advances it by a scripted cost, which a "CPU-bound process" raises."""

from __future__ import annotations


import numpy as np
import pytest

from fakes import Clock, FakeBackend
from specdec_cli.core.verify_curve import CurveWatch, VerifyCurve
from specdec_cli.core.verify_timing import measure, measure_steady


def base_ms(b: int) -> float:
    return 60.0 + 10.0 * b  # a 2-core CPU's curve, roughly


class Say:
    """A reporter that records what it is told."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, text: str) -> None:
        self.lines.append(text)

    def progress(self, description, total, *, unit="bytes"):
        import contextlib

        class Task:
            def advance(self, n=1):
                pass

        return contextlib.nullcontext(Task())


def backend(cost) -> tuple[FakeBackend, Clock]:
    clock = Clock()
    return FakeBackend(n_ctx=1024, n_batch=512, clock=clock, cost=lambda b: cost(b, clock())), clock


def test_a_quiet_machine_gives_an_undisturbed_curve() -> None:
    target, clock = backend(lambda b, t: base_ms(b))
    curve = measure(target, clock=clock)
    assert curve.disturbed == "" and curve.ms[0] == pytest.approx(70.0)


def test_a_curve_measured_beside_a_cpu_bound_process_is_measured_again() -> None:
    # A compiler starts 20 s into the first measurement (one round takes ~25 s) and keeps running: every pass costs
    # twice as much from then on. The first curve mixes both machines (its b = 1 at the end disagrees with its start);
    # the second, measured wholly beside the compiler, is consistent and is the one returned.
    target, clock = backend(lambda b, t: base_ms(b) * (2.0 if t > 20.0 else 1.0))
    said: list[str] = []
    first = measure(target, clock=clock)
    assert "at the start" in first.disturbed
    target, clock = backend(lambda b, t: base_ms(b) * (2.0 if t > 20.0 else 1.0))
    curve = measure_steady(target, clock=clock, say=said.append)
    assert curve.disturbed == "" and curve.ms[0] == pytest.approx(140.0) and curve.ms[9] == pytest.approx(320.0)
    assert said and "measuring it again" in said[0]


def test_a_curve_the_machine_kept_disturbing_is_used_but_not_kept(tmp_path, monkeypatch) -> None:
    from specdec_cli.session import Session
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    target, clock = backend(lambda b, t: base_ms(b) * (1.0 + t / 20.0))  # the machine slows down all the while
    say = Say()
    session = Session(target=target, target_path=model, reporter=say, clock=clock)
    curve = session.verify_curve()
    assert curve is not None and curve.disturbed  # this session uses it ...
    assert learnt.load_curve(learnt.curve_key(model, None)) is None  # ... and it is not kept
    assert any("not kept" in line for line in say.lines), say.lines


def test_the_watch_says_drift_from_the_b1_passes_or_else_from_every_size() -> None:
    curve = VerifyCurve(ms=tuple(base_ms(b) for b in range(1, 66)))
    watch = CurveWatch(curve)
    for _ in range(7):
        watch.observe(1, 6 * base_ms(1))
    assert not watch.drifted()  # too few passes yet
    watch.observe(1, 6 * base_ms(1))
    assert watch.drifted()
    watch = CurveWatch(curve)
    for b in range(2, 12):
        watch.observe(b, 1.1 * base_ms(b))
        watch.observe(b, 5 * base_ms(b), n_past=4000)  # a long context's attention: not the curve's business
    assert watch.ratio() == pytest.approx(1.1) and not watch.drifted()


def test_one_token_passes_over_a_long_context_do_not_say_drift() -> None:
    # An agent's plain steps over 6,000 tokens: each 1-token pass pays attention the curve (timed over 256 tokens)
    # does not hold. Counted, every long session marked a true curve stale and the next start measured it again.
    from specdec_cli.core.cost_model import CostModel
    from specdec_cli.core.records import Step

    curve = VerifyCurve(ms=tuple(base_ms(b) for b in range(1, 66)))
    watch, model = CurveWatch(curve), CostModel(16, curve=curve)
    for _ in range(20):
        watch.observe(1, 1.5 * base_ms(1), n_past=6000)
        model.observe(Step(index=0, k=0, drafted=(), n_accepted=0, target_token=1, emitted=(1,), segments=(),
                           draft_ms=0.0, verify_ms=1.5 * base_ms(1), n_past=6000))
    assert not watch.drifted() and not model.drifted()
    for _ in range(8):  # the same cost over a short context: the machine did change
        watch.observe(1, 1.5 * base_ms(1), n_past=100)
        model.observe(Step(index=0, k=0, drafted=(), n_accepted=0, target_token=1, emitted=(1,), segments=(),
                           draft_ms=0.0, verify_ms=1.5 * base_ms(1), n_past=100))
    assert watch.drifted() and model.drifted()


def kept_curve(tmp_path, monkeypatch, scale: float):
    """A model file whose kept curve is `scale` x what the fake backend's passes cost (`base_ms`)."""
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    key = learnt.curve_key(model, None)
    learnt.save_curve(key, VerifyCurve(ms=tuple(scale * base_ms(b) for b in range(1, 66))), model)
    return model, key


def test_plain_decoding_that_drifts_from_the_kept_curve_marks_it_stale(tmp_path, monkeypatch) -> None:
    from specdec_cli import driver
    from specdec_cli.assemble import Assembler
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions
    from specdec_cli.stores import learnt

    model, key = kept_curve(tmp_path, monkeypatch, 6.0)  # kept while the machine was busy: 6 x today's passes
    target, clock = backend(lambda b, t: base_ms(b))
    session = Session(target=target, target_path=model, clock=clock)
    with Assembler(session) as assembler:
        driver.generate(assembler.engine(SpecOptions(method="none")), np.arange(2, 12), GenerationConfig(max_tokens=20))
    assert learnt.load_curve(key) is None and learnt.load_curve(key, stale_ok=True).stale


def test_a_kept_curve_6x_off_the_passes_a_tune_times_is_measured_again(tmp_path, monkeypatch) -> None:
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.measure.tune import configs_for, run
    from specdec_cli.prompts import PromptCase
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions
    from specdec_cli.stores import learnt

    model, key = kept_curve(tmp_path, monkeypatch, 1 / 6)  # kept by a faster build, or a quieter machine
    target, clock = backend(lambda b, t: base_ms(b))
    say = Say()
    session = Session(target=target, target_path=model, clock=clock, reporter=say)
    run(session, [PromptCase("p", "edit", "a b c a b c a b")], spec=SpecOptions(method="ngram"),
        config=GenerationConfig(max_tokens=12), configs=configs_for([]), repeats=1)
    kept = learnt.load_curve(key)
    assert kept is not None and kept.ms[0] == pytest.approx(base_ms(1))  # measured again, on today's passes
    assert session.verify_curve().ms[0] == pytest.approx(base_ms(1))  # and the tune's engines priced on it
    assert any("stale" in line for line in say.lines), say.lines


def test_passes_shared_with_other_sequences_are_not_shown_to_the_watch() -> None:
    """A server lane's pass carries other lanes' rows (`Step.shared_rows`): its time is not this machine's cost of
    the lane's rows, so the driver keeps it from the drift watch (a busy server would otherwise mark its curve stale)."""
    from specdec_cli.core.controller import FixedK
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.driver import stream
    from specdec_cli.drafters.ngram import NgramDrafter

    from fakes import FakeBackend, hashed_logits

    class Shared(FakeBackend):
        shared_rows = 12

    seen = []

    class Watch:
        def observe(self, b, ms, n_past=0):
            seen.append(b)

    for backend, expect_seen in ((FakeBackend(hashed_logits), True), (Shared(hashed_logits), False)):
        seen.clear()
        engine = SpeculativeEngine(backend, NgramDrafter(1, 3), FixedK(4))
        engine.watch = Watch()
        list(stream(engine, [5, 6, 7, 5, 6], GenerationConfig(max_tokens=12)))
        assert bool(seen) == expect_seen
