"""The speculative decoding loop: draft → verify → accept → roll back → adapt.

One step (one target forward pass):
    1. the controller picks K (0 = a plain decoding step);
    2. the drafter proposes up to K tokens after the committed context (a lookup draft is then trimmed by the
       controller, from the length of its match);
    3. the target evaluates [last committed token, d_1..d_k] in one batch, logits for those k+1 rows only;
    4. verification keeps the longest acceptable prefix d_1..d_n and adds one token of the target's own
       (the correction at the first rejection, or the bonus token after all k);
    5. the target's KV cache is cut back to the committed tokens (`llama_memory_seq_rm`);
    6. the controller observes the step's costs and acceptance.

Invariant between steps: the target's KV cache holds context[:n-1]; context[n-1], the newest committed token, is
evaluated at the start of the next step together with the draft. The engine yields frozen records and never prints.

References: Leviathan et al. 2023 (Algorithm 1); Chen et al. 2023; gpt-fast `speculative_decode`;
mlx-lm `speculative_generate_step`; two branches: SpecInfer (Miao et al. 2024), llama.cpp examples/speculative.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec_cli.core.constraint import start as start_constraint
from specdec_cli.core.controller import FixedK, KController
from specdec_cli.core.detok import TextStream, piece_text
from specdec_cli.core.draft import Draft, Drafter, cut
from specdec_cli.core.records import (
    ACCEPTED,
    REJECTED,
    TARGET,
    Finish,
    FinishReason,
    Prefill,
    Record,
    Source,
    Step,
    TokenLogprob,
)
from specdec_cli.core.sampling import GREEDY, SamplingParams, make_rng, token_logprob, verify, verify_branches
from specdec_cli.models.backend import Backend, branch_rows, common_prefix

if TYPE_CHECKING:
    from specdec_cli.core.constraint import Constraint, Grammar
    from specdec_cli.core.kv_states import StateCache, StateParking
    from specdec_cli.core.verify_curve import VerifyCurve

NO_DRAFT = Draft()
GRAMMAR = Source.grammar  # the source of a draft of the tokens a grammar forces


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """What to generate.

    Attributes:
        max_tokens: stop after this many output tokens.
        stop: stop strings; the output ends before the first one (it is not included).
        sampling: temperature 0 = greedy; otherwise the target's distribution is kept: with a seed, by sampling
            each position from keyed noise (the output is plain decoding's with that seed), else by rejection
            sampling (`core.sampling`).
        prediction: the output the user expects (predicted outputs: `--predict FILE`, OpenAI's `prediction`), as
            target tokens; drafted from when the drafter has a prediction source, never evaluated. None = none.
        grammar: constrain the output to this grammar or JSON schema (`constraint.Grammar`); None = free text.
        logprobs: None = off; 0 = each emitted token's log-probability (`Step.logprobs`); 1..20 = also its top-n
            alternatives. Read from the verify rows already computed.
        interrupt: called between the prefill's chunks (`backend.sync`); raises to stop the prefill (the server's
            client gone, deadline, shutdown). None: the prompt is evaluated in one call.
        line_time_ms: once the generation has run this many ms (from the end of the prefill, by the engine's clock),
            the output ends after the next token holding a newline (finish `length`): llama-server's
            `t_max_predict_ms` (tools/server/server-context.cpp `process_token`), which llama.vim sends so a slow
            completion still ends on a whole line. None: no time limit.
    """

    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=lambda: GREEDY)
    prediction: tuple[int, ...] | None = None
    grammar: Grammar | None = None
    logprobs: int | None = None
    interrupt: Callable[[], None] | None = None
    line_time_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Rows:
    """One sequence's rows for the target's next pass, which `SpeculativeEngine.steps` yields and is answered with
    their logits: a prefill (`n_logits` 0: the answer is None, or how many of its first rows the server's scheduler
    copied from another sequence's cells, `LlamaBackend.copy_prefix`) or a verify batch (logits of its last `n_logits`
    rows, float32 [n_logits, V]; with `branch`, `Backend.decode_branches`' rows instead). A verify batch with
    `expected` may be answered with the logits of its first rows only: its draft is then cut there.

    Attributes:
        tokens: int32 [m] appended to the sequence's KV cache. n_logits: rows at the end that want logits.
        branch: int32 a second branch's tokens (`Backend.decode_branches`), or None.
        expected: float64 [m] E[tokens] when only a verify batch's first j + 1 rows are evaluated
            (`KController.expected`; the server's `cost_model.meet` reads it), or None: evaluate every row.
    """

    tokens: np.ndarray
    n_logits: int = 0
    branch: np.ndarray | None = None
    expected: np.ndarray | None = None

    def evaluate(self, target: Backend, interrupt: Callable[[], None] | None = None) -> np.ndarray | None:
        """Run these rows on `target` alone (the one-sequence case, `SpeculativeEngine.generate`): a prefill in
        chunks of `n_batch` with `interrupt` called before each after the first (it raises to stop; the chunks
        evaluated stay cached), as `models.backend.sync` does."""
        if self.branch is not None:
            return target.decode_branches(self.tokens, self.branch)
        if self.n_logits:
            return target.decode(self.tokens, n_logits=self.n_logits)
        chunk = target.n_batch if interrupt is not None else max(1, len(self.tokens))
        for c0 in range(0, len(self.tokens), chunk):
            if interrupt is not None and c0:
                interrupt()
            target.decode(self.tokens[c0 : c0 + chunk], n_logits=0)
        return None


Steps = Generator["Record | Rows", "np.ndarray | int | None", None]  # `SpeculativeEngine.steps`


class SpeculativeEngine:
    """Generates with a target model, a drafter and a K controller.

    Args:
        target: the model whose output distribution is preserved.
        drafter: proposes draft tokens; None = plain decoding (K = 0 every step, no controller consulted) through
            the same loop.
        controller: chooses K and the draft's source each step (`FixedK`, `AdaptiveK`); default `FixedK(4)`. The
            engine drafts with a sequence of it (`KController.sequence`): engines that share a controller (a
            server's lanes) share what it learns across replies, each with per-reply state of its own.
        prompt_cache: KV states saved across runs (`prompt_cache.PromptCache`): the prefill first restores the longest
            saved prefix of the prompt, and `save_prompt` saves what a generation evaluated. None = off.
        parking: KV states kept in memory (`kv_parking.KvParking`, the server's): before the prefill, the KV cache
            is parked when a prompt would cut much of it, and a parked state that shares more with the prompt is
            swapped back in (a conversation's next turn after a side request). None = off.
        clock: seconds, monotonic (`time.perf_counter`); the step records' times come from it.
        curve: the target's measured verify curve (`core.verify_timing.measure`), which each `Step` is placed on
            (`Step.curve_ms`, `Step.cheap`); None: not measured.

    Attributes:
        passes: what the target's passes allow, where others share them (the server's `lanes.Slot`): `draft_limit`
            (the most draft tokens), `branches` (a second branch may be offered) and `shared_rows` (other sequences'
            rows in the last pass); None: the target's own (one sequence alone).
    """

    watch: Any = None  # the assembler's `CurveWatch`, which `driver.Drive` shows every pass to; None: none

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None = None,
        controller: KController | None = None,
        *,
        prompt_cache: StateCache | None = None,
        parking: StateParking | None = None,
        clock: Callable[[], float] = time.perf_counter,
        curve: VerifyCurve | None = None,
    ) -> None:
        self.clock = clock  # seconds; tests drive the controller deterministically with a virtual clock
        self.curve = curve
        self.prompt_cache = prompt_cache
        self.parking = parking
        self.target = target
        self.drafter = drafter
        self.controller = controller if controller is not None else FixedK(4)
        self._sequence: tuple[KController, KController] | None = None  # (controller, this engine's sequence of it)
        self._prompt: np.ndarray | None = None  # the last reply's prompt (`_continues`)
        self.passes: Any = None

    @property
    def sequence(self) -> KController:
        """This engine's sequence of its controller (`KController.sequence`): its per-reply state, kept across the
        engine's generations while each continues the last (`_continues`: a chat's turns, an editor's completions),
        its learning shared with every engine of the same controller."""
        if self._sequence is None or self._sequence[0] is not self.controller:
            self._sequence = (self.controller, self.controller.sequence())
        return self._sequence[1]

    def _continues(self, prompt: np.ndarray) -> None:
        """Start a fresh sequence of the controller unless `prompt` (int32 [n]) shares at least half of the last
        reply's prompt: another conversation on the same engine (a server lane's next request) begins with the
        per-reply state a new lane has, not with the probe schedules and windows the last one's drafts left."""
        last, self._prompt = self._prompt, prompt.copy()
        if last is not None and 2 * common_prefix(last, prompt) < len(last) and self._sequence is not None:
            self._sequence[1].end_reply()  # (a reply abandoned without its end hands back what it learnt first)
            self._sequence = None

    def generate(
        self, prompt: Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig()
    ) -> Generator[Record, None, None]:
        """Yield one `Prefill`, then one `Step` per target forward pass, then one `Finish`: `steps` with every pass
        run on the target alone (the one-sequence case; the server's `server.lanes.Scheduler` runs many at once).

        Args:
            prompt: int [n] prompt tokens, 1 <= n < n_ctx (checked by `driver.stream`, the only caller).

        Raises:
            DecodeError / CacheTrimError: llama.cpp failed.
        The target's KV cache is left holding only committed tokens, also when the consumer stops early (Ctrl-C,
        `close()`), so the next call can reuse it.
        """
        steps = self.steps(prompt, config)
        try:
            answer = None
            while True:
                try:
                    item = steps.send(answer)
                except StopIteration:
                    return
                if isinstance(item, Rows):
                    answer = item.evaluate(self.target, config.interrupt)
                else:
                    answer = None
                    yield item
        finally:
            steps.close()  # its finally: the KV cache keeps only committed tokens

    def steps(self, prompt: Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig()) -> Steps:
        """`generate`'s records, with each pass of the target handed out as `Rows` to be answered (`send`) with
        their logits: whoever drives it decides when and beside what the rows run. Everything else (the drafter,
        rollbacks, the prompt cache, parking) it does itself on the target, so drive it on the thread that owns the
        target. Same arguments, errors and cache guarantee as `generate`."""
        target, drafter = self.target, self.drafter
        prompt = np.asarray(prompt, dtype=np.int32)
        n = len(prompt)
        assert 0 < n < target.n_ctx, "driver.stream checks the prompt"
        self._continues(prompt)
        sampling = config.sampling
        rng = make_rng(sampling.seed)
        # the grammar's state (None without one: then nothing below costs anything)
        grammar = start_constraint(config.grammar, target.lltokenizer, target.n_vocab)
        # ctx: int32 [n_ctx] committed tokens (prompt + output); ctx[:n] is live
        ctx = np.zeros(target.n_ctx, dtype=np.int32)
        ctx[:n] = prompt
        text = TextStream(target.piece, config.stop)
        n_out = 0
        try:
            yield (yield from self._prefill(prompt, config.prediction))
            # past this clock time, a newline ends the output (llama-server's t_max_predict_ms); inf: never
            t_lines = self.clock() + config.line_time_ms / 1e3 if config.line_time_ms is not None else math.inf
            for index in itertools.count():
                if len(target.tokens) < n - 1:  # a recurrent state cleared by a rollback it could not do exactly
                    yield from self._sync(ctx[: n - 1])  # (never a longer cache: that is a rollback bug, for `check`)
                t_start = self.clock()
                # 1-2. choose K and draft (cut at the first token the grammar forbids); maybe a second branch `alt`
                k, draft, alt = self._choose_and_draft(ctx[:n], config.max_tokens - n_out, sampling, rng, grammar)
                d = draft.tokens  # int32 [k']
                t_draft = self.clock()
                # 3. verify: one forward pass over [last committed, d_1..d_k] (and alt's tokens), logits for every row
                batch = np.concatenate((ctx[n - 1 : n], d))
                if alt is None:
                    # (beside other sequences, what a shorter pass would yield: the server may cut it to meet theirs)
                    expected = self.sequence.expected(draft) if self.passes is not None and len(d) else None
                    logits = yield Rows(batch, len(batch), expected=expected)  # float32 [k + 1, V] view
                else:
                    logits = yield Rows(batch, len(batch), alt.tokens)  # float32 [k + 1 + alt's own tokens, V]
                t_verify = self.clock()
                assert isinstance(logits, np.ndarray)  # a verify pass is answered with its rows' logits
                if len(logits) < len(batch):  # its first rows only (`Rows.expected`): the draft is cut there
                    draft = cut(draft, len(logits) - 1)
                    d = draft.tokens
                # 4. accept, under the grammar's mask of each row when there is one: masks int32 [k + 1, V/32]
                masks = grammar.masks(d) if grammar is not None else None
                won = 0  # the branch the target followed further: 1 = alt, which then becomes the draft
                if alt is None:
                    n_acc, token = verify(draft, logits, sampling, rng, masks, position=n)
                else:
                    rows = branch_rows(d, alt.tokens)  # int64 [k + 1], [len(alt) + 1]: each branch's rows
                    won, n_acc, token = verify_branches((d, alt.tokens), logits, rows, sampling, rng, position=n)
                    logits = logits[rows[won]] if config.logprobs is not None else logits  # the followed rows
                    draft, alt = (draft, alt) if won == 0 else (alt, draft)
                    d = draft.tokens
                # 5. roll back the rejected drafts and the other branch: keep context + accepted drafts (token pending)
                #    (a recurrent state: by a snapshot, or by a checkpoint and a replay, timed as `rollback_ms`)
                t_roll = self.clock()
                if won:  # the second branch's accepted tokens replace the draft's in the cache
                    target.truncate(n + n_acc, branch=True)
                else:
                    target.truncate(n + n_acc)
                rollback_ms = (self.clock() - t_roll) * 1e3
                if grammar is not None:
                    grammar.commit(n_acc, token)
                # commit: the accepted drafts, then the target's token, cut at an end, a stop string or the budget
                new = [*map(int, d[:n_acc]), token]
                n_past = n - 1  # the cache held context[:n - 1] when the pass ran
                emitted, segments, finish = self._emit(
                    new, n_acc, d, text, config.max_tokens - n_out, t_verify > t_lines
                )
                ctx[n : n + len(new)] = new
                n += len(new)
                n_out += len(emitted)
                if finish is None and grammar is not None and grammar.done:  # complete: nothing more allowed
                    finish = FinishReason.eog
                    segments.extend(text.flush())
                if finish is None and n >= target.n_ctx:  # no room for the next verify batch
                    finish = FinishReason.context
                    segments.extend(text.flush())
                step = Step(
                    index=index,
                    k=k,
                    drafted=tuple(map(int, d)),
                    n_accepted=n_acc,
                    target_token=token if len(emitted) == len(new) else None,
                    emitted=tuple(emitted),
                    segments=tuple(segments),
                    draft_ms=(t_draft - t_start) * 1e3,
                    verify_ms=(t_verify - t_draft) * 1e3,
                    source=draft.source if len(d) else Source.none,
                    match_len=draft.match_len,
                    logprobs=() if config.logprobs is None else _logprobs(logits, masks, emitted, config.logprobs),
                    branch=() if alt is None else tuple(map(int, alt.tokens)),
                    branch_won=won == 1,
                    branch_source=alt.source if alt is not None else Source.none,
                    branch_match_len=alt.match_len if alt is not None else 0,
                    n_past=n_past,
                    shared_rows=(self.passes or target).shared_rows,
                    rollback_ms=rollback_ms,
                )
                if self.curve is not None:  # where this pass's batch size fell on the measured curve
                    step = replace(
                        step,
                        curve_ms=self.curve.predict(step.batch_size, n_past or self.curve.context),
                        cheap=self.curve.cheap(step.batch_size),
                    )
                if drafter is not None and step.source != GRAMMAR:
                    self.sequence.observe(step)  # 6. adapt (forced drafts are the grammar's, not the controller's)
                yield step
                if finish is not None:
                    if drafter is not None and finish is not FinishReason.context:  # the output and its end token
                        end = len(prompt) + n_out + (finish is FinishReason.eog and len(emitted) < len(new))
                        drafter.finish(prompt, ctx[len(prompt) : end].copy())
                    yield Finish(finish, text.hit if finish is FinishReason.stop else None)
                    return
        finally:
            if drafter is not None:
                self.sequence.end_reply()  # what this reply taught, for every sequence's next one
            # Leave only committed tokens in the target's cache (also on Ctrl-C or an early close()).
            keep = common_prefix(target.tokens, ctx[: max(n - 1, 0)])
            if keep < len(target.tokens):
                target.truncate(keep)

    # -- the phases of a generation -----------------------------------------------------------------------------

    def _sync(self, context: np.ndarray) -> Generator[Rows, int | None, int]:
        """The target's cache := `context` (int32 [n]), reusing the longest common prefix (`models.backend.sync`, with
        the missing rows handed out as one prefill `Rows`). Returns the tokens evaluated (not those the server's
        scheduler copied from another sequence's cells)."""
        target = self.target
        keep = common_prefix(target.tokens, context)
        if keep < len(target.tokens):
            target.truncate(keep)
            keep = len(target.tokens)  # a recurrent state that cannot keep `keep` tokens is cleared
        copied = None
        if keep < len(context):
            copied = yield Rows(context[keep:], 0)
        return len(context) - keep - (copied or 0)

    def _prefill(self, prompt: np.ndarray, prediction: tuple[int, ...] | None) -> Generator[Rows, int | None, Prefill]:
        """The target's cache := prompt[:-1] (a cached common prefix is reused); the drafter begins on the prompt."""
        t0 = self.clock()
        n_restored, restore_ms = 0, 0.0
        if self.parking is not None:  # park the KV cache if the prompt would cut it; swap a parked state back in
            self.parking.prepare(self.target, prompt[:-1])
        if self.prompt_cache is not None:  # a saved state of the longest shared prefix, when that beats the KV cache
            n_restored, restore_ms = self.prompt_cache.restore(self.target, prompt[:-1])
        t_eval = self.clock()
        n_eval = yield from self._sync(prompt[:-1])
        t1 = self.clock()
        draft_ms = 0.0
        if self.drafter is not None:
            self.drafter.begin(prompt, None if prediction is None else np.asarray(prediction, dtype=np.int32))
            draft_ms = (self.clock() - t1) * 1e3
            self.sequence.observe_prefill(n_eval, (t1 - t_eval) * 1e3, self.target.n_batch)  # a free v(b) point
        if self.prompt_cache is not None and self.target.rollback != "kv" and n_eval:
            # a recurrent state can only be restored whole: the prompt's is the one a later prompt starts with
            self.prompt_cache.save(self.target)
        return Prefill(
            n_prompt=len(prompt),
            n_evaluated=n_eval,
            ms=(t1 - t0) * 1e3,
            draft_ms=draft_ms,
            n_restored=n_restored,
            restore_ms=restore_ms,
        )

    def save_prompt(self) -> int:
        """Save the target's KV state (the last generation's prompt and output) to the prompt cache, for a later run
        that starts with the same tokens; called after a generation, outside its timing. Returns bytes written (0:
        no cache, nothing new, or a failure, which `PromptCache` warns about)."""
        if self.prompt_cache is None or self.target.rollback != "kv":  # a recurrent state: saved after the prefill
            return 0
        return self.prompt_cache.save(self.target)

    def _choose_and_draft(
        self,
        context: np.ndarray,
        budget: int,
        sampling: SamplingParams,
        rng: np.random.Generator,
        grammar: Constraint | None = None,
    ) -> tuple[int, Draft, Draft | None]:
        """Choose K, draft, and keep what is worth verifying. context: int32 [n]; budget: output tokens left.
        With a grammar: the tokens it forces are the draft when there are any (source "grammar"); otherwise every
        draft is cut at its first token the grammar forbids, before it is verified.
        Returns (the K recorded for the step, the draft to verify, a second branch for the same pass or None: one of
        the other lookup drafts, `KController.branch`; only for a lookup draft, without a grammar)."""
        if self.drafter is None:
            return 0, NO_DRAFT, None
        target, drafter = self.target, self.drafter
        room = target.n_ctx - len(context)  # the verify batch adds k + 1 tokens to a cache holding n - 1
        # never draft more than the token budget, the context window and one llama.cpp batch can take (or, on a
        # server's slot, what `server.lanes.Slot.draft_limit` allows)
        passes = self.passes or target
        limit = min(budget - 1, room - 1, passes.draft_limit)
        if grammar is not None and limit > 0:
            forced = grammar.forced()[:limit]  # a schema's next key, closing brackets: free and nearly always right
            if len(forced):
                return len(forced), Draft(tokens=forced, source=GRAMMAR), None
        controller = self.sequence
        k = min(controller.next_k(), limit)
        if k <= 0:
            return 0, NO_DRAFT, None
        # the free lookup drafts (prompt lookup, suffix store, prediction: cheap beside a pass), each at most k tokens
        drafts = [d if len(d) <= k else cut(d, k) for d in drafter.lookup(context, k, sampling, rng)]
        if grammar is not None:
            drafts = [c for c in (cut(d, grammar.cut(d.tokens)) for d in drafts) if len(c)]
        # the controller picks the source with the best expected tokens/s: a lookup draft (trimmed), the draft model
        # (which only now pays for its K forward passes), or a plain step
        k, draft = controller.choose(drafts, drafter.has_model, k)
        if draft is None:
            draft = drafter.propose(context, min(k, limit), sampling, rng) if k > 0 and drafter.has_model else NO_DRAFT
            if len(draft) > k:
                draft = cut(draft, k)
            if grammar is not None and len(draft):
                draft = cut(draft, grammar.cut(draft.tokens))
            return k, draft, None
        # the free slots: a second candidate from the other lookup drafts, in the same pass (the batch of both
        # branches within the budget and one llama.cpp batch; the other branch's tokens stay within the context)
        alt = None
        if len(draft) and grammar is None and passes.branches and len(drafts) > 1:
            others = [x for x in drafts if x is not draft and common_prefix(x.tokens, draft.tokens) < len(x)]
            alt = controller.branch(draft, others, min(limit, budget - 1) + 1) if others else None
        return k, draft, alt

    def _emit(
        self, new: list[int], n_acc: int, drafted: np.ndarray, text: TextStream, budget: int, late: bool = False
    ) -> tuple[list[int], list, FinishReason | None]:
        """Commit `new` (accepted drafts, then the target token) to the output, in order, stopping at an
        end-of-generation token, a stop string, the token budget or, when `late` (past `line_time_ms`), a newline.

        Returns (emitted tokens, display segments, finish reason or None). Segments are in display order: accepted
        drafts, the rejected drafts (shown where they were proposed, never part of the output), the target token.
        """
        emitted: list[int] = []
        segments: list = []
        finish = None
        for j, tok in enumerate(new):
            if j == n_acc and n_acc < len(drafted):
                segments.append((REJECTED, piece_text(self.target.piece, drafted[n_acc:])))
            if self.target.is_eog(tok):
                finish = FinishReason.eog
                break
            emitted.append(tok)
            segs, hit = text.push(ACCEPTED if j < n_acc else TARGET, tok)
            segments.extend(segs)
            if hit:
                finish = FinishReason.stop
                break
            if len(emitted) >= budget or (late and b"\n" in self.target.piece(tok)):
                finish = FinishReason.length
                break
        if finish in (FinishReason.eog, FinishReason.length):
            segments.extend(text.flush())  # no stop string can follow: release held-back text
        return emitted, segments, finish


def _logprobs(logits: np.ndarray, masks: np.ndarray | None, emitted: list[int], n_top: int) -> tuple[TokenLogprob, ...]:
    """One `TokenLogprob` per emitted token, from the verify row that predicted it (row j for the j-th token)."""
    out = []
    for j, tok in enumerate(emitted):
        lp, top = token_logprob(logits[j], tok, n_top, None if masks is None else masks[j])
        out.append(TokenLogprob(token=tok, logprob=lp, top=top))
    return tuple(out)
