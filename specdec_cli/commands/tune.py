"""`specdec tune`: measure decoding speed by K on this machine, for one model pair and method, and save the best.

Every configuration (plain decoding, each fixed K, and `auto`) generates from the same prompts in one process. The
runs are interleaved so that slow drift (thermal throttling, another process waking up) spreads over all
configurations instead of biasing the ones measured last: for each repeat, for each prompt, every configuration
runs once, in an order rotated by one position from the previous block (`schedule`). One short untimed generation
warms both models up first. Consecutive runs of a prompt reuse its KV cache (the engine keeps the longest common
prefix), so only the first run of each block pays the prefill, and only decoding is timed (`RunStats.tokens_per_s`:
output tokens / wall time of the decode loop).

Per configuration and prompt, tok/s is the median over repeats and the speedup is that median over plain decoding's
on the same prompt; the overall speedup is the geometric mean of the per-prompt speedups (a ratio's natural mean:
2x on one prompt and 0.5x on the other average to 1x). Acceptance rate and mean accepted length pool all runs.

The best setting is the configuration with the highest overall speedup, except that `auto` is preferred when it is
within `AUTO_MARGIN` of it: the adaptive controller also adjusts to prompts the tune did not see. Plain decoding
winning saves K = 0. `--save` writes it to tuned.json (`specdec_cli.tuned`).

Learning drafters (suffix) do not learn during a tune: its prompts repeat, and a store that had learnt the first
run's output would flatter every later run of the same prompt.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from specdec_cli.drafters.base import Draft, Drafter, DrafterBase
from specdec_cli.output import progress as progress_bar, write_json
from specdec_cli.engine import GenerationConfig
from specdec_cli.errors import UsageError
from specdec_cli.prompts import PromptCase
from specdec_cli.render import err_console, make_console
from specdec_cli.session import ModelOptions, SpecOptions, open_session

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
    from specdec_cli.options import k_values

    if spec.strip().lower() == "auto":
        return []
    try:
        return k_values(spec)
    except ValueError as e:
        raise UsageError(str(e), "For example --k 4..16, --k 2,4,8, or --k auto (auto and plain decoding only).") \
            from None


def configs_for(ks: list[int]) -> list[TuneConfig]:
    """Plain decoding, then each fixed K, then auto."""
    return [TuneConfig("none"), *(TuneConfig(str(k)) for k in ks), TuneConfig("auto")]


def schedule(n_configs: int, n_prompts: int, repeats: int) -> list[tuple[int, int, int]]:
    """The run order as (repeat, prompt index, config index).

    For each repeat, for each prompt, every configuration once; each block starts one configuration later than
    the block before, so over n_configs blocks every configuration takes every position once.
    """
    plan = []
    block = 0
    for r in range(repeats):
        for p in range(n_prompts):
            plan.extend((r, p, (block + i) % n_configs) for i in range(n_configs))
            block += 1
    return plan


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

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.n_accepted / self.n_spec_steps if self.n_spec_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "prompt": self.prompt,
            "repeat": self.repeat,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "n_tokens": self.n_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "n_spec_steps": self.n_spec_steps,
            "mean_k": round(self.mean_k, 3),
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "decode_ms": round(self.decode_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "n_prefill_evaluated": self.n_prefill_evaluated,
            "finish_reason": self.finish_reason,
            "verify_ms_by_batch": [[b, round(ms, 3), n] for b, ms, n in verify_curve([self])],
            "draft_ms_per_token": _round(draft_cost([self])),
            "controller": self.controller,
        }


def measure(config: TuneConfig, prompt: str, repeat: int, generation) -> Measurement:
    """A `Measurement` from a `generation.Generation` (its stats and steps)."""
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.label,
            "mode": self.config.mode,
            "k": self.config.k,
            "tokens_per_s": {p: round(v, 3) for p, v in self.tokens_per_s.items()},
            "speedup": {p: round(v, 4) for p, v in self.speedup.items()},
            "speedup_geomean": _round(self.speedup_geomean),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "mean_k": round(self.mean_k, 3),
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "runs": self.runs,
            "n_drafted": self.n_drafted,
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
        speedup = {p: v / plain[p] for p, v in tps.items() if plain[p]}
        drafted = sum(m.n_drafted for m in runs)
        spec_steps = sum(m.n_spec_steps for m in runs)
        accepted = sum(m.n_accepted for m in runs)
        khist: dict[int, int] = {}
        for m in runs:
            for k, n in m.k_histogram.items():
                khist[k] = khist.get(k, 0) + n
        steps = sum(khist.values())
        out.append(ConfigSummary(
            config=c,
            tokens_per_s=tps,
            speedup=speedup,
            speedup_geomean=math.exp(statistics.fmean(map(math.log, speedup.values()))) if speedup else None,
            acceptance_rate=accepted / drafted if drafted else 0.0,
            mean_accepted_length=accepted / spec_steps if spec_steps else 0.0,
            mean_k=sum(k * n for k, n in khist.items()) / steps if steps else 0.0,
            k_histogram=khist,
            runs=len(runs),
            n_drafted=drafted,
        ))
    return out


def choose_best(summaries: list[ConfigSummary], margin: float = AUTO_MARGIN) -> TuneConfig | None:
    """The configuration with the highest overall speedup; auto when it is within `margin` of that. None if no
    configuration has a speedup (plain decoding never finished a run)."""
    scored = [s for s in summaries if s.speedup_geomean is not None]
    if not scored:
        return None
    best = max(scored, key=lambda s: s.speedup_geomean)
    auto = next((s for s in scored if s.config.label == "auto"), None)
    if auto is not None and auto.speedup_geomean >= (1.0 - margin) * best.speedup_geomean:
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


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


# --------------------------------------------------------------------------------------------------------------
# Running it


class _NoLearning(DrafterBase):
    """A drafter whose `finish` teaches nothing (tune's prompts repeat) and whose `close` the tune owns."""

    def __init__(self, inner: Drafter) -> None:
        self._inner = inner
        self.name = inner.name

    def begin(self, context: np.ndarray) -> None:
        self._inner.begin(context)

    def propose(self, context: np.ndarray, k: int, sampling, rng: np.random.Generator) -> Draft:
        return self._inner.propose(context, k, sampling, rng)


@dataclass(frozen=True)
class TuneOptions:
    ks: list[int]
    repeats: int = 1
    json_path: str | None = None
    save: bool = False


def execute(prompts: list[PromptCase], *, models: ModelOptions, spec: SpecOptions, config: GenerationConfig,
            options: TuneOptions) -> int:
    """Measure every configuration on `prompts`, print the report, write --json, --save. Returns the exit code
    (130 when interrupted: the runs so far are reported and written, nothing is saved)."""
    from specdec_cli.generation import generate, make_engine
    from specdec_cli.tuned import machine

    if spec.method == "none":
        raise UsageError("--method none has no K to tune.", "Use --method draft, ngram or suffix.")
    if not prompts:
        raise UsageError("No prompts to tune on.", "Give prompt files or directories, or none for the built-in ones.")
    if len(prompts) != len({p.name for p in prompts}):
        dup = next(p.name for p in prompts if sum(q.name == p.name for q in prompts) > 1)
        raise UsageError(f"Two prompts are named {dup!r}.", "Give prompt files with different names.")
    err = err_console()
    json_to_stdout = options.json_path == "-"
    out = err if json_to_stdout else make_console()
    configs = configs_for(options.ks)
    plan = schedule(len(configs), len(prompts), options.repeats)
    measurements: list[Measurement] = []
    interrupted = False

    with open_session(models, method=spec.method, console=err) as session:
        tokens = [session.prompt_tokens(p.text) for p in prompts]
        inner = session.make_drafter(spec)
        drafter = _NoLearning(inner)
        mach = machine(getattr(session.target, "n_threads", models.threads))

        def engine(c: TuneConfig):  # a fresh controller for every run, the one drafter that does not learn
            return make_engine(session, replace(spec, k="auto" if c.mode != "fixed" else c.label), fresh=True,
                               drafter=drafter if c.mode != "none" else None)

        progress = progress_bar(err)
        try:
            with progress:
                task = progress.add_task("warm-up", total=len(plan))
                warm = GenerationConfig(max_tokens=min(WARMUP_TOKENS, config.max_tokens), sampling=config.sampling)
                interrupted = generate(engine(TuneConfig("4")), tokens[0], warm).interrupted
                for r, p, ci in plan if not interrupted else ():
                    c = configs[ci]
                    progress.update(task, description=f"{c.title:>6} · {prompts[p].name} · repeat {r + 1}")
                    run = engine(c)
                    g = generate(run, tokens[p], config)
                    if g.interrupted:
                        interrupted = True
                        break
                    m = measure(c, prompts[p].name, r, g)
                    if c.mode == "auto":
                        m.controller = run.controller.snapshot()
                    measurements.append(m)
                    progress.advance(task)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            inner.close()

        names = [p.name for p in prompts]
        summaries = summarize(measurements, configs, names)
        best = choose_best(summaries) if not interrupted else None
        curve = verify_curve(measurements)
        d_ms = draft_cost([m for m in measurements if m.config != "none"])
        header = _header(session, spec, prompts, options, config)
        out.print(report(summaries, names, best, curve, d_ms, header=header,
                         partial=f"{len(measurements)} of {len(plan)} runs" if interrupted else None), soft_wrap=False)

        saved = None
        if options.save:
            if best is None:
                err.print(Text("Not saved: the tune did not finish; run it again to save a setting.",
                               style="spec.warn"))
            else:
                from specdec_cli.tuned import save

                win = next(s for s in summaries if s.config == best)
                plain = next(s for s in summaries if s.config.label == "none")
                saved = save(session.target_path, session.draft_path, spec.method, mach, best.saved_k, {
                    "speedup": _round(win.speedup_geomean),
                    "tokens_per_s": _round(statistics.fmean(win.tokens_per_s.values()), 3),
                    "plain_tokens_per_s": _round(statistics.fmean(plain.tokens_per_s.values()), 3),
                    "speedup_by_config": {s.config.label: _round(s.speedup_geomean) for s in summaries},
                    "prompts": names,
                    "max_tokens": config.max_tokens,
                    "repeats": options.repeats,
                })
                err.print(Text.assemble(("saved ", "spec.label"), f"{best.title} for {session.target_path.name}"
                                        + (f" + {session.draft_path.name}" if session.draft_path else "")
                                        + f", --method {spec.method}, {mach['threads']} threads → {saved}"))
                err.print(Text("`specdec run` uses it when --k is not given.", style="spec.label"))
        elif best is not None:
            err.print(Text("Add --save to make `specdec run` use this setting when --k is not given.",
                           style="spec.label"))

        if options.json_path:
            doc = {
                "version": JSON_VERSION,
                "target": str(session.target_path),
                "draft": str(session.draft_path) if session.draft_path else None,
                "method": spec.method,
                "k_values": options.ks,
                "configs": [c.label for c in configs],
                "repeats": options.repeats,
                "max_tokens": config.max_tokens,
                "sampling": {"temperature": config.sampling.temperature, "seed": config.sampling.seed},
                "prompts": [{"name": p.name, "kind": p.kind, "n_tokens": int(len(t))} for p, t in zip(prompts, tokens)],
                "machine": mach,
                "interrupted": interrupted,
                "runs": [m.to_dict() for m in measurements],
                "summary": [s.to_dict() for s in summaries],
                "best": best.label if best else None,
                "verify_ms_by_batch": [[b, round(ms, 3), n] for b, ms, n in curve],
                "draft_ms_per_token": _round(d_ms),
                "saved": str(saved) if saved else None,
            }
            write_json(options.json_path, doc)
    return 130 if interrupted else 0






# --------------------------------------------------------------------------------------------------------------
# The report


def _header(session, spec: SpecOptions, prompts: list[PromptCase], options: TuneOptions,
            config: GenerationConfig) -> str:
    pair = session.target_path.name + (f" + {session.draft_path.name}" if session.draft_path else "")
    return (f"specdec tune: {pair}, --method {spec.method}, {len(prompts)} prompt{'s' * (len(prompts) != 1)} × "
            f"{options.repeats} repeat{'s' * (options.repeats != 1)}, {config.max_tokens} max tokens")


def report(summaries: list[ConfigSummary], prompts: list[str], best: TuneConfig | None,
           curve: list[tuple[int, float, int]], draft_ms: float | None, *, header: str = "",
           partial: str | None = None) -> Group:
    """The results table, the speedup chart, the verify-cost curve and the verdict, as one Rich renderable."""
    parts: list[Any] = [Text(header, style="bold")] if header else []
    parts += [results_table(summaries, prompts, best),
              Text("per prompt: tok/s (median of repeats) and speedup over plain decoding on that prompt; "
                   "overall: geometric mean of the speedups", style="spec.label")]
    auto = next((s for s in summaries if s.config.label == "auto" and s.k_histogram), None)
    if auto is not None:
        hist = "  ".join(f"K={k}:{n}" for k, n in sorted(auto.k_histogram.items()))
        parts.append(Text(f"auto chose K = {auto.mean_k:.1f} on average (steps by K: {hist})", style="spec.label"))
    parts += [Text(""), speedup_chart(summaries, best), Text(""),
              Text("target forward pass by batch size (median over the tune's steps)", style="bold"),
              cost_table(curve),
              Text("drafting: " + (f"{draft_ms:.2f} ms per drafted token (median over steps)" if draft_ms is not None
                                   else "nothing was drafted"), style="spec.label")]
    if partial:
        parts.append(Text(f"Interrupted after {partial}: the numbers above cover only those.", style="spec.warn"))
    elif best is not None:
        win = next(s for s in summaries if s.config == best)
        line = Text.assemble(("best ", "spec.label"), (best.title, "bold"),
                             f": {win.speedup_geomean:.2f}× plain decoding (geometric mean over prompts)")
        top = max((s for s in summaries if s.speedup_geomean is not None), key=lambda s: s.speedup_geomean)
        if best.label == "auto" and top.config != best:
            line.append(f"; {top.config.title} measured {top.speedup_geomean:.2f}×, within "
                        f"{AUTO_MARGIN:.0%}, and auto also adapts to other prompts", style="spec.label")
        parts.append(line)
    return Group(*parts)


def results_table(summaries: list[ConfigSummary], prompts: list[str], best: TuneConfig | None) -> Table:
    """One row per configuration: per prompt tok/s and speedup, then the pooled figures."""
    table = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("config", no_wrap=True)
    for p in prompts:
        table.add_column(p, justify="right", overflow="fold", min_width=12)
    table.add_column("overall", justify="right", no_wrap=True)
    table.add_column("accept", justify="right", no_wrap=True)
    table.add_column("mean\nacc. len", justify="right", no_wrap=True)
    for s in summaries:
        spec = s.n_drafted > 0  # acceptance means nothing without drafts
        cells: list[Any] = [Text(s.config.title, style="bold" if s.config == best else "")]
        for p in prompts:
            tps = s.tokens_per_s.get(p)
            cell = Text("–" if tps is None else f"{tps:.1f}")
            if s.config.label != "none" and p in s.speedup:
                cell.append(f" {s.speedup[p]:.2f}×", style=_speed_style(s.speedup[p], s.config))
            cells.append(cell)
        g = s.speedup_geomean
        cells.append(Text("–") if g is None else Text(f"{g:.2f}×", style=_speed_style(g, s.config)))
        cells.append(f"{s.acceptance_rate:.0%}" if spec else ("" if s.config.label == "none" else "–"))
        cells.append(f"{s.mean_accepted_length:.2f}" if spec else ("" if s.config.label == "none" else "–"))
        table.add_row(*cells)
    return table


def _speed_style(g: float, c: TuneConfig) -> str:
    if c.label == "none":
        return "spec.label"
    return "spec.good" if g >= 1.0 else "spec.bad"


def speedup_chart(summaries: list[ConfigSummary], best: TuneConfig | None, width: int = 40) -> Table:
    """Horizontal bars of the overall speedup by configuration; a dim │ marks 1× (plain decoding)."""
    scored = [s for s in summaries if s.speedup_geomean is not None]
    chart = Table.grid(padding=(0, 1))
    chart.add_column(justify="right", style="spec.label", no_wrap=True)
    chart.add_column(no_wrap=True)
    chart.add_column(justify="right", no_wrap=True)
    chart.add_row("", Text("speedup over plain decoding", style="bold"), "")
    if not scored:
        chart.add_row("", Text("(no complete measurement)", style="spec.label"), "")
        return chart
    scale = max(1.0, *(s.speedup_geomean for s in scored))
    one = max(0, round(width / scale) - 1)
    for s in scored:
        n = round(width * s.speedup_geomean / scale)
        bar = Text()
        style = "spec.label" if s.config.label == "none" else _speed_style(s.speedup_geomean, s.config)
        bar.append("█" * n, style=style)
        if n <= one:
            bar.append(" " * (one - n) + "│", style="spec.label")
        bar.append(" " * (width - len(bar)))
        chart.add_row(s.config.title, bar, Text(f"{s.speedup_geomean:.2f}×", style="bold" if s.config == best else ""))
    return chart


def cost_table(curve: list[tuple[int, float, int]]) -> Table:
    """The measured verify-cost curve: (batch size, median ms, passes) as ms, ms per token and ratio to batch 1."""
    t = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("batch", justify="right")
    t.add_column("ms", justify="right")
    t.add_column("ms / token", justify="right")
    t.add_column("× batch 1", justify="right")
    t.add_column("passes", justify="right")
    v1 = curve[0][1] if curve and curve[0][0] == 1 else None
    for b, ms, n in curve:
        t.add_row(str(b), f"{ms:.1f}", f"{ms / b:.1f}", f"{ms / v1:.2f}" if v1 else "", str(n))
    return t
