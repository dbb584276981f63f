"""The measured verify curve: measuring it, keeping it, and K chosen on its cheap sizes.

Deterministic: the fake backend's passes advance a virtual clock by a scripted, non-monotone cost, like llama.cpp's
tiled CPU kernels (a batch one token past a tile boundary pays for a slow remainder path).
"""

from __future__ import annotations

import numpy as np
import pytest

from fakes import Clock, FakeBackend, greedy_reference
from specdec_cli.core.controller import AdaptiveK
from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine
from specdec_cli.core.records import Step
from specdec_cli.core.stats import summarize
from specdec_cli.core.verify_curve import VerifyCurve
from specdec_cli.core.verify_timing import measure
from specdec_cli.drafters.auto import AutoDrafter
from specdec_cli.drafters.suffix import SuffixDrafter


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


def test_measure_times_the_planned_sizes_interpolates_between_and_leaves_its_cache_empty():
    from specdec_cli.core.verify_timing import plan, plan_passes

    clock = Clock()
    target = FakeBackend(n_ctx=1024, n_batch=128, clock=clock, cost=tiled)
    target.decode([5, 6, 7])
    seen = []
    curve = measure(target, repeats=2, context=64, clock=clock, progress=lambda done, total: seen.append(done))
    sizes = plan(65)
    assert curve.sizes == sizes == (*range(1, 18), 24, 32, 40, 48, 56, 64) and curve.b_max == 65
    assert [curve.at(b) for b in sizes] == pytest.approx([tiled(b) for b in sizes])  # every size as timed
    assert curve.at(28) == pytest.approx((tiled(24) + tiled(32)) / 2)  # between the spaced sizes: interpolated
    assert curve.at(65) == pytest.approx(tiled(64) + (tiled(64) - tiled(56)) / 8)  # past them: the last slope
    assert seen == list(range(1, plan_passes(65, 2) + 1)) and len(target.tokens) == 0
    assert curve.depth == 640 and curve.depth_ms == pytest.approx((0.0, 0.0), abs=1e-6)  # the same at any depth
    assert curve.disturbed == ""


def epyc_ms(b: int) -> float:
    """A CPU's pass over b tokens, shaped like an AMD EPYC's (Qwen2.5-Coder-1.5B Q4_K_M): nearly linear,
    v(1) = 75 ms, v(64) ~ 2 s; a prefill chunk costs the same per token."""
    return 75.0 + 30.0 * (b - 1)


def test_the_plan_measures_a_steep_cpu_in_under_a_minute_with_few_passes():
    # The old scheme timed all 65 sizes twice (130 passes plus warm-ups: ~165 s on this curve); the plan times what
    # the controller uses (1..17) and a spaced set beyond, and the same sizes again at a second depth.
    from specdec_cli.core.verify_timing import plan, plan_passes

    clock = Clock()
    target = FakeBackend(n_ctx=4096, n_batch=512, clock=clock, cost=epyc_ms)
    curve = measure(target, clock=clock)
    assert curve.seconds <= 60.0, curve.seconds
    assert plan_passes() <= 70 and target.n_decode_calls <= plan_passes() + 3  # + the untimed warm-ups
    assert len(plan()) <= 24
    assert curve.array(65) == pytest.approx([epyc_ms(b) for b in range(1, 66)])  # linear: interpolation is exact


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
    engine = SpeculativeEngine(
        target, AutoDrafter(SuffixDrafter(None)), AdaptiveK(curve=curve), clock=clock, curve=curve
    )
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


def fake_machine(threads, placement=""):
    """`stores.tuned.machine` of a fake CPU with a build that may offload (`placement`)."""
    return {
        "cpu": "cpu",
        "threads": threads,
        "system_info_sha256": "abc",
        "key": f"cpu|{threads}|abc" + (f"|{placement}" if placement else ""),
    }


def test_the_curve_learnt_json_keeps_is_measured_again_once_stale(tmp_path, monkeypatch):
    from specdec_cli.stores import learnt

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    monkeypatch.setattr("specdec_cli.stores.tuned.machine", fake_machine)
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


def test_curves_and_tuned_k_are_kept_per_device_and_layers_offloaded(tmp_path, monkeypatch):
    # A curve timed with --gpu-layers 0 must not price a fully offloaded run (issue 53): the device and the layers
    # that went to it are part of both keys; a build that cannot offload keeps an older specdec's keys.
    from specdec_cli.models import devices
    from specdec_cli.stores import learnt, tuned

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    gpu = [
        devices.Device("CPU", "a CPU", "CPU", 0, 0),
        devices.Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "GPU", 1 << 30, 1 << 30),
    ]
    monkeypatch.setattr(devices, "model_need", lambda path, n_ctx: (1 << 30, 28))
    cpu_build = devices.placement(model, -1, gpu=False, devs=None)
    none_on = devices.placement(model, 0, gpu=True, devs=gpu)
    all_on = devices.placement(model, -1, gpu=True, devs=gpu)
    assert cpu_build == "" and none_on == "CPU, 0 layers offloaded"
    assert all_on == "Vulkan0 llvmpipe (LLVM 15.0.6, 256 bits), 29 layers offloaded"
    assert devices.placement(model, 99, gpu=True, devs=gpu) == all_on  # the count offloaded, not the option
    assert (
        devices.placement(model, 10, gpu=True, devs=gpu) == "Vulkan0 llvmpipe (LLVM 15.0.6, 256 bits), 10 layers "
        "offloaded"
    )
    keys = [learnt.curve_key(model, 2, p) for p in (cpu_build, none_on, all_on)]
    assert len(set(keys)) == 3 and keys[0] == learnt.curve_key(model, 2)  # a CPU build: an older specdec's key
    assert len({learnt.entry_key(model, None, "ngram", 2, 16, p) for p in (cpu_build, none_on, all_on)}) == 3
    tuned.save(model, None, "ngram", tuned.machine(2, all_on), 6)
    assert tuned.lookup(model, None, "ngram", 2, all_on) == 6
    assert tuned.lookup(model, None, "ngram", 2, none_on) is None and tuned.lookup(model, None, "ngram", 2) is None


def test_a_curve_is_measured_only_for_a_reason_and_the_reason_is_named(tmp_path, monkeypatch):
    from dataclasses import replace

    from specdec_cli.stores import learnt

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    monkeypatch.setattr("specdec_cli.stores.tuned.machine", fake_machine)
    cpu, vulkan = "CPU, 0 layers offloaded", "Vulkan0 llvmpipe, 29 layers offloaded"
    key = learnt.curve_key(model, 2, cpu)
    deep = replace(CURVE, depth=640)
    assert learnt.why_measure(key, None, learnt.timed_on(2, cpu)) == "none kept for this model, machine and device yet"
    learnt.save_curve(key, deep, model, learnt.timed_on(2, cpu))
    assert learnt.why_measure(key, deep) == ""  # kept and true: used as it is
    assert (
        learnt.why_measure(learnt.curve_key(model, 4, cpu), None, learnt.timed_on(4, cpu))
        == "other threads (4 here, 2 kept)"
    )
    assert (
        learnt.why_measure(learnt.curve_key(model, 2, vulkan), None, learnt.timed_on(2, vulkan))
        == f"another device or offload ({vulkan} here, {cpu} kept)"
    )
    assert "stale: 12 passes" in learnt.why_measure(key, replace(deep, stale=True, stale_why="12 passes cost 2x"))
    assert "provisional" in learnt.why_measure(key, replace(deep, provisional=True, disturbed="busy"))
    assert "one depth" in learnt.why_measure(key, CURVE)  # an older specdec's curve, timed at 256 tokens only
    learnt.learnt_path().unlink()
    learnt.save_curve(learnt.curve_key(model, 2), deep, model)  # an older specdec's entry: no device in its key
    assert learnt.why_measure(learnt.curve_key(model, 2, vulkan), None, learnt.timed_on(2, vulkan)).startswith(
        f"another device or offload ({vulkan} here; the kept curve does not say where it was timed)"
    )


def test_a_session_measures_its_curve_once_with_progress_and_keeps_it(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from specdec_cli.session import Session
    from specdec_cli.stores import learnt

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv(learnt.VERIFY_ENV, "auto")
    monkeypatch.setattr("specdec_cli.stores.tuned.machine", fake_machine)

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

    from specdec_cli.core.verify_timing import plan_passes

    first, target = session()
    assert first.verify_curve().b_max == 65
    assert target.n_decode_calls == plan_passes(65) + 3  # the untimed warm-ups; the deeper context in two batches
    assert len(Reporter.advanced) == plan_passes(65) and "measured" in Reporter.lines[0]
    again, target = session()
    assert again.verify_curve().to_dict() == first.verify_curve().to_dict()  # kept in learnt.json: not measured again
    assert target.n_decode_calls == 0


def test_real_passes_rescale_the_curve_and_a_drift_of_v1_is_noticed():
    from specdec_cli.core.cost_model import CostModel

    model = CostModel(16, curve=CURVE)
    assert model.verify_curve()[15] == 100.0 and model.verify_curve()[14] == 140.0  # the shape as measured
    for _ in range(20):  # this machine is twice as slow today, at b = 1
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
                verify_ms=40.0,
            )
        )
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
