"""`specdec tune`'s measuring: which configurations run, in which order, what each run measured, and which setting
is best. The command (`specdec_cli.cli.commands.tune`) prints it; `tune_report` draws the tables.

Every configuration (plain decoding, each fixed K, and `auto`) generates from the same prompts in one process, in
the rotating order of `specdec_cli.measure.sweep.schedule`. One short untimed generation warms both models up
first. Consecutive runs of a prompt reuse its KV cache (the engine keeps the longest common prefix), so only the
first run of each block pays the prefill, and only decoding is timed (`RunStats.tokens_per_s`: output tokens / wall
time of the decode loop).

Per configuration and prompt, tok/s is the median over repeats and the speedup is that median over plain decoding's
on the same prompt; the overall speedup is the geometric mean of the per-prompt speedups (a ratio's natural mean:
2x on one prompt and 0.5x on the other average to 1x). Acceptance rate and mean accepted length pool all runs.

The best setting is the configuration with the highest overall speedup, except that `auto` is preferred when it is
within `AUTO_MARGIN` of it: the adaptive controller also adjusts to prompts the tune did not see. Plain decoding
winning saves K = 0. `--save` writes it to tuned.json (`save_best`, `specdec_cli.stores.tuned`).

Learning drafters (suffix) do not learn during a tune (`sweep.NoLearning`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.engine import GenerationConfig
from specdec_cli.errors import UsageError
from specdec_cli.measure.sweep import NoLearning, geomean, rounded, schedule
from specdec_cli.prompts import PromptCase
from specdec_cli.spec import K, SpecOptions

if TYPE_CHECKING:
    from specdec_cli.models.resolver import Task

AUTO_MARGIN = 0.03  # save "auto" when it is within 3 % of the best measured speedup
WARMUP_TOKENS = 8
JSON_VERSION = 1


# --------------------------------------------------------------------------------------------------------------
# What is measured, and in which order


@dataclass(frozen=True, slots=True)
class TuneConfig:
    """One configuration: `label` is "none" (plain decoding), "auto" (AdaptiveK) or the fixed K as text ("4")."""

    label: str

    @property
    def k(self) -> int | None:
        """The fixed K (None for none and auto)."""
        return int(self.label) if self.label.isdigit() else None

    @property
    def mode(self) -> str:
        return self.label if self.label in ("none", "auto") else "fixed"

    @property
    def title(self) -> str:
        return {"none": "plain", "auto": "auto"}.get(self.label, f"K={self.label}")

    @property
    def saved_k(self) -> int | str:
        """The value `--save` writes for this configuration: "auto", or K (0 for plain decoding)."""
        return "auto" if self.label == "auto" else (self.k if self.k is not None else 0)


def parse_tune_k(spec: str) -> list[int]:
    """`tune --k`: the fixed K values to measure besides plain decoding and auto ("auto" alone: none).

    "4..16" → [4, 6, 8, 12, 16], "2,4,8" → [2, 4, 8] (`options.k_values`). Raises UsageError.
    """
    from specdec_cli.spec import k_values

    if spec.strip().lower() == "auto":
        return []
    try:
        return k_values(spec)
    except ValueError as e:
        raise UsageError(
            str(e), "For example --k 4..16, --k 2,4,8, or --k auto (auto and plain decoding only)."
        ) from None


def configs_for(ks: list[int]) -> list[TuneConfig]:
    """Plain decoding, then each fixed K, then auto."""
    return [TuneConfig("none"), *(TuneConfig(str(k)) for k in ks), TuneConfig("auto")]


# --------------------------------------------------------------------------------------------------------------
# Measurements and their summary


@dataclass
class Measurement:
    """One timed generation. Times in ms, speeds in tokens/s.

    `verify` holds (batch size, verify ms) per target pass and `drafts` (tokens drafted, draft ms) per step that
    drafted; both feed the verify-cost curve and are written to --json as per-run summaries.
    """

    config: str
    prompt: str
    repeat: int
    tokens_per_s: float
    n_tokens: int
    n_drafted: int
    n_accepted: int
    n_spec_steps: int
    mean_k: float
    k_histogram: dict[int, int]
    decode_ms: float
    prefill_ms: float
    n_prefill_evaluated: int
    finish_reason: str | None
    verify: list[tuple[int, float]] = field(default_factory=list)
    drafts: list[tuple[int, float]] = field(default_factory=list)
    controller: dict[str, Any] | None = None
    n_passes: int = 0
    verify_ms: float = 0.0
    cheap_passes: int = 0
    curve_passes: int = 0
    branch_passes: int = 0
    decode_j: float | None = None  # decoding's joules from the host's counters (models.energy), None without
    energy_note: str | None = None  # why decode_j is None

    _AS_IS = (  # the fields to_dict copies unchanged
        "config prompt repeat n_tokens n_drafted n_accepted n_spec_steps n_prefill_evaluated finish_reason n_passes "
        "cheap_passes curve_passes branch_passes"
    ).split()

    def to_dict(self) -> dict[str, Any]:
        """The --json row: names, counts and finish reason as they are, times (ms) and speeds (tok/s) rounded to 3
        places, the acceptance rate and mean accepted length, this run's verify curve and draft cost, and joules."""
        row: dict[str, Any] = {name: getattr(self, name) for name in self._AS_IS}
        for name in ("tokens_per_s", "mean_k", "decode_ms", "prefill_ms"):
            row[name] = round(getattr(self, name), 3)
        j_per_token = self.decode_j / self.n_tokens if self.decode_j is not None and self.n_tokens else None
        return row | {
            "acceptance_rate": round(_ratio(self.n_accepted, self.n_drafted), 4),
            "mean_accepted_length": round(_ratio(self.n_accepted, self.n_spec_steps), 4),
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "verify_ms_by_batch": [[b, round(ms, 3), n] for b, ms, n in verify_curve([self])],
            "draft_ms_per_token": rounded(draft_cost([self])),
            "tokens_per_pass": round(_ratio(self.n_tokens, self.n_passes), 3),
            "ms_per_pass": round(_ratio(self.verify_ms, self.n_passes), 3),
            "decode_joules": rounded(self.decode_j),
            "j_per_token": rounded(j_per_token, 6),
            "controller": self.controller,
        }


def _ratio(num: float, den: float) -> float:
    """num / den, 0.0 when den is 0 (a run that drafted nothing has acceptance 0, one without passes 0 ms a pass)."""
    return num / den if den else 0.0


def measure(config: TuneConfig, prompt: str, repeat: int, generation) -> Measurement:
    """A `Measurement` from a `driver.Result` (its stats and steps)."""
    st = generation.stats
    steps = generation.steps
    timed = [s for s in steps if s.verify_ms > 0]
    return Measurement(
        config=config.label,
        prompt=prompt,
        repeat=repeat,
        tokens_per_s=st.tokens_per_s,
        n_tokens=st.n_generated,
        n_drafted=st.n_drafted,
        n_accepted=st.n_accepted,
        n_spec_steps=sum(1 for s in steps if s.drafted),
        mean_k=st.mean_k,
        k_histogram=dict(st.k_histogram),
        decode_ms=st.decode_ms,
        prefill_ms=st.prefill_ms,
        n_prefill_evaluated=st.n_prefill_evaluated,
        finish_reason=st.finish_reason,
        verify=[(s.batch_size, s.verify_ms) for s in timed],
        drafts=[(len(s.drafted), s.draft_ms) for s in timed if s.drafted],
        n_passes=st.n_target_passes,
        verify_ms=st.verify_ms,
        cheap_passes=st.cheap_passes,
        curve_passes=st.curve_passes,
        branch_passes=st.branch_passes,
        decode_j=st.energy.decode_j if st.energy is not None else None,
        energy_note=st.energy_note,
    )


@dataclass
class ConfigSummary:
    """One configuration over all prompts: tok/s and speedup by prompt name, pooled acceptance."""

    config: TuneConfig
    tokens_per_s: dict[str, float]
    speedup: dict[str, float]
    speedup_geomean: float | None
    acceptance_rate: float
    mean_accepted_length: float
    mean_k: float
    k_histogram: dict[int, int]
    runs: int
    n_drafted: int = 0
    tokens_per_pass: float = 0.0
    ms_per_pass: float = 0.0
    cheap_share: float | None = None  # passes at cheap sizes of the measured curve / passes placed on it
    j_per_token: float | None = None  # decoding's joules over its output tokens, all runs pooled (None: see note)
    energy_note: str | None = None  # why j_per_token is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.label,
            "mode": self.config.mode,
            "k": self.config.k,
            "tokens_per_s": {p: round(v, 3) for p, v in self.tokens_per_s.items()},
            "speedup": {p: round(v, 4) for p, v in self.speedup.items()},
            "speedup_geomean": rounded(self.speedup_geomean),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "mean_k": round(self.mean_k, 3),
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "runs": self.runs,
            "n_drafted": self.n_drafted,
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "ms_per_pass": round(self.ms_per_pass, 3),
            "cheap_share": rounded(self.cheap_share),
            "j_per_token": rounded(self.j_per_token, 6),
            "energy_note": self.energy_note,
        }


def summarize(measurements: list[Measurement], configs: list[TuneConfig], prompts: list[str]) -> list[ConfigSummary]:
    """Median tok/s over repeats per (config, prompt), speedup over "none" on the same prompt, geometric mean.

    Configurations or prompts without runs (an interrupted tune) are left out of the dicts; the geometric mean
    covers the prompts where both the configuration and plain decoding ran (None if there are none).
    """

    def median_tps(label: str, prompt: str) -> float | None:
        xs = [m.tokens_per_s for m in measurements if m.config == label and m.prompt == prompt]
        return statistics.median(xs) if xs else None

    plain = {p: median_tps("none", p) for p in prompts}
    out = []
    for c in configs:
        runs = [m for m in measurements if m.config == c.label]
        tps = {p: v for p in prompts if (v := median_tps(c.label, p)) is not None}
        speedup = {p: v / base for p, v in tps.items() if (base := plain[p])}
        drafted = sum(m.n_drafted for m in runs)
        spec_steps = sum(m.n_spec_steps for m in runs)
        accepted = sum(m.n_accepted for m in runs)
        khist: dict[int, int] = {}
        for m in runs:
            for k, n in m.k_histogram.items():
                khist[k] = khist.get(k, 0) + n
        steps = sum(khist.values())
        passes = sum(m.n_passes for m in runs)
        placed = sum(m.curve_passes for m in runs)
        out.append(
            ConfigSummary(
                config=c,
                tokens_per_s=tps,
                speedup=speedup,
                speedup_geomean=geomean(list(speedup.values())),
                acceptance_rate=_ratio(accepted, drafted),
                mean_accepted_length=_ratio(accepted, spec_steps),
                mean_k=_ratio(sum(k * n for k, n in khist.items()), steps),
                k_histogram=khist,
                runs=len(runs),
                n_drafted=drafted,
                tokens_per_pass=_ratio(sum(m.n_tokens for m in runs), passes),
                ms_per_pass=_ratio(sum(m.verify_ms for m in runs), passes),
                cheap_share=sum(m.cheap_passes for m in runs) / placed if placed else None,
                **_energy(runs),
            )
        )
    return out


def _energy(runs: list[Measurement]) -> dict[str, Any]:
    """A configuration's J per output token: every run's decoding joules over every run's tokens, or None (with the
    first reason) when any run has no figure: a sum over some of the runs would not be this configuration's."""
    if runs and all(m.decode_j is not None for m in runs) and (n := sum(m.n_tokens for m in runs)):
        return {"j_per_token": sum(m.decode_j or 0.0 for m in runs) / n}  # (all set: checked above)
    note = next((m.energy_note for m in runs if m.decode_j is None and m.energy_note), None)
    return {"energy_note": note or ("no runs" if not runs else "no output tokens")}


def choose_best(summaries: list[ConfigSummary], margin: float = AUTO_MARGIN) -> TuneConfig | None:
    """The configuration with the highest overall speedup; auto when it is within `margin` of that. None if no
    configuration has a speedup (plain decoding never finished a run)."""
    scored = [s for s in summaries if s.speedup_geomean is not None]
    if not scored:
        return None
    best = max(scored, key=lambda s: s.speedup_geomean or 0.0)
    auto = next((s for s in scored if s.config.label == "auto"), None)
    if auto is not None and (auto.speedup_geomean or 0.0) >= (1.0 - margin) * (best.speedup_geomean or 0.0):
        return auto.config
    return best.config


def verify_curve(measurements: list[Measurement]) -> list[tuple[int, float, int]]:
    """(batch size b, median ms of a target pass over b tokens, passes) for every b measured."""
    by_b: dict[int, list[float]] = {}
    for m in measurements:
        for b, ms in m.verify:
            by_b.setdefault(b, []).append(ms)
    return [(b, statistics.median(v), len(v)) for b, v in sorted(by_b.items())]


def draft_cost(measurements: list[Measurement]) -> float | None:
    """Median over drafting steps of draft ms / tokens drafted (ms per drafted token), None if nothing drafted."""
    per = [ms / n for m in measurements for n, ms in m.drafts if n]
    return statistics.median(per) if per else None


# --------------------------------------------------------------------------------------------------------------
# Running it


@dataclass(frozen=True)
class TuneOptions:
    ks: list[int]
    repeats: int = 1
    json_path: str | None = None
    save: bool = False
    plot: str | None = None  # draw the measured verify curve to this .png/.svg


@dataclass
class TuneRun:
    """What a tune measured: the prompts' tokens, one `Measurement` per finished run, the planned number of runs,
    whether Ctrl-C cut it short, and the machine (`tuned.machine`)."""

    tokens: list[np.ndarray]
    measurements: list[Measurement]
    planned: int
    interrupted: bool
    machine: dict[str, Any]


def run(
    session,
    prompts: list[PromptCase],
    *,
    spec: SpecOptions,
    config: GenerationConfig,
    configs: list[TuneConfig],
    repeats: int,
    task: Task | None = None,
) -> TuneRun:
    """One warm-up, then every configuration on every prompt `repeats` times in `sweep.schedule` order, each run
    with a fresh K controller and the same drafter (which does not learn). Ctrl-C ends it with what was measured.

    task: a progress bar of `len(schedule(len(configs), len(prompts), repeats))` runs (the caller draws it): each
    run is described ("   K=4 · prompt · repeat 1") and advanced once it is measured."""
    from specdec_cli.assemble import Assembler
    from specdec_cli.driver import generate
    from specdec_cli.stores.tuned import machine

    tokens = [session.prompt_tokens(p.text) for p in prompts]
    plan = schedule(len(configs), len(prompts), repeats)
    measurements: list[Measurement] = []
    assembler = Assembler(session)  # every engine is fresh, with the drafter below: it owns nothing to close
    inner = assembler.make_drafter(spec)
    assert inner is not None  # (the command refuses --method none)
    drafter = NoLearning(inner)
    mach = machine(session.target.n_threads, session.placement())

    def engine(c: TuneConfig):  # a fresh controller for every run
        return assembler.engine(
            replace(spec, k=K("auto" if c.mode != "fixed" else c.label)),
            fresh=True,
            drafter=drafter if c.mode != "none" else None,
        )

    interrupted = False
    try:
        check_curve(session)  # before anything is timed on it
        warm = GenerationConfig(max_tokens=min(WARMUP_TOKENS, config.max_tokens), sampling=config.sampling)
        interrupted = generate(engine(TuneConfig("4")), tokens[0], warm).interrupted
        for slot in plan if not interrupted else ():
            c = configs[slot.config]
            if task is not None:
                task.describe(f"{c.title:>6} · {prompts[slot.prompt].name} · repeat {slot.repeat + 1}")
            e = engine(c)
            g = generate(e, tokens[slot.prompt], config)
            if g.interrupted:
                interrupted = True
                break
            m = measure(c, prompts[slot.prompt].name, slot.repeat, g)
            if c.mode == "auto":
                m.controller = e.controller.snapshot()
            measurements.append(m)
            if task is not None:
                task.advance()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        inner.close()
        assembler.save_learnt()  # nothing learnt to save (fresh controllers), but a curve the runs found drifted
    return TuneRun(tokens, measurements, len(plan), interrupted, mach)


def check_curve(session) -> bool:
    """Time `WATCH_MIN` one-token passes of the target (`verify_timing.measure_token_ms`, on `session.clock`) and, when
    they cost more than `verify_curve.DRIFT` away from the kept verify curve's v(1) (another load, a rebuilt library: a
    tune priced on such a curve chooses K for a machine that is not there), mark it stale and measure it again now
    (`Session.remeasure_curve`), so the runs are priced on this machine as it is. Returns True when it re-measured.
    Nothing without a curve."""
    from specdec_cli.core.verify_curve import WATCH_MIN
    from specdec_cli.core.verify_timing import measure_token_ms

    curve = session.verify_curve()
    if curve is None:
        return False
    ms = measure_token_ms(session.target, passes=WATCH_MIN, context=curve.context, clock=session.clock)
    if not curve.drifted(ms):
        return False
    session.remeasure_curve(f"one-token passes take {ms:.1f} ms now, the kept curve says {curve.ms[0]:.1f} ms")
    return True


def save_best(
    session,
    spec: SpecOptions,
    config: GenerationConfig,
    options: TuneOptions,
    summaries: list[ConfigSummary],
    best: TuneConfig,
    mach: dict[str, Any],
    names: list[str],
) -> Path:
    """--save: write `best` for this pair, method and machine to tuned.json (`stores.tuned.save`, with the tune's
    measurements as details); return the file. Raises OSError when it cannot be written."""
    from specdec_cli.stores.tuned import save

    win = next(s for s in summaries if s.config == best)
    plain = next(s for s in summaries if s.config.label == "none")
    return save(
        session.target_path,
        session.draft_path,
        spec.method,
        mach,
        best.saved_k,
        {
            "speedup": rounded(win.speedup_geomean),
            "tokens_per_s": rounded(statistics.fmean(win.tokens_per_s.values()), 3),
            "plain_tokens_per_s": rounded(statistics.fmean(plain.tokens_per_s.values()), 3),
            "speedup_by_config": {s.config.label: rounded(s.speedup_geomean) for s in summaries},
            "prompts": names,
            "max_tokens": config.max_tokens,
            "repeats": options.repeats,
        },
    )


def json_doc(
    session,
    spec: SpecOptions,
    config: GenerationConfig,
    options: TuneOptions,
    prompts: list[PromptCase],
    configs: list[TuneConfig],
    tune: TuneRun,
    summaries: list[ConfigSummary],
    best: TuneConfig | None,
    curve: list[tuple[int, float, int]],
    d_ms: float | None,
    saved: Path | None,
) -> dict[str, Any]:
    """The --json document (version `JSON_VERSION`)."""
    return {
        "version": JSON_VERSION,
        "target": str(session.target_path),
        "draft": str(session.draft_path) if session.draft_path else None,
        "method": spec.method,
        "k_values": options.ks,
        "configs": [c.label for c in configs],
        "repeats": options.repeats,
        "max_tokens": config.max_tokens,
        "sampling": {"temperature": config.sampling.temperature, "seed": config.sampling.seed},
        "prompts": [
            {"name": p.name, "kind": p.kind, "n_tokens": int(len(t))}
            for p, t in zip(prompts, tune.tokens, strict=False)
        ],
        "machine": tune.machine,
        "interrupted": tune.interrupted,
        "runs": [m.to_dict() for m in tune.measurements],
        "summary": [s.to_dict() for s in summaries],
        "best": best.label if best else None,
        "verify_ms_by_batch": [[b, round(ms, 3), n] for b, ms, n in curve],
        "verify_curve": session.verify_curve().to_dict() if session.verify_curve() is not None else None,
        "kernels": session.kernels(),
        "draft_ms_per_token": rounded(d_ms),
        "saved": str(saved) if saved else None,
    }
