"""The one place that drives a generation: every consumer (run, chat, check, tune, bench, serve) goes through here.

`stream` checks the prompt and hands back a `Drive`: iterating it yields the engine's records as they come (one
`Prefill`, a `Step` per target pass, one `Finish`), while the `Drive` times them, keeps them for its `RunStats`, and,
once a generation has finished, saves the target's KV state to the prompt cache, outside the timing. Energy is
read beside the timing (`models.energy.Gauge`: the counters at the start, at the prefill's record and at the end, no
reading per target pass), so every consumer's `RunStats` carries joules or why there are none. Every pass is also
shown to the engine's `watch` where the `Assembler` gave it one (`verify_curve.CurveWatch`: has the machine drifted
from the measured verify curve?; a pass shared with other sequences is not this machine's single-sequence cost and is
not shown). A consumer that stops early (`close`, Ctrl-C, a client gone) leaves the target's cache holding only
committed tokens and saves nothing. `generate` is the common consumer: the whole generation, each `Step` handed to a
callback.

Shaped after mlx-lm's `stream_generate`, which its `generate` and its server both consume.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.engine import Rows
from specdec_cli.core.records import Finish, FinishReason, Prefill, Record, Step
from specdec_cli.core.stats import RunStats, summarize
from specdec_cli.errors import ContextOverflowError, UsageError
from specdec_cli.models.energy import Gauge, Meter, default_meter

if TYPE_CHECKING:
    from specdec_cli.core.engine import GenerationConfig, SpeculativeEngine


@dataclass
class Result:
    """What one generation produced: its records' summary, text and tokens.

    Attributes:
        text: the output text. tokens: the output token ids. steps: the `Step` records, in order.
        stats: the `RunStats` of its records. interrupted: stopped before it finished (Ctrl-C, `Drive.close`).
    """

    text: str
    tokens: list[int]
    stats: RunStats
    steps: list[Step]
    interrupted: bool = False


class Drive:
    """One generation being driven: iterate it (once) for the engine's records. Use `stream` to make one.

    Attributes:
        records: every record so far, in order.
        finish_reason: the `Finish` record's reason, None until it came (or when stopped early).
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        prompt: np.ndarray,
        config: GenerationConfig,
        meter: Meter | None = None,
        rows: bool = False,
    ) -> None:
        self.engine, self.prompt, self.config = engine, prompt, config
        self.rows = rows  # hand each pass out (`engine.Rows`, answered by `send`) instead of running it here
        self.meter = meter if meter is not None else default_meter()
        self.gauge: Gauge | None = None  # the generation's energy (started with the timing)
        self.records: list[Record] = []
        self.finish_reason: FinishReason | None = None
        self._t0: float | None = None  # perf_counter s: the start (before the prefill)
        self._t_prefill: float | None = None  # when the prefill's record came
        self._t_last: float | None = None  # when the last record came
        self._gen: Generator | None = None
        self._closed = False

    def __iter__(self) -> Generator:
        if self._gen is None:
            self._gen = self._records()
        return self._gen

    def _records(self) -> Generator:
        if self._closed:
            return
        engine = self.engine
        watch = getattr(engine, "watch", None)  # the Assembler's `CurveWatch`: every pass timed against the curve
        gen: Generator[Any, Any, None] = (
            engine.steps(self.prompt, self.config) if self.rows else engine.generate(self.prompt, self.config)
        )
        gauge = self.gauge = Gauge(self.meter)
        self._t0 = time.perf_counter()
        answer = None
        try:
            while True:
                try:
                    record = gen.send(answer)
                except StopIteration:
                    break
                if self.rows and isinstance(record, Rows):
                    answer = yield record  # the scheduler's pass answers it
                    continue
                answer = None
                self._t_last = time.perf_counter()
                self.records.append(record)
                if watch is not None and isinstance(record, Step) and not record.shared_rows:
                    watch.observe(record.batch_size, record.verify_ms, record.n_past)
                if isinstance(record, Prefill):
                    self._t_prefill = self._t_last
                    gauge.prefill_done()
                elif isinstance(record, Finish):
                    self.finish_reason = record.finish_reason
                    gauge.end()
                else:
                    gauge.tick(self._t_last)  # reads the counters only when one could otherwise wrap twice
                yield record
        finally:
            gen.close()  # the engine's finally: the KV cache keeps only committed tokens
            gauge.end()  # stopped early: up to now
            self._closed = True
            if self.finish_reason is not None:
                engine.save_prompt()  # for a later run that starts with the same tokens (not timed)

    def close(self) -> None:
        """Stop here (idempotent): the engine's cache keeps the committed tokens; an unfinished generation is not
        saved to the prompt cache, a finished one is (if the consumer stopped right after its `Finish`)."""
        if self._gen is not None:
            self._gen.close()
        self._closed = True

    @property
    def interrupted(self) -> bool:
        """Stopped before the engine's `Finish` (Ctrl-C, `close`, a client gone)."""
        return self._closed and self.finish_reason is None

    @property
    def decode_ms(self) -> float:
        """Wall time from the prefill's end to the last record (ms); 0 before the first step."""
        if self._t_prefill is None or self._t_last is None or not any(isinstance(r, Step) for r in self.records):
            return 0.0
        return (self._t_last - self._t_prefill) * 1e3

    @property
    def wall_ms(self) -> float:
        """Wall time from the start of the prefill to the last record (ms)."""
        return (self._t_last - self._t0) * 1e3 if self._t0 is not None and self._t_last is not None else 0.0

    @property
    def stats(self) -> RunStats:
        """The `RunStats` of the records so far (finish reason "interrupted" when stopped before the end)."""
        gauge = self.gauge
        return summarize(
            self.records,
            decode_ms=self.decode_ms,
            finish_reason=FinishReason.interrupted if self.interrupted else None,
            energy=gauge.energy if gauge is not None else None,
            energy_note=gauge.note if gauge is not None else "energy not measured: not started",
        )

    def result(self) -> Result:
        """The `Result` of the records so far."""
        steps = [r for r in self.records if isinstance(r, Step)]
        return Result(
            text="".join(s.text for s in steps),
            tokens=[t for s in steps for t in s.emitted],
            stats=self.stats,
            steps=steps,
            interrupted=self.interrupted,
        )


def stream(
    engine: SpeculativeEngine,
    prompt: Sequence[int] | np.ndarray,
    config: GenerationConfig,
    meter: Meter | None = None,
    *,
    rows: bool = False,
) -> Drive:
    """Drive `engine` over `prompt` (int [n], n >= 1): the `Drive` to iterate for its records. `meter`: the energy
    counters to read (default: `models.energy.default_meter()`, this host's). `rows`: the records come with each
    pass's `engine.Rows`, which the consumer answers with `send(logits)` (the server's scheduler); else the passes run
    on the engine's target.

    Raises (at once, before anything is evaluated):
        UsageError: the prompt is empty.
        ContextOverflowError: the prompt does not fit in the target's context window (the message says the --ctx
            that would hold it and `config.max_tokens`).
    The records' own errors (DecodeError, CacheTrimError) come from the iteration.
    """
    prompt = np.asarray(prompt, dtype=np.int32)
    n, n_ctx = len(prompt), engine.target.n_ctx
    if n == 0:
        raise UsageError("The prompt is empty.", "Give a prompt with some text.")
    if n >= n_ctx:
        raise ContextOverflowError(
            f"The prompt is {n} tokens but the context window is {n_ctx} tokens.",
            f"Use --ctx {_round_up(n + config.max_tokens)} or a shorter prompt.",
        )
    return Drive(engine, prompt, config, meter, rows)


def generate(
    engine: SpeculativeEngine,
    prompt: Sequence[int] | np.ndarray,
    config: GenerationConfig,
    on_step: Callable[[Step], None] | None = None,
) -> Result:
    """The whole generation of `prompt` (int [n]), calling `on_step` with each `Step` as it arrives.

    Ctrl-C ends the generation with what was produced kept (`Result.interrupted`, finish reason
    "interrupted"). Raises what `stream` raises.
    """
    drive = stream(engine, prompt, config)
    try:
        for record in drive:
            if on_step is not None and isinstance(record, Step):
                on_step(record)
    except KeyboardInterrupt:
        pass
    finally:
        drive.close()
    return drive.result()


def _round_up(n: int) -> int:
    size = 512
    while size < n:
        size *= 2
    return size
