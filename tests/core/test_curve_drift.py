"""A verify curve that stays true (issues 46 and 55, docs/gpu.md): a measurement the machine disturbed stops early,
is repeated, then kept as provisional and measured again once; passes that drift from a kept curve's prediction at
their depth mark it stale, with the reason; `tune` measures a stale one again. On the fake backend's virtual clock:
a pass of b tokens advances it by a scripted cost, which a "CPU-bound process" raises and a deeper context too."""

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
    # A compiler starts 10 s into the first measurement (during its second round, which ends at ~14 s) and keeps
    # running: every pass costs twice as much from then on. The first curve mixes both machines (its b = 1 at the
    # end disagrees with its start); the second, measured wholly beside the compiler, is consistent and returned.
    target, clock = backend(lambda b, t: base_ms(b) * (2.0 if t > 10.0 else 1.0))
    said: list[str] = []
    first = measure(target, clock=clock)
    assert "at the start" in first.disturbed
    target, clock = backend(lambda b, t: base_ms(b) * (2.0 if t > 10.0 else 1.0))
    curve = measure_steady(target, clock=clock, say=said.append)
    assert curve.disturbed == "" and curve.ms[0] == pytest.approx(140.0) and curve.ms[9] == pytest.approx(320.0)
    assert said and "measuring it again" in said[0]


def test_a_busy_neighbour_stops_the_measurement_at_the_first_round() -> None:
    # Another job takes the CPUs 5 s in (during the first round): the b = 1 pass between the rounds already says so,
    # and the measurement stops there instead of timing the machine it no longer describes for half a minute more.
    from specdec_cli.core.verify_timing import plan_passes

    target, clock = backend(lambda b, t: base_ms(b) * (3.0 if t > 5.0 else 1.0))
    curve = measure(target, clock=clock)
    assert "at the start" in curve.disturbed and curve.depth == 0 and curve.repeats == 1  # one round, as it says
    assert target.n_decode_calls < plan_passes() // 2 + 4, target.n_decode_calls


def busy(b: int, t: float) -> float:
    """A machine that slows down all the while (another job ramping up): ms of a pass over b tokens at t s."""
    return base_ms(b) * (1.0 + t / 20.0)


def test_a_curve_a_busy_neighbour_disturbed_is_provisional_and_measured_again_once(tmp_path, monkeypatch) -> None:
    from specdec_cli.session import Session
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    key = learnt.curve_key(model, None)

    def session(cost) -> tuple[Session, FakeBackend, Say]:
        target, clock = backend(cost)
        say = Say()
        return Session(target=target, target_path=model, reporter=say, clock=clock), target, say

    first, _, say = session(busy)
    curve = first.verify_curve()
    assert curve is not None and curve.disturbed and curve.provisional  # this session uses it ...
    assert learnt.load_curve(key).provisional  # ... and keeps it, marked
    assert any("provisional" in line for line in say.lines), say.lines
    again, target, say = session(lambda b, t: base_ms(b))  # the next run, on a quiet machine: measured again
    curve = again.verify_curve()
    assert target.n_decode_calls > 0 and not curve.disturbed and not curve.provisional
    assert "provisional" in curve.measured_for and learnt.load_curve(key).to_dict() == curve.to_dict()
    assert any("(the kept curve is provisional" in line for line in say.lines), say.lines  # the reason, named
    third, target, _ = session(lambda b, t: base_ms(b))
    assert third.verify_curve().to_dict() == curve.to_dict() and target.n_decode_calls == 0  # and then kept


def test_a_machine_busy_at_both_measurements_blocks_one_run_only(tmp_path, monkeypatch) -> None:
    from specdec_cli.core.verify_timing import plan_passes
    from specdec_cli.session import Session
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    calls = []
    for _ in range(3):
        target, clock = backend(busy)
        Session(target=target, target_path=model, reporter=Say(), clock=clock).verify_curve()
        calls.append(target.n_decode_calls)
    assert calls[0] > 0 and 0 < calls[1] <= plan_passes() + 3 and calls[2] == 0  # twice, once, then never
    kept = learnt.load_curve(learnt.curve_key(model, None))
    assert kept.disturbed and not kept.provisional


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
        model.observe(
            Step(
                index=0,
                k=0,
                drafted=(),
                n_accepted=0,
                target_token=1,
                emitted=(1,),
                segments=(),
                draft_ms=0.0,
                verify_ms=1.5 * base_ms(1),
                n_past=6000,
            )
        )
    assert not watch.drifted() and not model.drifted()
    for _ in range(8):  # the same cost over a short context: the machine did change
        watch.observe(1, 1.5 * base_ms(1), n_past=100)
        model.observe(
            Step(
                index=0,
                k=0,
                drafted=(),
                n_accepted=0,
                target_token=1,
                emitted=(1,),
                segments=(),
                draft_ms=0.0,
                verify_ms=1.5 * base_ms(1),
                n_past=100,
            )
        )
    assert watch.drifted() and model.drifted()


def kept_curve(tmp_path, monkeypatch, scale: float):
    """A model file whose kept curve is `scale` x what the fake backend's passes cost (`base_ms`)."""
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    key = learnt.curve_key(model, None)
    learnt.save_curve(key, VerifyCurve(ms=tuple(scale * base_ms(b) for b in range(1, 66)), depth=640), model)
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
    run(
        session,
        [PromptCase("p", "edit", "a b c a b c a b")],
        spec=SpecOptions(method="ngram"),
        config=GenerationConfig(max_tokens=12),
        configs=configs_for([]),
        repeats=1,
    )
    kept = learnt.load_curve(key)
    assert kept is not None and kept.ms[0] == pytest.approx(base_ms(1))  # measured again, on today's passes
    assert session.verify_curve().ms[0] == pytest.approx(base_ms(1))  # and the tune's engines priced on it
    assert any("stale" in line for line in say.lines), say.lines


def test_passes_shared_with_other_sequences_are_not_shown_to_the_watch() -> None:
    """A server lane's pass carries other lanes' rows (`Step.shared_rows`): its time is not this machine's cost of
    the lane's rows, so the driver keeps it from the drift watch (a busy server would otherwise mark its curve
    stale)."""
    from fakes import FakeBackend, hashed_logits
    from specdec_cli.core.controller import FixedK
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
    from specdec_cli.drafters.ngram import NgramDrafter
    from specdec_cli.driver import stream

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


PER_PASS, PER_ROW = 40.0, 30.0  # ms per 1,000 tokens of context: a steep CPU's attention


def deep_backend(clock: Clock, scale: float = 1.0) -> FakeBackend:
    """A fake backend whose pass over b tokens after n tokens of context costs scale x (`base_ms`(b) + (PER_PASS +
    PER_ROW b) n / 1000): attention over the KV cache, every row of the pass over all of it."""
    target: FakeBackend

    def cost(b: int) -> float:
        n_past = len(target.tokens) - b  # (the fake counts a pass's tokens in before it is costed)
        return scale * (base_ms(b) + (PER_PASS + PER_ROW * b) * n_past / 1000.0)

    target = FakeBackend(n_ctx=2048, n_batch=512, clock=clock, cost=cost)
    return target


def test_the_curve_prices_a_pass_at_the_depth_it_runs_at() -> None:
    clock = Clock()
    curve = measure(deep_backend(clock), clock=clock)
    assert curve.depth == 640 and curve.depth_ms == pytest.approx((PER_PASS, PER_ROW), rel=1e-6)
    for b in (1, 4, 16):
        assert curve.predict(b, 700) == pytest.approx(base_ms(b) + (PER_PASS + PER_ROW * b) * 0.7)


def test_a_run_at_600_to_800_tokens_of_context_does_not_mark_a_true_curve_stale(tmp_path, monkeypatch) -> None:
    # The quick start's passes ran deeper than the 256 tokens the curve was timed at, so they cost more than the
    # shallow curve says, and every run marked a true curve stale. Judged against the prediction at their depth,
    # they agree.
    from specdec_cli import driver
    from specdec_cli.assemble import Assembler
    from specdec_cli.cli.render import pass_placement
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    clock = Clock()
    session = Session(target=deep_backend(clock), target_path=model, clock=clock, reporter=Say())
    curve = session.verify_curve()  # measured on this machine, true at every depth
    assert curve is not None and not curve.disturbed
    prompt = np.arange(2, 602) % 60 + 2
    with Assembler(session) as assembler:
        result = driver.generate(assembler.engine(SpecOptions(method="none")), prompt, GenerationConfig(max_tokens=200))
        assert not assembler.curve_drifted()
    kept = learnt.load_curve(learnt.curve_key(model, None))
    assert kept is not None and kept.to_dict() == curve.to_dict()  # kept, not stale
    assert 600 <= result.stats.curve_depth <= 800
    assert result.stats.verify_ms / result.stats.curve_ms == pytest.approx(1.0, abs=0.02)
    assert f"passes 1.00× the curve's prediction at depth {result.stats.curve_depth}" in pass_placement(result.stats)


def test_passes_off_the_prediction_for_a_whole_run_mark_the_curve_stale_once_with_the_reason(
    tmp_path, monkeypatch
) -> None:
    # The machine got 1.5x slower (a governor, another build of the same version): the run's passes say so at their
    # depth, the curve is marked stale with the reason, and the next run measures it again, naming it. If the fresh
    # curve meets the passes no better, it is not marked stale again: one measurement for it, not one per run.
    from specdec_cli import driver
    from specdec_cli.assemble import Assembler
    from specdec_cli.core.engine import GenerationConfig
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions
    from specdec_cli.stores import learnt

    monkeypatch.setenv("SPECDEC_VERIFY_CURVE", "on")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF fake")
    key = learnt.curve_key(model, None)
    clock = Clock()
    Session(target=deep_backend(clock), target_path=model, clock=clock).verify_curve()
    prompt = np.arange(2, 602) % 60 + 2

    def run(scale: float) -> tuple[Session, Say]:
        clock, say = Clock(), Say()
        session = Session(target=deep_backend(clock, scale), target_path=model, clock=clock, reporter=say)
        session.verify_curve()  # as a run that drafts asks for it (plain decoding takes a kept one only)
        with Assembler(session) as assembler:
            driver.generate(assembler.engine(SpecOptions(method="none")), prompt, GenerationConfig(max_tokens=40))
        return session, say

    run(1.5)
    stale = learnt.load_curve(key, stale_ok=True)
    assert stale.stale and "1.50x it at depth" in stale.stale_why, stale.stale_why
    session, say = run(1.5)  # measures it again (the reason said), then runs on it
    assert "stale: passes off the curve's prediction" in session.verify_curve().measured_for
    assert any("stale: passes off the curve's prediction" in line for line in say.lines), say.lines
    fresh = learnt.load_curve(key)
    assert fresh is not None and fresh.ms[0] == pytest.approx(1.5 * curve_at_256(1))
    clock = Clock()
    odd = deep_backend(clock, 2.0)  # passes 1.33x the fresh curve: not marked stale a second time
    session = Session(target=odd, target_path=model, clock=clock)
    with Assembler(session) as assembler:
        driver.generate(assembler.engine(SpecOptions(method="none")), prompt, GenerationConfig(max_tokens=40))
        assert assembler.curve_drifted()
    assert learnt.load_curve(key) == fresh


def curve_at_256(b: int) -> float:
    return base_ms(b) + (PER_PASS + PER_ROW * b) * 0.256


def test_a_timed_pass_waits_for_the_device_before_its_clock_stops() -> None:
    # A GPU's llama_decode returns once the pass is queued when no logits are read; the work is done by
    # llama_synchronize. Timed without it, the pass would cost nothing.
    from specdec_cli.core.verify_timing import measure_token_ms

    class Queued(FakeBackend):
        """Passes advance the clock only when synchronized (queued on a device until then)."""

        def __init__(self, clock: Clock) -> None:
            super().__init__(n_ctx=1024, n_batch=512, clock=None, cost=None)
            self.device_clock, self.queued, self.syncs = clock, 0.0, 0

        def decode(self, tokens, n_logits: int = 0):
            self.queued += base_ms(len(tokens)) / 1e3
            return super().decode(tokens, n_logits)

        def synchronize(self) -> None:
            self.syncs += 1
            self.device_clock.advance(self.queued)
            self.queued = 0.0

    clock = Clock()
    target = Queued(clock)
    assert measure_token_ms(target, clock=clock) == pytest.approx(base_ms(1))
    curve = measure(target, clock=clock)
    assert curve.at(16) == pytest.approx(base_ms(16)) and target.syncs > 0
