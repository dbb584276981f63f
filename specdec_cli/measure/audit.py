"""Losslessness audits for greedy speculative decoding: teacher forcing, first divergence, near-tie verdicts.

Greedy speculative decoding emits exactly the target's greedy decode in exact arithmetic: every emitted token is the
target's argmax given the committed context (`sampling.verify_greedy`). In floating point it is equal only up to
near-ties, because llama.cpp's logits depend on the batch shape: the speculative run evaluates positions in verify
batches of K + 1 tokens, plain decoding one token at a time, and the two sum in different orders (and, on CPU, may
pick different matrix kernels). Where the target's top-2 logit gap is smaller than that numerical drift the two
runs can pick different tokens, and from there the texts go their own ways. A bug (a wrong position, a KV cache not
rolled back, an off-by-one in acceptance) also shows up as a divergence, but at a token the target does not come
close to choosing.

So each divergence is judged by its *margin* in the batch-1 (plain decoding) numerics: the target's top-1 logit
minus the logit of the token the speculative run emitted, in logits (natural-log units of unnormalised
probability), >= 0. A margin below `NEAR_TIE_THRESHOLD` is a numerical near-tie; anything larger is a
`DIVERGENCE`.

The threshold, 1.0 logit (the emitted token is e ≈ 2.7 times less likely than the argmax), comes from measurement
(docs/check.md). A flip needs the batch-1 top-2 gap to be smaller than the drift of that gap between batch sizes, so the
drift bounds every near-tie margin: 1.0 sits above the largest drift measured and far below most of what an injected
engine bug produces (docs/check.md has the table). `specdec check --threshold` changes it for other hardware, builds or
quantisations.

A limit no threshold removes: a bug that strikes only where the target nearly ties looks like numerics (a single
injected wrong acceptance had a margin of 0.54). Real bugs (a cache not rolled back, an off-by-one) strike at many
positions, and most of those are not near-ties.

Two ways to get batch-1 margins, both in exactly the numerics of a plain run:
- `teacher_force` re-scores a token sequence one token at a time from an empty cache (the prompt prefilled in
  n_batch chunks, as `SpeculativeEngine` does), so row i is what plain decoding computes when its context is the
  prompt plus output[:i]. `specdec check` uses it on the whole speculative output.
- `FirstMismatchProbe` wraps the target during the plain run of `--compare` and keeps the one logits row where
  plain decoding first leaves a reference sequence: no second pass, one argmax per token of the plain run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from specdec_cli.models.backend import Backend, common_prefix

if TYPE_CHECKING:
    from specdec_cli.core.constraint import Grammar

NEAR_TIE_THRESHOLD = 1.0  # logits; see the module docstring and docs/check.md
NEAR_TIE = "numerical near-tie"
DIVERGENCE = "DIVERGENCE"
END = "<end of generation>"  # shown for the end-of-generation token where a run stopped
_EOG_SEARCH = 64  # end-of-generation tokens are looked for among this many best logits


def teacher_force(
    backend: Backend, prompt_tokens: Sequence[int] | np.ndarray, output_tokens: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Re-score `output_tokens` with the target one token at a time (batch 1), from an empty cache.

    The cache is cleared, the prompt minus its last token is prefilled in n_batch chunks, and then prompt[-1],
    output[0], output[1], ... are evaluated one per forward pass: the exact call sequence of plain decoding
    (`SpeculativeEngine` without a drafter) along this output. Row i predicts output[i].

    Args:
        backend: the target model. Its KV cache is replaced (it ends holding prompt + output[:-1]).
        prompt_tokens: int [p] (p >= 1) the prompt, e.g. chat-templated.
        output_tokens: int [n] the tokens to check (n >= 0).

    Returns:
        (argmax, margin): int32 [n] the target's batch-1 argmax at each position (lowest id on exact ties, as
        `verify_greedy`), and float32 [n] the target's top-1 logit minus the logit of output[i] (>= 0; 0 where
        output[i] is the argmax).

    Raises:
        ValueError: empty prompt. What `backend.decode`/`truncate` raise (ContextOverflowError, DecodeError, ...).
    """
    argmax, margin, _ = _score(backend, prompt_tokens, output_tokens, with_next=False)
    return argmax, margin


def _score(backend: Backend, prompt_tokens, output_tokens, *, with_next: bool, grammar: Grammar | None = None):
    """`teacher_force`, plus (when `with_next`) a copy of the row after the last output token: float32 [V]. With a
    grammar, every row is first masked by the grammar's state after the output before it (the constrained target
    distribution a constrained run follows)."""
    from specdec_cli.core.constraint import start
    from specdec_cli.core.sampling import apply_mask

    constraint = start(grammar, backend.lltokenizer, backend.n_vocab)
    none = np.zeros(0, dtype=np.int32)
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    out = np.asarray(output_tokens, dtype=np.int32)
    if len(prompt) == 0:
        raise ValueError("teacher_force needs a non-empty prompt")
    n = len(out)
    argmax = np.zeros(n, dtype=np.int32)  # [n]
    margin = np.zeros(n, dtype=np.float32)  # [n]
    backend.truncate(0)
    if len(prompt) > 1:
        backend.decode(prompt[:-1], n_logits=0)  # chunked by n_batch, like the engine's prefill
    feed = np.concatenate((prompt[-1:], out))  # feed[i] is evaluated to predict out[i]: [n + 1]
    next_row = None
    for i in range(n + 1 if with_next else n):
        row = backend.decode(feed[i : i + 1], n_logits=1)[0]  # [V] view, valid until the next decode
        if constraint is not None:  # the grammar's allowed tokens after out[:i]
            row = apply_mask(row, constraint.masks(none)[0])
            if i < n:
                constraint.commit(0, int(out[i]))
        if i == n:
            next_row = np.array(row)
            break
        best = int(np.argmax(row))
        argmax[i] = best
        if best != out[i]:
            margin[i] = row[best] - row[out[i]]
    return argmax, margin, next_row


def first_divergence(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int | None:
    """Index of the first position where token sequences `a` and `b` (int [n], int [m]) differ, counting one
    sequence ending before the other as a difference at its length; None when they are identical."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    d = common_prefix(a, b)
    return None if d == len(a) == len(b) else d


def classify(margin: float, threshold: float = NEAR_TIE_THRESHOLD) -> str:
    """Verdict on a token that is not the batch-1 argmax: `NEAR_TIE` when its margin (logits, >= 0) is below
    `threshold`, else `DIVERGENCE`."""
    return NEAR_TIE if margin < threshold else DIVERGENCE


def eog_margin(row: np.ndarray, is_eog) -> tuple[int | None, float]:
    """Margin of "stop here" in one logits row: top-1 logit minus the best end-of-generation token's logit.

    Args:
        row: float32 [V] logits.
        is_eog: token id -> bool (the backend's `is_eog`).

    Returns:
        (eog_token, margin): the best EOG token among the `_EOG_SEARCH` largest logits and its margin (0 when it is
        the argmax); (None, lower bound) when none is among them: the margin is then at least top-1 minus the
        smallest of those logits.
    """
    m = min(_EOG_SEARCH, row.shape[0])
    ids = np.argpartition(row, row.shape[0] - m)[row.shape[0] - m :]  # [m], unordered
    ids = ids[np.argsort(-row[ids], kind="stable")]
    top = float(row[ids[0]])
    for t in ids:
        if is_eog(int(t)):
            return int(t), top - float(row[t])
    return None, top - float(row[ids[-1]])


def token_label(backend: Backend, token: int | None) -> str:
    """How a token is shown in reports: its text as a Python literal (whitespace visible), or `END`."""
    if token is None:
        return END
    return repr(backend.piece(int(token)).decode("utf-8", "replace"))


# -- --compare: the first divergence from plain decoding, with the plain run's own margin ----------------------------


class FirstMismatchProbe:
    """A transparent `Backend` wrapper for the plain run of `--compare`: it remembers the first logits row whose
    argmax leaves `reference` (the speculative run's output), i.e. the row where plain decoding diverges from it.

    It adds one argmax over each returned row (tens of microseconds at V = 152k) and copies one row in total; the
    speculative run is never wrapped. Everything else is delegated to `inner`.

    Args:
        inner: the target backend.
        n_prompt: prompt length; the row predicting cache position n_prompt + i predicts output token i.
        reference: int [n] the speculative run's output tokens.

    Attributes:
        position: output index of the first mismatching row (None: none seen). row: float32 [V] a copy of it.
    """

    def __init__(self, inner: Backend, n_prompt: int, reference: Sequence[int]) -> None:
        self.inner = inner
        self.n_prompt = n_prompt
        self.reference = np.asarray(reference, dtype=np.int32)
        self.position: int | None = None
        self.row: np.ndarray | None = None

    def __getattr__(self, name):  # tokens, n_ctx, n_vocab and the rest: the inner backend's
        return getattr(self.inner, name)

    def decode(self, tokens, n_logits: int = 0) -> np.ndarray:
        rows = self.inner.decode(tokens, n_logits)  # [n_logits, V]
        if self.position is None and n_logits:
            # row j predicts cache position first + j, i.e. output index first + j - n_prompt
            first = len(self.inner.tokens) - n_logits + 1 - self.n_prompt
            for j in range(n_logits):
                i = first + j
                if i < 0:
                    continue
                if i >= len(self.reference) or int(np.argmax(rows[j])) != self.reference[i]:
                    self.position, self.row = i, np.array(rows[j])
                    break
        return rows

    def truncate(self, n: int, *, branch: bool = False) -> None:
        if branch:
            self.inner.truncate(n, branch=True)
        else:  # as the engine calls it (a wrapped backend may take only n)
            self.inner.truncate(n)


@dataclass(frozen=True)
class Divergence:
    """Where a speculative run first left plain decoding (greedy).

    Attributes:
        position: 0-based output token index (= the number of leading tokens shared).
        spec_token / plain_token: the token each run emitted there (None: that run ended there, with an
            end-of-generation token).
        spec_text / plain_text: those tokens as shown (`token_label`).
        margin: plain decoding's top-1 logit minus its logit for the speculative run's token, in logits, computed
            from the plain (batch-1) run's own logits row at that position. None when it could not be computed
            (the plain run ended first with a stop string or the length limit, which a shared prefix cannot cause).
        verdict: `NEAR_TIE` or `DIVERGENCE` (`classify`); `DIVERGENCE` when margin is None.
        threshold: the near-tie threshold used, in logits.
    """

    position: int
    spec_token: int | None
    plain_token: int | None
    spec_text: str
    plain_text: str
    margin: float | None
    verdict: str
    threshold: float

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the terminal."""
        m = "margin unknown" if self.margin is None else f"margin {self.margin:.3f} logits"
        return (
            f"first divergence at token {self.position}: speculative {self.spec_text}, plain {self.plain_text} "
            f"({m} in the plain run; near-tie threshold {float(self.threshold)}): {self.verdict}"
        )


def compare_divergence(
    spec_tokens: Sequence[int],
    plain_tokens: Sequence[int],
    probe: FirstMismatchProbe | None,
    backend: Backend,
    threshold: float = NEAR_TIE_THRESHOLD,
) -> Divergence | None:
    """The first divergence of a greedy speculative output from the plain one, judged by the plain run's margin.

    Args:
        spec_tokens / plain_tokens: int [n] / int [m] the two outputs (end-of-generation tokens not included).
        probe: the `FirstMismatchProbe` that wrapped the target during the plain run (with reference =
            spec_tokens); None gives margin None.
        backend: for token texts and end-of-generation ids.
        threshold: near-tie threshold in logits.

    Returns:
        None when the outputs are identical, else a `Divergence`.
    """
    d = first_divergence(spec_tokens, plain_tokens)
    if d is None:
        return None
    spec_tok = int(spec_tokens[d]) if d < len(spec_tokens) else None
    plain_tok = int(plain_tokens[d]) if d < len(plain_tokens) else None
    margin = None
    row = probe.row if probe is not None and probe.position == d else None
    if row is not None:
        if spec_tok is not None:
            margin = float(row.max() - row[spec_tok])
        else:  # the speculative run stopped here with an end-of-generation token the records do not keep
            _, margin = eog_margin(row, backend.is_eog)
    verdict = classify(margin, threshold) if margin is not None else DIVERGENCE
    return Divergence(
        position=d,
        spec_token=spec_tok,
        plain_token=plain_tok,
        spec_text=token_label(backend, spec_tok),
        plain_text=token_label(backend, plain_tok),
        margin=margin,
        verdict=verdict,
        threshold=threshold,
    )


# -- specdec check: every emitted token against the batch-1 argmax ---------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One output position where the emitted token is not the target's batch-1 argmax.

    Attributes:
        position: 0-based output index (len(output) for the end-of-generation check).
        token / argmax: emitted token / batch-1 argmax (None: end of generation).
        token_text / argmax_text: as shown (`token_label`).
        margin: batch-1 top-1 logit minus the emitted token's logit, in logits (> 0, or 0 on an exact tie).
        verdict: `NEAR_TIE` or `DIVERGENCE`.
    """

    position: int
    token: int | None
    argmax: int | None
    token_text: str
    argmax_text: str
    margin: float
    verdict: str


@dataclass(frozen=True)
class AuditReport:
    """Result of `audit_output`.

    Attributes:
        n_checked: positions checked (output tokens, plus one when the run ended with end-of-generation).
        flags: positions whose emitted token is not the batch-1 argmax, in order.
        threshold: the near-tie threshold (logits).
    """

    n_checked: int
    flags: tuple[Flag, ...]
    threshold: float

    @property
    def near_ties(self) -> int:
        return sum(f.verdict == NEAR_TIE for f in self.flags)

    @property
    def divergences(self) -> int:
        return sum(f.verdict == DIVERGENCE for f in self.flags)

    @property
    def largest_margin(self) -> float:
        return max((f.margin for f in self.flags), default=0.0)

    @property
    def passed(self) -> bool:
        return self.divergences == 0

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "threshold": self.threshold,
            "n_checked": self.n_checked,
            "n_flagged": len(self.flags),
            "near_tie_flips": self.near_ties,
            "divergences": self.divergences,
            "near_tie_share": self.near_ties / self.n_checked if self.n_checked else 0.0,
            "largest_margin": self.largest_margin,
            "flags": [asdict(f) for f in self.flags],
        }


def audit_output(
    backend: Backend,
    prompt_tokens: Sequence[int] | np.ndarray,
    output_tokens: Sequence[int] | np.ndarray,
    *,
    ended_with_eog: bool = False,
    threshold: float = NEAR_TIE_THRESHOLD,
    grammar: Grammar | None = None,
) -> AuditReport:
    """Check every emitted token against the target's batch-1 argmax along the same output (`teacher_force`).

    Args:
        backend: the target; its KV cache is replaced.
        prompt_tokens: int [p] the prompt the output was generated from.
        output_tokens: int [n] the emitted tokens (end-of-generation token not included).
        ended_with_eog: the run stopped on an end-of-generation token: also check that stopping was the argmax
            after the last token.
        threshold: near-tie threshold in logits.
        grammar: the grammar the run followed (`GenerationConfig.grammar`): each position is checked against the
            argmax among the tokens the grammar allows there (masked by its state after the output before it).

    Returns:
        An `AuditReport`; `passed` when every flagged position is a near-tie.
    """
    out = np.asarray(output_tokens, dtype=np.int32)
    argmax, margin, next_row = _score(backend, prompt_tokens, out, with_next=ended_with_eog, grammar=grammar)
    flags = [
        Flag(
            position=int(i),
            token=int(out[i]),
            argmax=int(argmax[i]),
            token_text=token_label(backend, int(out[i])),
            argmax_text=token_label(backend, int(argmax[i])),
            margin=float(margin[i]),
            verdict=classify(float(margin[i]), threshold),
        )
        for i in np.flatnonzero(argmax != out)
    ]
    if next_row is not None:
        best = int(np.argmax(next_row))
        if not backend.is_eog(best):
            _, m = eog_margin(next_row, backend.is_eog)
            flags.append(
                Flag(
                    position=len(out),
                    token=None,
                    argmax=best,
                    token_text=END,
                    argmax_text=token_label(backend, best),
                    margin=m,
                    verdict=classify(m, threshold),
                )
            )
    return AuditReport(n_checked=len(out) + (1 if ended_with_eog else 0), flags=tuple(flags), threshold=threshold)
