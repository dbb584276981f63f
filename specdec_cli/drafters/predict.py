"""Predicted-outputs drafter: draft from a text the user expects back (`--predict FILE`).

The user often holds most of the answer: "rename X, return the whole file" returns the file with a few lines
changed. OpenAI's Chat Completions API takes it as `prediction: {"type": "content", "content": ...}` and reports
`accepted_prediction_tokens` / `rejected_prediction_tokens`. Prompt lookup decoding (Saxena, "Prompt Lookup
Decoding", 2023) drafts from such text only once an n-gram of the output matches it, and only when it is in the
prompt; this drafter keeps an alignment pointer into the prediction instead, like a streaming diff.

Algorithm (per `propose`; the drafter sees the committed context and consumes the output tokens added since its last
call):
    start       the pointer is at the prediction's first token: the first step drafts prediction[0:K].
    aligned     each new output token is compared with the token the pointer expects; while they agree the pointer
                advances (O(new tokens) per step, no search) and the draft is prediction[ptr:ptr+K].
    divergence  the output produced something else (an inserted, deleted or changed line): the pointer's byte
                position becomes the anchor, and the drafter re-synchronises on every step until it aligns again:
    re-sync     the output's recent BYTES (up to `max_match_bytes`) are matched against the prediction's bytes
                (`piece` of each token, concatenated; a byte offset per token). The longest suffix of the output
                that ends inside a window around the anchor (`behind` tokens before, `ahead` after) is taken, its
                occurrence nearest the anchor (ahead on a tie); the match must cover at least the output's last
                token. Only when the window has none, the whole prediction is searched the same way, and the match
                must then cover the output's last `min_global_tokens` tokens. Deleted lines are skipped as soon as the
                output's next token is written; after an inserted line the text before the anchor matches again.
                Both cost one or two steps, not a new n-gram search. A re-sync that the very next output token
                contradicts was a guess (a short match inside new text): the anchor stays where the last confirmed
                alignment left the prediction, so guesses do not drag the window away. The prediction is preceded by a
                virtual "\\n", so a reply that opens with a code fence ("```python\\n") re-syncs at the prediction's
                start.
    boundaries  matching bytes, not tokens, aligns also where the output's tokens split the text differently from
                the prediction's (the output wrote " foo" + "(" where the prediction has " foo(" as one token, or the
                other way round). When the match ends inside a prediction token, the rest of that token's text is
                re-tokenized with `tokenize` and drafted first, then the prediction's tokens follow. Without
                `tokenize`, or if the re-tokenized rest does not spell those bytes, nothing is drafted this step
                and the next step re-syncs.

Drafts are deterministic (`dists=None`: verification treats q as one-hot), so greedy decoding and rejection sampling
stay lossless. The prediction is only read, never evaluated by the target, so it may be longer than the context.
A `propose` costs a small fraction of a target pass, so the drafter is free to consult every step
(`benchmarks/bench_predict_drafter.py` times it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import numpy as np

from specdec_cli.core.draft import EMPTY, Draft, DrafterBase
from specdec_cli.core.records import Source
from specdec_cli.core.sampling import SamplingParams

SCORE_FULL = 8  # a run of this many agreeing tokens gives score 1.0


class PredictionDrafter(DrafterBase):
    """Drafts the continuation of the predicted text at an alignment pointer (see the module docstring).

    Args:
        prediction: int32 [m] tokens of the predicted text, tokenized with the target's tokenizer without special
            tokens (`add_special=False`). m = 0 is allowed (it drafts nothing).
        piece: token id → its bytes (`Backend.piece`); called once per distinct token (cached).
        tokenize: text → token ids without special tokens (e.g. `lambda s: target.tokenize(s, add_special=False)`),
            used to draft the rest of a prediction token that a re-sync lands inside; None = skip such steps.
        ahead, behind: the near window, in prediction tokens after and before the anchor.
        max_match_bytes: the longest output suffix compared at a re-sync (longer matches count as equal, and the
            nearest one wins).
        min_global_tokens: a match outside the near window must cover at least this many output tokens.

    `Draft.match_len` (the evidence `--k auto` trims by): how many output tokens just before the pointer agree with
    the prediction (the run since the last re-sync, the re-sync's match included); 1 at the very start of the reply
    (the prediction's first token has no output before it, and 0 would mean "no evidence"). `Draft.score` =
    min(1, match_len / 8). `pointer`: the prediction index the output is expected to continue with (-1 while not
    aligned); `n_resyncs`: re-sync searches run in this generation. Raises ValueError if `prediction` is not
    one-dimensional.
    """

    name = "predict"

    def __init__(
        self,
        prediction: np.ndarray,
        *,
        piece: Callable[[int], bytes],
        tokenize: Callable[[str], list[int]] | None = None,
        ahead: int = 256,
        behind: int = 64,
        max_match_bytes: int = 64,
        min_global_tokens: int = 2,
    ) -> None:
        pred = np.asarray(prediction, dtype=np.int32)
        if pred.ndim != 1:
            raise ValueError(f"prediction must be one-dimensional, got shape {pred.shape}")
        self.prediction = pred.copy()
        self.tokenize = tokenize
        self.ahead, self.behind = ahead, behind
        self.max_match_bytes, self.min_global_tokens = max_match_bytes, min_global_tokens
        self._pieces: dict[int, bytes] = {}
        self._piece = piece
        lens = np.fromiter((len(self._bytes_of(int(t))) for t in pred), dtype=np.int64, count=len(pred))
        # off: int64 [m + 1] byte offset of each prediction token in `text`; off[m] = len(text). Byte 0 is the
        # virtual "\n" before the prediction.
        self.off = np.concatenate(([1], 1 + np.cumsum(lens))).astype(np.int64)
        self.text = b"\n" + b"".join(self._pieces[int(t)] for t in pred)
        self.reset()

    # -- the Drafter protocol -------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the generation: the pointer goes back to the prediction's start."""
        self._n_prompt: int | None = None  # set by begin/prefill, else by the first propose
        self._seen = 0  # output tokens consumed
        self._ptr = 0  # index of the next expected prediction token; -1 = not aligned
        self._pending = EMPTY  # int32 tokens expected before prediction[ptr:] (a re-tokenized split token)
        self._run = 0  # output tokens just before the pointer that agree with the prediction
        self._anchor = int(self.off[0])  # byte position the near window is centred on
        self._tentative = False  # aligned by a re-sync that no output token has confirmed yet
        self._out = bytearray()  # the output's bytes
        self._starts: list[int] = []  # byte offset of each output token in `_out`
        self.n_resyncs = 0  # re-sync searches run in this generation (for stats and benchmarks)

    def prefill(self, context: np.ndarray) -> None:
        """The prompt (int32 [n]): the output starts after it."""
        self.begin(context)

    def begin(self, context: np.ndarray, prediction: np.ndarray | None = None) -> None:
        """Start a generation after the prompt `context` (int32 [n]); same as reset() + prefill(context). The
        prediction is the one given at construction (`AutoDrafter` builds one per generation)."""
        self.reset()
        self._n_prompt = len(context)

    def propose(self, context: np.ndarray, k: int, sampling: SamplingParams, rng: np.random.Generator) -> Draft:
        """Up to k int32 tokens of the prediction after the pointer; empty when not aligned. Deterministic."""
        if self._n_prompt is None:
            self._n_prompt = len(context)  # neither begin() nor prefill(): the first context is the prompt
        new = context[self._n_prompt + self._seen :]
        if len(new):
            self._consume(new)
        if self._ptr < 0:
            return Draft(tokens=EMPTY, source=Source.predict)
        head = self._pending[:k]
        tokens = np.concatenate((head, self.prediction[self._ptr : self._ptr + k - len(head)]))
        if not len(tokens):
            return Draft(tokens=EMPTY, source=Source.predict)
        match = max(self._run, 1)
        return Draft(tokens=tokens, score=min(1.0, match / SCORE_FULL), source=Source.predict, match_len=match)

    def finish(self, prompt: np.ndarray, output: np.ndarray) -> None:
        pass

    def close(self) -> None:
        pass

    # -- alignment ----------------------------------------------------------------------------------------------------

    @property
    def pointer(self) -> int:
        """Index of the next prediction token the output is expected to continue with (after any pending
        re-tokenized rest); -1 while not aligned."""
        return self._ptr

    def _bytes_of(self, token: int) -> bytes:
        b = self._pieces.get(token)
        if b is None:
            b = self._pieces[token] = bytes(self._piece(token))
        return b

    def _consume(self, new: np.ndarray) -> None:
        """Advance over the output tokens `new` (int32 [t]); on a divergence, re-sync."""
        for t in new.tolist():
            self._starts.append(len(self._out))
            self._out += self._bytes_of(t)
        self._seen += len(new)
        if self._ptr >= 0:
            pend = self._pending
            expected = (
                np.concatenate((pend, self.prediction[self._ptr : self._ptr + len(new) - len(pend)]))
                if len(pend)
                else self.prediction[self._ptr : self._ptr + len(new)]
            )
            n = min(len(expected), len(new))
            neq = np.flatnonzero(expected[:n] != new[:n])
            agree = int(neq[0]) if len(neq) else n
            from_pending = min(agree, len(pend))
            self._pending = pend[from_pending:]
            self._ptr += agree - from_pending
            self._run += agree
            self._tentative &= agree == 0
            if agree == len(new):
                return
            # divergence: remember where the prediction was left (a re-sync that the very next token contradicted
            # was a guess: the anchor stays where the last confirmed alignment left the prediction)
            if not self._tentative:
                self._anchor = int(self.off[self._ptr])
            self._ptr, self._pending, self._run = -1, EMPTY, 0
        self._resync()

    def _resync(self) -> None:
        """Align the pointer after the output's recent bytes (near the anchor first, then anywhere)."""
        self.n_resyncs += 1
        n_out = len(self._starts)
        total = len(self._out)
        last = total - self._starts[-1]  # bytes of the output's newest token
        m = len(self.prediction)
        a_tok = int(np.searchsorted(self.off, self._anchor, side="right")) - 1  # token at the anchor
        lo = int(self.off[max(0, a_tok - self.behind)])
        hi = int(self.off[min(m, a_tok + self.ahead)])
        found = self._longest(lo, hi, max(last, 1))
        if found is None:
            g = n_out - min(self.min_global_tokens, n_out)
            found = self._longest(1, len(self.text), max(total - self._starts[g], 1))
        if found is None:
            return
        p, length = found
        j = int(np.searchsorted(self.off, p, side="right")) - 1  # the prediction token p falls in (or starts at)
        pending = EMPTY
        if p != self.off[j] and j < m:
            # p is inside prediction token j: draft the rest of its text first, re-tokenized
            rest = self.text[p : int(self.off[j + 1])]
            retokenized = self._retokenize(rest)
            if retokenized is None:
                self._anchor = p  # stay unaligned; the next step re-syncs near here
                return
            pending = retokenized
            j += 1
        self._ptr, self._pending, self._tentative = j, pending, True
        self._run = n_out - bisect_left(self._starts, total - length)  # output tokens inside the match

    def _longest(self, lo: int, hi: int, min_len: int) -> tuple[int, int] | None:
        """The longest suffix of the output (min_len..max_match_bytes bytes) that occurs in `text` ending at a byte
        position in [lo, hi], and its end nearest the anchor (ahead on a tie): (end, length) or None."""
        text = self.text
        tail = bytes(self._out[-max(self.max_match_bytes, min_len) :])
        if min_len > len(tail):
            return None

        def find(length: int) -> int:  # start of the first occurrence ending in [lo, hi], -1 if none
            return text.find(tail[len(tail) - length :], max(0, lo - length), hi)

        if find(min_len) < 0:
            return None
        good, bad = min_len, len(tail) + 1  # occurs(good); a longer suffix occurring implies the shorter ones do
        while bad - good > 1:
            mid = (good + bad) // 2
            if find(mid) >= 0:
                good = mid
            else:
                bad = mid
        s = tail[len(tail) - good :]
        a = min(max(self._anchor, lo), hi)
        fwd = text.find(s, max(0, a - good, lo - good), hi)  # ends at >= a
        bwd = text.rfind(s, max(0, lo - good), a - 1)  # ends at <= a - 1
        ends = [i + good for i in (fwd, bwd) if i >= 0]
        end = min(ends, key=lambda e: (abs(e - a), e < a))
        return end, good

    def _retokenize(self, rest: bytes) -> np.ndarray | None:
        """int32 tokens spelling exactly `rest` (the tail of a prediction token), or None."""
        if self.tokenize is None:
            return None
        try:
            toks = [int(t) for t in self.tokenize(rest.decode("utf-8"))]
        except UnicodeDecodeError:
            return None  # the split falls inside a UTF-8 character
        if not toks or b"".join(self._bytes_of(t) for t in toks) != rest:
            return None
        return np.asarray(toks, dtype=np.int32)
