"""Statistics computed from the engine's records, the same records the renderer shows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from specdec_cli.core.records import Finish, FinishReason, Prefill, Record, Source, Step
from specdec_cli.models.energy import Energy, unavailable_dict


@dataclass(frozen=True)
class RunStats:
    """Summary of one generation.

    Attributes:
        n_prompt: prompt tokens. n_prefill_evaluated: prompt tokens the target evaluated (the rest came from cache).
        prefill_ms: target prefill time (ms). draft_prefill_ms: the draft model's prefill time (ms).
        n_generated: output tokens. decode_ms: time in the decode loop (ms): drafting + verifying + bookkeeping.
        tokens_per_s: n_generated / decode time (tok/s).
        n_target_passes: target forward passes in the decode loop (one per step).
        n_drafted / n_accepted: draft tokens proposed / accepted by verification.
        acceptance_rate: n_accepted / n_drafted (0 when nothing was drafted).
        mean_accepted_length: accepted draft tokens per speculative step (steps with a non-empty draft).
        tokens_per_pass: output tokens per target forward pass (1.0 = plain decoding).
        acceptance_by_position: for draft position i (1-based), [proposed, accepted]: how often a draft reached
            position i and how often the token there was accepted.
        k_histogram: how often each K was chosen. mean_k: its mean.
        draft_ms / verify_ms: total drafting / verifying time (ms).
        finish_reason: why generation ended. stop: the stop string that ended it (finish_reason "stop"), else None.
        n_restored / restore_ms: prompt tokens restored from the prompt cache, and the time it took (ms).
        by_source: per draft `Source` ("prompt", "store", "predict", "draft"), {"steps", "drafted",
            "accepted"}: where the accepted tokens came from.
        accepted_prediction_tokens / rejected_prediction_tokens: OpenAI's predicted-outputs counts: prediction
            tokens the target accepted / that were drafted from the prediction and rejected.
        ms_per_pass: verify_ms / n_target_passes (ms). mean_batch: tokens per target pass evaluated (the pending
            token, the draft, a second branch's own tokens). batch_histogram: passes by batch size b.
        curve_passes / cheap_passes: passes placed on a measured verify curve, and those at a cheap size of it (no
            larger pass costs less: `core.verify_curve.VerifyCurve.cheap`). curve_ms: the sum of the curve's cost of
            every pass at its depth of context (ms, `VerifyCurve.predict`), against verify_ms measured; curve_depth:
            the mean context of those passes (tokens).
        branch_passes / branch_won: passes that verified a second candidate branch, and those whose output
            followed it.
        energy: the joules the host's counters counted (`models.energy.Energy`: prefill and decoding apart), or None;
            energy_note: why it is None (no counter and why, a read error), else None. Nothing is estimated.
    """

    n_prompt: int = 0
    n_prefill_evaluated: int = 0
    prefill_ms: float = 0.0
    draft_prefill_ms: float = 0.0
    n_generated: int = 0
    decode_ms: float = 0.0
    tokens_per_s: float = 0.0
    n_target_passes: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    tokens_per_pass: float = 0.0
    acceptance_by_position: list[list[int]] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)
    mean_k: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    finish_reason: FinishReason | None = None
    stop: str | None = None
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    n_restored: int = 0
    restore_ms: float = 0.0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    ms_per_pass: float = 0.0
    mean_batch: float = 0.0
    batch_histogram: dict[int, int] = field(default_factory=dict)
    curve_passes: int = 0
    cheap_passes: int = 0
    curve_ms: float = 0.0
    curve_depth: int = 0
    branch_passes: int = 0
    branch_won: int = 0
    energy: Energy | None = None
    energy_note: str | None = None

    @property
    def j_per_token(self) -> float | None:
        """Decoding's joules per output token (J; prefill apart), None without a counter or tokens."""
        return self.energy.per_token(self.n_generated) if self.energy is not None else None

    @property
    def n_cached(self) -> int:
        """Prompt tokens the target did not evaluate: its KV cache or the prompt cache held them. The prefill brings
        the cache to prompt[:-1]; the last prompt token is evaluated with the first step, so at most n_prompt - 1."""
        return max(self.n_prompt - 1 - self.n_prefill_evaluated, 0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["k_histogram"] = {str(k): v for k, v in sorted(self.k_histogram.items())}
        d["batch_histogram"] = {str(b): v for b, v in sorted(self.batch_histogram.items())}
        d["energy"] = (
            self.energy.to_dict(self.n_generated) if self.energy is not None else unavailable_dict(self.energy_note)
        )
        del d["energy_note"]
        return d


def summarize(
    records: Iterable[Record],
    *,
    decode_ms: float | None = None,
    finish_reason: FinishReason | None = None,
    energy: Energy | None = None,
    energy_note: str | None = "energy not measured",
) -> RunStats:
    """Aggregate records into `RunStats`.

    Args:
        decode_ms: wall time of the decode loop if the caller measured it (ms); default: the sum of the steps'
            draft + verify time.
        finish_reason: overrides the `Finish` record's (e.g. "interrupted").
        energy / energy_note: what the driver's `models.energy.Gauge` read, or why nothing (kept as given).
    """
    prefill = None
    steps: list[Step] = []
    finish = stop = None
    for r in records:
        if isinstance(r, Step):
            steps.append(r)
        elif isinstance(r, Prefill):
            prefill = r
        elif isinstance(r, Finish):
            finish, stop = r.finish_reason, r.stop
    n_gen = sum(len(s.emitted) for s in steps)
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(s.n_accepted for s in steps)
    spec_steps = [s for s in steps if s.drafted]
    max_len = max((len(s.drafted) for s in steps), default=0)
    by_pos = [[0, 0] for _ in range(max_len)]
    for s in steps:
        for i in range(len(s.drafted)):
            if i > s.n_accepted:
                break  # positions after the first rejection were never verified on their own
            by_pos[i][0] += 1
            by_pos[i][1] += i < s.n_accepted
    draft_ms = sum(s.draft_ms for s in steps)
    verify_ms = sum(s.verify_ms for s in steps)
    loop_ms = decode_ms if decode_ms is not None else draft_ms + verify_ms
    passes = len(steps)  # one target forward pass each
    khist = Counter(s.k for s in steps)
    by_source: dict[str, dict[str, int]] = {}
    for s in spec_steps:
        src = by_source.setdefault(s.source or "?", {"steps": 0, "drafted": 0, "accepted": 0})
        src["steps"] += 1
        src["drafted"] += len(s.drafted)
        src["accepted"] += s.n_accepted
    predicted = by_source.get(Source.predict, {"drafted": 0, "accepted": 0})
    on_curve = [s for s in steps if s.curve_ms > 0.0]
    batches = Counter(s.batch_size for s in steps)
    return RunStats(
        n_prompt=prefill.n_prompt if prefill else 0,
        n_prefill_evaluated=prefill.n_evaluated if prefill else 0,
        prefill_ms=prefill.ms if prefill else 0.0,
        draft_prefill_ms=prefill.draft_ms if prefill else 0.0,
        n_generated=n_gen,
        decode_ms=loop_ms,
        tokens_per_s=n_gen / (loop_ms / 1e3) if loop_ms > 0 else 0.0,
        n_target_passes=passes,
        n_drafted=drafted,
        n_accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=sum(s.n_accepted for s in spec_steps) / len(spec_steps) if spec_steps else 0.0,
        tokens_per_pass=n_gen / passes if passes else 0.0,
        acceptance_by_position=by_pos,
        k_histogram=dict(khist),
        mean_k=sum(k * c for k, c in khist.items()) / sum(khist.values()) if khist else 0.0,
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        finish_reason=finish_reason or finish,
        stop=None if finish_reason else stop,
        by_source=by_source,
        n_restored=prefill.n_restored if prefill else 0,
        restore_ms=prefill.restore_ms if prefill else 0.0,
        accepted_prediction_tokens=predicted["accepted"],
        rejected_prediction_tokens=predicted["drafted"] - predicted["accepted"],
        ms_per_pass=verify_ms / passes if passes else 0.0,
        mean_batch=sum(b * c for b, c in batches.items()) / passes if passes else 0.0,
        batch_histogram=dict(batches),
        curve_passes=len(on_curve),
        cheap_passes=sum(1 for s in on_curve if s.cheap),
        curve_ms=sum(s.curve_ms for s in on_curve),
        curve_depth=round(sum(s.n_past for s in on_curve) / len(on_curve)) if on_curve else 0,
        branch_passes=sum(1 for s in steps if s.branch),
        branch_won=sum(1 for s in steps if s.branch_won),
        energy=energy,
        energy_note=None if energy is not None else energy_note,
    )
