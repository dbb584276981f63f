"""The K controller: --k parsing, the expected-tokens math, and AdaptiveK against synthetic machines.

Every test drives the controllers with synthetic `Step` records; the simulations draw acceptance per position from
Bernoulli(a) and costs from a verify curve, so they run in milliseconds without a model.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from fakes import DRAFT_MODEL_MS, cpu, gpu, lookup_draft, step
from specdec_cli.core.controller import AdaptiveK, FixedK
from specdec_cli.core.cost_model import CostPrior, best_k, expected_ms, expected_tokens, meet
from specdec_cli.core.draft import Draft
from specdec_cli.errors import UsageError
from specdec_cli.spec import K, SpecOptions, k_values, parse_k


def simulate(
    ctrl, curve, *, d_ms: float, accept: float, steps: int, seed: int, fill: float = 1.0, noise: float = 0.05
) -> tuple[float, list[int]]:
    """Drive `ctrl` for `steps` steps; return (tokens/s, the K of every step).

    The drafter proposes all K tokens with probability `fill`, else none (a lookup drafter without a match); each
    draft token is accepted with probability `accept` given the ones before; costs are the curve x (1 ± noise).
    `accept` may be a function of the step number.
    """
    rng = np.random.default_rng(seed)
    tokens, ms, ks = 0, 0.0, []
    for i in range(steps):
        k = ctrl.next_k()
        ks.append(k)
        n = k if k and rng.random() < fill else 0
        a = accept(i) if callable(accept) else accept
        rejected = np.flatnonzero(rng.random(n) >= a)
        n_acc = int(rejected[0]) if len(rejected) else n
        draft = d_ms * n * (1 + noise * rng.standard_normal()) if k else 0.0
        verify = curve(n + 1) * (1 + noise * rng.standard_normal())
        ctrl.observe(step(k, n, n_acc, max(draft, 0.0), max(verify, 1.0)))
        tokens += n_acc + 1
        ms += draft + verify
    return 1000.0 * tokens / ms, ks


def simulate_fixed(
    k: int, curve, *, d_ms: float, accept: float, steps: int, seed: int, fill: float = 1.0, noise: float = 0.05
) -> float:
    """`simulate` for a fixed K, vectorised over steps: tokens/s."""
    rng = np.random.default_rng(seed)
    n = np.where(rng.random(steps) < fill, k, 0) if k else np.zeros(steps, dtype=int)  # [steps] draft lengths
    ok = rng.random((steps, k)) < accept  # [steps, k]
    ok &= np.arange(k) < n[:, None]
    n_acc = np.where(ok.all(axis=1), n, np.argmin(ok, axis=1)) if k else n  # [steps] first rejection or all
    draft = d_ms * n * (1 + noise * rng.standard_normal(steps))
    verify = np.where(n > 0, curve(k + 1), curve(1)) * (1 + noise * rng.standard_normal(steps))
    return 1000.0 * (n_acc + 1).sum() / (draft + verify).sum()


# ---- --k parsing


def test_parse_k() -> None:
    assert parse_k("auto") is None
    assert parse_k(" AUTO ") is None
    assert parse_k("0") == 0
    assert parse_k("64") == 64
    for bad, says in [
        ("65", "between 0 and 64"),
        ("-1", "between 0 and 64"),
        ("four", "'auto' or a whole number"),
        ("", "'auto' or a whole number"),
        ("2.5", "'auto' or a whole number"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_k(bad)


def test_k_is_auto_or_a_number_parsed_once_and_shown_as_given() -> None:
    """`K`: a str ("auto" or the number, as chat and --json show it) whose `fixed` is the number (None: auto)."""
    assert (K(), K(" AUTO "), K(8), K("08")) == ("auto", "auto", "8", "8")
    assert (K().fixed, K(" AUTO ").fixed, K(0).fixed, K("64").fixed) == (None, None, 0, 64)
    assert json.dumps({"k": K(" 4")}) == '{"k": "4"}' and f"K {K('auto')}" == "K auto"
    spec = SpecOptions(method="ngram", k=" 12 ")
    assert (spec.k, spec.k.fixed, spec.fixed_k, SpecOptions().fixed_k) == ("12", 12, 12, None)
    with pytest.raises(UsageError, match="between 0 and 64"):
        K("65")


def test_k_values() -> None:
    assert k_values("8") == [8]
    assert k_values("8,2,4,4") == [2, 4, 8]
    assert k_values("4..16") == [4, 6, 8, 12, 16]
    assert k_values("0..4") == [0, 1, 2, 3, 4]
    assert k_values("5..7") == [5, 6, 7]
    assert k_values("0, 10..20") == [0, 10, 12, 16, 20]
    for bad, says in [
        ("", "needs values"),
        ("2,,4", "needs values"),
        ("16..4", "runs backwards"),
        ("4..x", "whole numbers"),
        ("auto", "whole numbers"),
        ("0..65", "between 0 and 64"),
    ]:
        with pytest.raises(ValueError, match=says):
            k_values(bad)


def test_fixed_k() -> None:
    fixed = FixedK(5)
    assert fixed.next_k() == 5
    fixed.observe(step(5, 5, 3, 140.0, 220.0))
    snap = fixed.snapshot()
    assert snap["mode"] == "fixed" and snap["k"] == 5 and snap["verify_ms"] == [[6, 220.0, 1]]
    with pytest.raises(ValueError, match="between 0 and 64"):
        FixedK(65)
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(0)


# ---- the math


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.9, 0.99])
def test_expected_tokens_matches_closed_form_for_iid_acceptance(a: float) -> None:
    e = expected_tokens(np.full(16, a))
    ks = np.arange(17)
    np.testing.assert_allclose(e, (1 - a ** (ks + 1)) / (1 - a))


def test_expected_tokens_by_position_and_fill() -> None:
    np.testing.assert_allclose(expected_tokens(np.array([0.5, 0.5, 1.0])), [1, 1.5, 1.75, 2.0])
    # a lookup drafter that proposes anything only half the time: every path through position 1 is halved
    np.testing.assert_allclose(expected_tokens(np.array([1.0, 1.0]), np.array([0.5, 1.0])), [1, 1.5, 2.0])


def test_expected_ms_charges_the_batch_actually_verified() -> None:
    v = np.array([10.0, 20.0, 30.0])  # b = 1, 2, 3
    np.testing.assert_allclose(expected_ms(v, 5.0, 1.0, np.ones(2)), [10, 1 + 5 + 20, 1 + 10 + 30])
    # fill 0.5 at position 1: half the calls draft nothing and verify one token
    np.testing.assert_allclose(
        expected_ms(v, 5.0, 0.0, np.array([0.5, 1.0])), [10, 0.5 * 10 + 0.5 * 20 + 2.5, 0.5 * 10 + 0.5 * 30 + 5.0]
    )


def test_hysteresis_keeps_plain_decoding_unless_speculation_clearly_pays() -> None:
    assert best_k(np.array([100.0, 102.0, 101.0])) == 0  # 2 % better: not worth it
    assert best_k(np.array([100.0, 102.0, 105.0])) == 2  # 5 % better
    assert best_k(np.array([100.0, 102.0, 105.0]), margin=0.10) == 0
    assert best_k(np.array([100.0, 90.0, 80.0])) == 0


# ---- decisions from fed steps


def feed(ctrl: AdaptiveK, curve, *, d_ms: float, a: float, n: int = 300, seed: int = 0) -> None:
    """Feed steps at K = 1..8 (and some plain steps) regardless of what ctrl asks: pure learning."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        k = i % 9
        rejected = np.flatnonzero(rng.random(k) >= a)
        n_acc = int(rejected[0]) if len(rejected) else k
        ctrl.observe(step(k, k, n_acc, d_ms * k, curve(k + 1)))


def test_picks_plain_decoding_on_a_linear_cpu_with_a_draft_model() -> None:
    ctrl = AdaptiveK()
    feed(ctrl, cpu, d_ms=DRAFT_MODEL_MS, a=0.6)
    assert ctrl.next_k() == 0
    snap = ctrl.snapshot()
    assert snap["draft_ms_per_token"] == pytest.approx(DRAFT_MODEL_MS, rel=0.01)
    assert snap["acceptance"][0] == pytest.approx(0.6, abs=0.12)
    assert snap["verify_model_ms"][:4] == pytest.approx([58, 105, 142.5, 180], rel=0.01)


def test_picks_a_long_draft_on_a_flat_gpu_with_a_cheap_drafter() -> None:
    ctrl = AdaptiveK()
    feed(ctrl, gpu, d_ms=0.5, a=0.9)
    assert ctrl.next_k() >= 8


def test_first_step_is_plain_then_it_tries_drafting() -> None:
    ctrl = AdaptiveK()
    assert ctrl.next_k() == 0  # measures v(1)
    ctrl.observe(step(0, 0, 0, 0.0, 58.0))
    assert ctrl.next_k() > 0  # the prior (a = 0.7, drafts free, v(2) = 1.5 v(1)) says drafting may pay


def test_a_prior_with_measured_costs_skips_the_exploration() -> None:
    learnt = AdaptiveK()
    feed(learnt, cpu, d_ms=DRAFT_MODEL_MS, a=0.9)
    snap = learnt.snapshot()
    prior = CostPrior(
        acceptance=snap["acceptance"][0],
        draft_ms_per_token=snap["draft_ms_per_token"],
        draft_ms_per_call=snap["draft_ms_per_call"],
        verify_ms=tuple((b, ms) for b, ms, _n in snap["verify_ms"]),
    )
    ctrl = AdaptiveK(prior=prior)
    assert ctrl.next_k() == 0  # the curve and the draft cost are known: plain decoding wins from step 0
    ctrl.observe(step(0, 0, 0, 0.0, 58.0))
    assert ctrl.next_k() == 0


def test_a_drafter_that_proposes_nothing_teaches_no_acceptance() -> None:
    ctrl = AdaptiveK()
    for _ in range(50):
        ctrl.observe(step(4, 0, 0, 0.1, 58.0, source="ngram"))
    snap = ctrl.snapshot()
    assert snap["acceptance"][0] == pytest.approx(0.7)  # still the prior
    assert snap["fill"][0] < 0.1
    assert snap["verify_ms"] == [[1, 58.0, 50]]
    assert snap["by_source"]["ngram"]["drafted"] == 0


def test_a_step_that_stopped_inside_the_accepted_prefix_counts_no_rejection() -> None:
    ctrl = AdaptiveK()
    for _ in range(50):
        s = step(4, 4, 2, 0.0, 100.0)
        ctrl.observe(replace(s, target_token=None))  # e.g. an end-of-generation token among the accepted
    acc = ctrl.snapshot()["acceptance"]
    assert acc[0] > 0.95 and acc[1] > 0.95 and acc[2] == pytest.approx(acc[1], abs=1e-3)  # position 3 unseen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_comes_back_from_plain_decoding_when_drafts_improve(seed: int) -> None:
    # The CPU curve with near-free drafts: at a = 0.2 plain decoding wins, at a = 0.95 K > 0 does.
    ctrl = AdaptiveK()
    switch = 200
    _, ks = simulate(ctrl, cpu, d_ms=0.1, accept=lambda i: 0.2 if i < switch else 0.95, steps=switch + 200, seed=seed)
    assert sum(k > 0 for k in ks[switch - 100 : switch]) <= 5  # plain, with probes backed off to every 64 steps
    back = next(i for i in range(switch, len(ks)) if all(k > 0 for k in ks[i : i + 10]))
    assert back - switch <= 2 * 4 * 16 + 20  # at worst: one unlucky probe, a second 64-step wait, a short burst


def test_failed_probes_back_off() -> None:
    # The CPU with a free drafter that is rarely right: each probe fails, so probes thin out to one every 64 steps.
    _, ks = simulate(AdaptiveK(), cpu, d_ms=0.1, accept=0.2, steps=600, seed=0)
    tries = [i for i, k in enumerate(ks) if k > 0]
    assert tries[0] == 1  # the prior's try
    probes = [i for i in tries[1:] if ks[i] == 3]
    assert len(probes) >= 6 and probes == tries[len(tries) - len(probes) :]
    assert list(np.diff(probes))[-4:] == [64] * 4


def test_no_probes_when_even_perfect_drafts_could_not_pay() -> None:
    # The CPU with the 28 ms draft model: a 4-token draft costs 112 ms + a 5-token pass, more than 5 plain steps,
    # so once both costs are measured no acceptance can make drafting pay and the controller stops trying.
    _, ks = simulate(AdaptiveK(), cpu, d_ms=DRAFT_MODEL_MS, accept=0.9, steps=600, seed=0)
    tries = [i for i, k in enumerate(ks) if k > 0]
    assert tries and tries[-1] < 100, tries
    # ... while on a flat GPU the same 28 ms draft would pay with perfect acceptance, so probes continue.
    _, ks = simulate(AdaptiveK(), lambda b: 60.0, d_ms=DRAFT_MODEL_MS / 4, accept=0.05, steps=600, seed=0)
    assert any(k > 0 for k in ks[400:])


def test_draft_cost_separates_per_call_and_per_token_ms() -> None:
    ctrl = AdaptiveK()
    for i in range(40):
        n = i % 5
        ctrl.observe(step(4, n, 0, 3.0 + 25.0 * n, 100.0))
    snap = ctrl.snapshot()
    assert snap["draft_ms_per_token"] == pytest.approx(25.0)
    assert snap["draft_ms_per_call"] == pytest.approx(3.0)


# ---- simulations: auto against the best fixed K


# name: (scenario, the fraction of the best fixed K's tokens/s that auto must reach)
SCENARIOS = {
    "cpu, free lookup drafter, a=0.9": (dict(curve=cpu, d_ms=0.0, accept=0.9), 0.9),
    "cpu, 28 ms draft model, a=0.9": (dict(curve=cpu, d_ms=DRAFT_MODEL_MS, accept=0.9), 0.9),
    "flat gpu, 2 ms draft, a=0.8": (dict(curve=gpu, d_ms=2.0, accept=0.8), 0.9),
    # A lookup drafter that finds a match in 40 % of steps: the evidence per half-life is scarce and the CPU's
    # tokens/s is nearly flat from K = 3 to 16, so auto averages ~0.95 of the best K but can dip to 0.9.
    "cpu, lookup matching 40 %, a=0.95": (dict(curve=cpu, d_ms=0.0, accept=0.95, fill=0.4), 0.85),
}


def test_the_two_simulators_agree() -> None:
    sc, _ = SCENARIOS["cpu, lookup matching 40 %, a=0.95"]
    looped, ks = simulate(FixedK(8), steps=3000, seed=4, **sc)
    assert set(ks) == {8}
    assert looped == pytest.approx(simulate_fixed(8, steps=20_000, seed=5, **sc), rel=0.03)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_auto_is_close_to_the_best_fixed_k(name: str) -> None:
    sc, fraction = SCENARIOS[name]
    auto, _ = simulate(AdaptiveK(), steps=1500, seed=2, **sc)
    fixed = [simulate_fixed(k, steps=20_000, seed=3, **sc) for k in range(17)]  # long runs: a less noisy best
    best = int(np.argmax(fixed))
    print(
        f"{name}: auto {auto:.1f} tok/s = {auto / fixed[best]:.3f} x best fixed K={best} {fixed[best]:.1f}, "
        f"{auto / fixed[0]:.3f} x plain {fixed[0]:.1f}"
    )
    assert auto >= fraction * fixed[best]
    assert auto >= 0.95 * fixed[0]


# ---- trimming lookup drafts by the length of their match


def drive_lookup(ctrl: AdaptiveK, *, steps: int, seed: int, curve=cpu) -> list[tuple[int, int]]:
    """A lookup drafter on a copy-heavy edit: half its drafts come from long matches (33+ tokens, the copy runs, whose
    next 40 tokens are right) and half from 2-token matches (right 20 % of the time, one token). Returns
    (match_len, K verified) per step that drafted."""
    rng = np.random.default_rng(seed)
    ctrl.observe(step(0, 0, 0, 0.0, curve(1)))
    out = []
    for _ in range(steps):
        k = ctrl.next_k()
        if k == 0:
            ctrl.observe(step(0, 0, 0, 0.0, curve(1)))
            continue
        m = 40 if rng.random() < 0.5 else 2
        keep = ctrl.trim(lookup_draft(m, min(k, 64)))
        right = 40 if m == 40 else int(rng.random() < 0.2)
        n_acc = min(keep, right)
        out.append((m, keep))
        ctrl.observe(
            replace(step(keep, keep, n_acc, 0.02, curve(keep + 1)), source="ngram" if keep else "", match_len=m)
        )
    return out


def test_lookup_drafts_are_trimmed_by_their_match_on_a_cpu() -> None:
    ctrl = AdaptiveK()
    ks = drive_lookup(ctrl, steps=400, seed=0)
    assert ctrl.evidence and ctrl.next_k() == 64  # free drafts: ask for all, then trim
    late = ks[-100:]
    short = [k for m, k in late if m == 2]
    long = [k for m, k in late if m == 40]
    assert short and sum(k > 0 for k in short) <= 0.15 * len(short)  # weak matches: plain steps, a few probes
    assert long and np.median(long) >= 16  # copy runs: long drafts
    snap = ctrl.snapshot()
    by_match = snap["acceptance_by_match"]["ngram"]  # lookup evidence is kept per source
    assert by_match["33"][0] > 0.9 and by_match["2"][0] < 0.5


def test_a_buckets_draft_length_grows_only_with_verified_positions() -> None:
    # Slow start: a few fully accepted short drafts in a bucket do not license a 64-token pass at once.
    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    ctrl.observe_prefill(500, 500 * 20.0, 512)  # a CPU's prefill: 20 ms a token in a 500-token pass
    seen, ks = 0, []
    for _ in range(6):
        keep = ctrl.trim(lookup_draft(40))
        assert 0 < keep <= max(3, 2 * seen)  # every draft is right, but K at most doubles
        ks.append(keep)
        seen = max(seen, keep)
        ctrl.observe(replace(step(keep, keep, keep, 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    assert ks[-1] > 16, ks  # ... and it does grow while the drafts stay right


def test_trim_keeps_drafts_without_evidence_and_never_exceeds_the_draft() -> None:

    ctrl = AdaptiveK()
    model_draft = Draft(tokens=np.arange(5, dtype=np.int32), source="draft")
    assert ctrl.trim(model_draft) == 5 and not ctrl.evidence
    assert FixedK(8).trim(lookup_draft(40, 5)) == 5
    assert 0 <= ctrl.trim(lookup_draft(40, 2)) <= 2


def test_a_prefill_measures_the_verify_curve() -> None:
    ctrl = AdaptiveK()
    ctrl.observe_prefill(300, 6000.0, 512)
    ctrl.observe_prefill(1024, 40000.0, 512)  # two chunks: a 512-token pass at the mean cost
    pts = {b: ms for b, ms, _ in ctrl.snapshot()["verify_ms"]}
    assert pts[300] == pytest.approx(6000.0) and pts[512] == pytest.approx(20000.0)
    ctrl.observe_prefill(1, 50.0, 512)  # one token says nothing about batches
    assert 1 not in {b for b, _, _ in ctrl.snapshot()["verify_ms"]}


def test_an_optimistic_prefill_point_does_not_keep_futile_probes_alive() -> None:
    # The prefill's 512-token pass (20 ms a token) makes v(b) look cheap between the measured sizes and 512; only
    # the sizes verify steps timed decide whether perfect drafts of the 28 ms draft model could pay: they cannot.
    ctrl = AdaptiveK()
    ctrl.observe_prefill(512, 512 * 20.0, 512)
    _, ks = simulate(ctrl, cpu, d_ms=DRAFT_MODEL_MS, accept=0.9, steps=600, seed=0)
    tries = [i for i, k in enumerate(ks) if k > 0]
    assert tries and tries[-1] < 100, tries


def test_a_slow_first_lookup_call_does_not_hide_that_lookup_drafts_are_free() -> None:
    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for draft_ms, free in ((30.0, False), (0.05, True), (30.0, True)):  # warm-up, steady state, one hiccup
        keep = ctrl.trim(lookup_draft(40, 3))
        ctrl.observe(
            replace(step(keep, keep, keep, draft_ms, cpu(keep + 1)), source="ngram" if keep else "", match_len=40)
        )
        assert (ctrl.next_k() == 64) is free


# A CPU's bumpy verify curve (Qwen2.5-Coder-1.5B Q4_K_M, logits for every row): per token, b = 9 costs more than b = 5,
# b = 17 about the same, and b = 33 to 65 far less. A model fitted to the small sizes alone sees no gain in longer K.
BUMPY_B = np.array([1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65], dtype=np.float64)
BUMPY_MS = np.array([40, 76, 92, 126, 156, 188, 282, 317, 401, 433, 526, 727, 779, 886, 1118, 1203, 1372.0])


def bumpy(b: int) -> float:
    return float(np.interp(b, BUMPY_B, BUMPY_MS))


def test_a_bumpy_verify_curve_does_not_trap_k_below_drafts_that_are_always_right() -> None:
    # No prefill point (the prompt's cache was reused), and every 64-token draft of a long match is right: K must
    # climb to long passes instead of settling where the small sizes measured best (K = 2..4).
    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, bumpy(1)))
    ks = []
    for _ in range(12):
        keep = ctrl.trim(lookup_draft(40))
        ks.append(keep)
        ctrl.observe(
            replace(step(keep, keep, keep, 0.02, bumpy(keep + 1)), source="ngram" if keep else "", match_len=40)
        )
    assert max(ks) >= 32 and ks[-1] >= 32, ks


def test_a_branch_in_the_draft_caps_k_where_past_continuations_part_ways() -> None:

    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for _ in range(8):  # a bucket of long matches whose drafts are always right
        keep = ctrl.trim(lookup_draft(40))
        ctrl.observe(replace(step(keep, keep, keep, 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    sure = np.ones(64)
    branch = sure.copy()
    branch[3] = 0.2  # 1 in 5 past outputs that match here went on with draft token 4
    tokens = np.arange(64, dtype=np.int32)
    # the same source as the drafts that built the evidence (evidence is per source)
    assert ctrl.trim(Draft(tokens=tokens, source="ngram", match_len=40, probs=sure)) > 3
    assert ctrl.trim(Draft(tokens=tokens, source="ngram", match_len=40, probs=branch)) == 3


def test_a_session_keeps_one_adaptive_controller_per_method_across_generations() -> None:
    from pathlib import Path

    from fakes import FakeBackend
    from specdec_cli.assemble import Assembler
    from specdec_cli.session import Session
    from specdec_cli.spec import SpecOptions

    session = Assembler(Session(target=FakeBackend(), target_path=Path("t.gguf")))
    first = session.make_controller(SpecOptions(method="suffix"))
    first.observe(step(0, 0, 0, 0.0, 40.0))
    again = session.make_controller(SpecOptions(method="suffix"))
    assert again is first and again.model.measured(1)  # what the first generation learnt carries over
    assert session.make_controller(SpecOptions(method="ngram")) is not first  # another drafter, another model
    assert session.make_controller(SpecOptions(method="suffix"), fresh=True) is not first
    assert session.make_controller(SpecOptions(method="suffix")) is first  # a fresh one does not replace it
    assert isinstance(session.make_controller(SpecOptions(method="suffix", k="4")), FixedK)
    assert session.make_controller(SpecOptions(method="suffix"), saved_k=6).next_k() == 6


def test_a_bucket_that_was_right_for_long_backs_off_within_a_few_rejections() -> None:
    # 60 right 64-token drafts (a repeated workload), then the reply leaves what was stored: every draft of the
    # same bucket is now wrong at its 3rd token. Failed long passes must stop after a few, not after dozens.
    ctrl = AdaptiveK()
    ctrl.observe(step(0, 0, 0, 0.0, cpu(1)))
    for _ in range(60):
        keep = ctrl.trim(lookup_draft(40))
        ctrl.observe(replace(step(keep, keep, keep, 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    assert keep == 64
    ks = []
    for _ in range(6):
        keep = ctrl.trim(lookup_draft(40))
        ks.append(keep)
        ctrl.observe(replace(step(keep, keep, min(keep, 2), 0.02, cpu(keep + 1)), source="ngram", match_len=40))
    assert sum(k > 8 for k in ks) <= 2 and ks[-1] <= 3, ks


def test_a_lookup_step_is_not_counted_as_the_draft_models_probe() -> None:
    """A flat verify curve (a GPU), a draft model that is always wrong and a lookup source that is always right on
    half the steps (at random): the draft model's probes fail, so they back off (towards one every 64 steps),
    whatever the lookup drafts do. The bug: a probe started in `choose` was taken over by a winning lookup draft, and
    `observe` counted that lookup step as the probe's outcome (a paying one), so the probes came every few steps
    (90 model steps of the last 400 before the fix)."""

    ctrl = AdaptiveK()
    rng = np.random.default_rng(0)
    flat, model_ms = 20.0, 12.0  # ms per verify pass whatever its size; ms per draft-model token
    model_steps = []
    for i in range(800):
        k = ctrl.next_k()
        if k == 0:
            ctrl.observe(step(0, 0, 0, 0.0, flat))
            continue
        drafts = (
            [Draft(tokens=np.arange(min(k, 8), dtype=np.int32), source="prompt", match_len=40)]
            if rng.random() < 0.5
            else []
        )
        k, draft = ctrl.choose(drafts, True, k)
        if draft is None and k > 0:  # the draft model drafts k tokens, all rejected
            model_steps.append(i)
            ctrl.observe(step(k, k, 0, model_ms * k, flat, source="draft"))
        elif draft is not None and len(draft):  # the lookup draft, accepted whole
            n = len(draft)
            ctrl.observe(replace(step(k, n, n, 0.05, flat, source="prompt"), match_len=draft.match_len))
        else:  # a plain step (a lookup draft trimmed to nothing still tells its evidence)
            ctrl.observe(replace(step(0, 0, 0, 0.05, flat), match_len=draft.match_len if draft is not None else 0))
    late = [i for i in model_steps if i >= 400]
    assert 1 <= len(late) <= 16, late  # probes backed off, not one every few steps


def _calls(fixed: float, per_row: float, per_row_per_1k: float = 0.0):
    """predict(b, depth) for `meet`: a call's fixed cost (the weights' read), its rows', and its rows' attention over
    its deepest sequence's cells."""
    return lambda b, depth: fixed + per_row * b + per_row_per_1k * b * depth / 1000.0


def _e(rows: int, a: float = 0.9) -> np.ndarray:
    return expected_tokens(np.full(rows - 1, a))  # [rows]


def test_meet_cuts_steps_of_unequal_rows_to_one_count_where_one_call_pays():
    """Four lanes' steps of 13-19 rows pay four calls; on a CPU's steep curve with a call's fixed cost, one call over
    them cut to a common count yields more tokens per ms (each cut lossless)."""
    steps = [(r, _e(r), 600) for r in (13, 19, 15, 17)]
    plan = meet(steps, _calls(80.0, 12.0))
    assert len({r for r, _ in plan}) == 1 and plan[0][0] <= 13 and {c for _, c in plan} == {0}
    assert meet(steps, _calls(50.0, 0.1)) == [(13, 0)] * 4  # a GPU's flat curve: one call costs what one step does


def test_meet_never_cuts_a_step_without_an_estimate_nor_a_deep_draft_to_a_plain_step():
    assert meet([(13, None, 600), (19, None, 600)], _calls(80.0, 12.0)) == [(13, 0), (19, 1)]
    assert meet([(1, None, 600), (13, _e(13), 600)], _calls(80.0, 12.0)) == [(1, 0), (13, 1)]


def test_meet_keeps_a_draft_token_in_every_step_it_cuts():
    """Four chats' first drafts, one token each (a controller's prior), at depths a by-depth split puts in two calls
    on a CPU's curve where 8 rows are dear: one call over the four cut to plain steps looks cheaper per token, but a
    plain step verifies nothing, so each controller would draft the same token again and see it cut again, for the
    whole reply (four chats at once decoded plainly, 1.0 tokens a pass). A cut keeps one draft token."""
    v = [40.0, 55.0, 70.0, 90.0, 140.0, 160.0, 178.0, 256.0]  # ms by rows, 1..8

    def predict(b: int, depth: int) -> float:
        return v[b - 1] + 4.84 * b * depth / 1000.0

    steps = [(2, _e(2, 0.7), d) for d in (842, 1188, 609, 1629)]
    plan = meet(steps, predict)
    assert [r for r, _ in plan] == [2, 2, 2, 2]
    assert meet([(1, None, 600), (2, _e(2, 0.7), 600), (9, _e(9), 600)], _calls(80.0, 12.0))[1][0] == 2


def test_meet_prices_a_shared_call_at_its_deepest_sequence():
    """A shared call's attention spans its deepest stream's cells: a shallow lane's step joins a deep one's only where
    attention is cheap."""
    steps = [(5, _e(5), 100), (9, _e(9), 8000)]
    assert meet(steps, _calls(80.0, 12.0)) == [(5, 0), (5, 0)]
    assert meet(steps, _calls(80.0, 12.0, per_row_per_1k=10.0)) == [(5, 0), (9, 1)]


def test_meet_splits_steps_of_equal_rows_into_calls_by_depth_where_that_is_cheaper():
    """Two chats at ~1k tokens and two agents at ~20k, 16 rows each: one call would make the chats' rows attend over
    the agents' cells; two calls, neighbours in depth together, read the weights twice and save that."""
    steps = [(16, None, d) for d in (20_000, 700, 20_100, 900)]
    assert meet(steps, _calls(80.0, 12.0, per_row_per_1k=5.0)) == [(16, 1), (16, 0), (16, 1), (16, 0)]
    assert meet(steps, _calls(80.0, 12.0)) == [(16, 0)] * 4  # attention free: one call


def test_expected_tokens_of_a_lookup_draft_by_how_much_of_it_is_verified():
    ctrl = AdaptiveK(curve=None)
    e = ctrl.expected(lookup_draft(8, 6))
    assert e is not None and e.shape == (7,) and e[0] == 1.0 and np.all(np.diff(e) > 0)
    assert ctrl.expected(Draft(tokens=np.arange(4, dtype=np.int32))) is None  # a draft model's: no estimate
    assert FixedK(8).expected(lookup_draft(8, 6)) is None
