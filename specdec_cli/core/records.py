"""Frozen records the engine yields. The renderer, the stats and `--json` are all computed from these same records,
so what the user sees streamed and what the statistics say cannot disagree.

A generation yields one `Prefill`, then one `Step` per target forward pass, then one `Finish` (why it ended). A
generation stopped early by its consumer (Ctrl-C, `close()`) has no `Finish`: `driver.Drive` calls that
"interrupted".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# Segment kinds, in the order the renderer shows them within a step.
ACCEPTED = "accepted"  # a draft token the target accepted (part of the output)
REJECTED = "rejected"  # a draft token the target rejected (display only, never part of the output)
TARGET = "target"  # the target's own token: the correction after a rejection, or the bonus token

Segment = tuple[str, str]  # (kind, text)


class Source(StrEnum):
    """Where a draft came from, in the field's terms: `Draft.source`, `Step.source`, the keys of
    `RunStats.by_source` (and so of --json's `stats.by_source` and the server's `specdec.sources`), the stream's
    colours and legend. A StrEnum: it prints, compares and serialises as its value; `label` is what people read."""

    prompt = (
        "prompt"  # prompt lookup: a match in this prompt and output (--method ngram, suffix's and auto's local index)
    )
    store = "store"  # the suffix store of past outputs (SuffixDecoding; --method suffix and auto)
    predict = "predict"  # the predicted output the user gave (predicted outputs: --predict, OpenAI's `prediction`)
    draft = "draft"  # a draft model
    mtp = "mtp"  # the target's own multi-token-prediction block (--method mtp; auto where the target has one)
    grammar = "grammar"  # the tokens a grammar forces next (--json-object, --json-schema, --grammar, response_format)
    realign = "realign"  # the reply's copy of the prompt past its edits, repeated ones applied (drafters/edits.py)
    corpus = "corpus"  # the code and documents `specdec learn` indexed (REST-style retrieval; --method auto)
    none = ""  # no draft: a plain step (K = 0), an empty draft

    @property
    def label(self) -> str:
        """ "prompt lookup", "past outputs", "prediction", "draft model"."""
        return _LABELS[self]


_LABELS = {
    Source.prompt: "prompt lookup",
    Source.store: "past outputs",
    Source.predict: "prediction",
    Source.draft: "draft model",
    Source.mtp: "MTP head",
    Source.grammar: "grammar (forced)",
    Source.realign: "prompt lookup (realigned)",
    Source.corpus: "corpus",
    Source.none: "no draft",
}


class FinishReason(StrEnum):
    """Why a generation ended: `Finish.finish_reason`, `RunStats.finish_reason`, --json's `finish_reason`. A
    StrEnum: it prints, compares and serialises as its value."""

    eog = "eog"  # an end-of-generation token, or a grammar that is complete and allows nothing more
    stop = "stop"  # a stop string (`Finish.stop` says which)
    length = "length"  # the token budget (--max-tokens)
    context = "context"  # the context window is full
    interrupted = "interrupted"  # stopped by its consumer (Ctrl-C, `close()`): no `Finish` came (`driver.Drive`)


@dataclass(frozen=True, slots=True)
class Prefill:
    """The prompt was evaluated.

    Attributes:
        n_prompt: prompt tokens (after the chat template).
        n_evaluated: tokens actually evaluated by the target (fewer than n_prompt when the KV cache held a prefix).
        ms: wall time of the target prefill, in milliseconds.
        draft_ms: wall time of the drafter's own prefill (draft model), in milliseconds (0 for lookup drafters).
        n_restored: prompt tokens whose KV state was restored from the prompt cache (`prompt_cache.PromptCache`).
        restore_ms: wall time of that restore, in milliseconds (part of `ms`).
    """

    n_prompt: int
    n_evaluated: int
    ms: float
    draft_ms: float = 0.0
    n_restored: int = 0
    restore_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, from the verify row that predicted it (no extra pass).

    Of the distribution the token was chosen from before sampling's truncation: softmax of the row's logits at
    temperature 1, masked by the grammar and renormalised when one constrains the generation.

    Attributes:
        token: the emitted token id.
        logprob: its natural log-probability (<= 0).
        top: the n most likely tokens of that distribution as (token, logprob), most likely first (n = the
            `logprobs` asked for; empty for 0).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One draft → verify → accept step (one target forward pass).

    Attributes:
        index: 0-based step number.
        k: draft length the controller asked for (0 = plain decoding); when it trimmed a lookup draft by its match
            (`KController.trim`), the length it kept.
        drafted: the draft tokens verified (len <= k; a drafter may propose fewer).
        n_accepted: how many draft tokens verification accepted (a prefix of `drafted`).
        target_token: the target's own token (correction or bonus); None when the step stopped inside the
            accepted prefix (end of generation, stop string or max tokens).
        emitted: tokens committed to the output by this step (accepted drafts, then the target token), cut at a stop.
        segments: the text of this step for display, as (kind, text) pairs; concatenating the non-rejected texts of
            all steps gives the output text exactly.
        draft_ms: wall time the drafter took, in milliseconds.
        verify_ms: wall time of the target's forward pass over len(drafted) + 1 tokens, in milliseconds.
        source: the `Source` of the draft verified (`Source.none`, "", for plain decoding).
        match_len: the evidence of the lookup draft the controller chose this step (`Draft.match_len`: how many
            context tokens match where it was copied from), also when it was trimmed to nothing; 0 for a draft
            without evidence (a draft model) and for a plain step. `--k auto` learns acceptance by it.
        logprobs: one `TokenLogprob` per emitted token, in order, when `GenerationConfig.logprobs` asks for them;
            () otherwise.
        branch: the other branch verified in the same pass (a second candidate filling the pass's free slots,
            `KController.branch`), its whole tokens, including a prefix it may share with `drafted`; () for none.
            `drafted` is always the branch the output followed.
        branch_won: the output followed the second candidate (`drafted` is it, and `branch` the controller's draft).
        branch_source / branch_match_len: the `branch` tokens' source and evidence.
        curve_ms: the measured verify curve's cost of a pass of `batch_size` tokens after `n_past` tokens of context
            (`VerifyCurve.predict`; 0.0: no curve measured).
        n_past: tokens in the target's KV cache before this pass: the context its rows attended to (0: unknown).
        cheap: `batch_size` is a cheap size of that curve: no larger pass costs less (`VerifyCurve.cheap`).
        shared_rows: rows other sequences had in the same forward pass (`server.lanes`; 0: it ran alone), so
            `verify_ms` is the whole shared pass's time, not this step's alone.
        rollback_ms: wall time of the rollback after the pass, in milliseconds: a KV trim or a recurrent snapshot
            costs ~0; a recurrent state's checkpoint restored and its kept tokens evaluated again costs a pass
            (`rollback.RecurrentGuard`). The cost model counts it as part of the pass.
    """

    index: int
    k: int
    drafted: tuple[int, ...]
    n_accepted: int
    target_token: int | None
    emitted: tuple[int, ...]
    segments: tuple[Segment, ...]
    draft_ms: float
    verify_ms: float
    source: Source = Source.none
    match_len: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    branch: tuple[int, ...] = ()
    branch_won: bool = False
    branch_source: Source = Source.none
    branch_match_len: int = 0
    curve_ms: float = 0.0
    cheap: bool = False
    n_past: int = 0
    shared_rows: int = 0
    rollback_ms: float = 0.0

    @property
    def text(self) -> str:
        """The output text this step added (accepted + target segments)."""
        return "".join(t for kind, t in self.segments if kind != REJECTED)

    @property
    def batch_size(self) -> int:
        """Tokens in the target's verify pass: the pending committed token, the draft, and a second branch's tokens
        after what it shares with the draft."""
        if not self.branch:
            return len(self.drafted) + 1
        shared = 0
        for x, y in zip(self.drafted, self.branch, strict=False):
            if x != y:
                break
            shared += 1
        return len(self.drafted) + len(self.branch) - shared + 1

    @property
    def rejected(self) -> bool:
        """Verification rejected a draft token: the target's token is the correction at position n_accepted + 1.

        False when every draft token was accepted, and when the step stopped inside the accepted prefix (end of
        generation, stop string or max tokens: nothing after it was committed, so no rejection counts)."""
        return self.n_accepted < len(self.drafted) and self.target_token is not None


@dataclass(frozen=True, slots=True)
class Finish:
    """The generation ended (the last record; it follows the `Step` that ended it).

    Attributes:
        finish_reason: a `FinishReason` other than `interrupted`: eog (end-of-generation token, or a grammar that is
            complete and allows nothing more), stop (a --stop string), length (--max-tokens) or context (the
            context window is full).
        stop: the stop string that ended it (finish_reason "stop"), else None.
    """

    finish_reason: FinishReason
    stop: str | None = None


Record = Prefill | Step | Finish
