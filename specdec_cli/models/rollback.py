"""How a recurrent or hybrid model's state rolls back: the guard between a backend's `truncate` and llama.cpp.

A transformer's KV cache keeps any prefix (`llama_memory_seq_rm`). A recurrent state (Mamba, RWKV) or a hybrid's
recurrent layers (LFM2's short convolutions, Qwen3.5's Gated DeltaNet) is one state per sequence, overwritten by each
token. llama.cpp (b11312) keeps `n_rs_seq` snapshots of it per sequence (`llama_context_params.n_rs_seq`, granted only
to the architectures of `llm_arch_supports_rs_rollback`), and `llama_memory_seq_rm` then drops the last
1..n_rs_seq tokens of the LAST `llama_decode` call exactly, once per call (src/llama-memory-recurrent.cpp,
`seq_rm`). Asked to drop more than that call held, it returns true and leaves a wrong state, silently; with no
snapshot left it returns false and the next decode fails. llama-server therefore keeps its drafts within the
snapshots and otherwise restores a checkpoint of the recurrent state (`llama_state_seq_set_data_ext`,
`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`) saved before the verify batch and evaluates the accepted tokens again
(tools/server/server-context.cpp, `use_ckpt_tgt`).

`RecurrentGuard` is that rule, once, for `LlamaBackend` and the tests' `FakeBackend`: a trim reaches llama.cpp
partially only inside the last call's own tokens (at least one of them kept, at most n_rs_seq dropped, once);
otherwise the checkpoint saved before that call is restored and the kept tokens replayed; otherwise the sequence is
cleared and the caller evaluates what it needs again (`backend.sync`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

TRANSFORMER, HYBRID, RECURRENT = "transformer", "hybrid", "recurrent"  # a backend's `kind`
# a backend's `rollback`: how a verify pass's rejected tokens leave the cache
KV, SNAPSHOTS, CHECKPOINT, NO_ROLLBACK = "kv", "snapshots", "checkpoints", "none"


def draft_limit(rollback: str, n_batch: int, n_rs_seq: int) -> int:
    """The most draft tokens one verify pass may carry: n_batch - 1 (one llama.cpp batch); with rollback by snapshots
    at most `n_rs_seq`, so every rollback stays inside the pass's own tokens; 0 where nothing rolls back."""
    if rollback == SNAPSHOTS:
        return max(0, min(n_batch - 1, n_rs_seq))
    return 0 if rollback == NO_ROLLBACK else n_batch - 1


def needs_checkpoint(rollback: str, m: int, n_logits: int, n_rs_seq: int) -> bool:
    """Whether a pass of `m` tokens with `n_logits` logit rows needs a checkpoint before it: a verify pass
    (n_logits > 1; a prefill is never rolled back) with more draft tokens (m - 1) than the snapshots cover."""
    return rollback in (SNAPSHOTS, CHECKPOINT) and n_logits > 1 and m - 1 > n_rs_seq


def _mean(old: float, x: float, weight: float = 0.2) -> float:
    """A running mean of a cost in ms: the first sample as it is, then exponentially weighted."""
    return x if old <= 0.0 else old + weight * (x - old)


class RecurrentGuard:
    """The rollback rule for a backend whose `kind` is not "transformer" (a mixin).

    The host class provides `rollback`, `n_rs_seq`, `tokens` (int32 [n]), `decode(tokens, n_logits)` and four raw
    operations on its sequence: `_seq_rm(n) -> bool` (llama.cpp's partial `llama_memory_seq_rm(seq, n, -1)`, which
    may corrupt the state silently: only `_truncate_recurrent` calls it), `_seq_clear()` (drop the whole sequence),
    `_state_save() -> object | None` (the recurrent part of the state; None: nothing copied) and
    `_state_load(state, at) -> bool` (restore it; a hybrid's attention cells from position `at` dropped; the sequence
    then holds `at` tokens). It calls `_guard_reset()` in its constructor and after loading a whole state,
    `_before_pass(start, m, n_logits)` before each pass, `_after_call(start)` after each successful llama_decode
    call, `_undo_pass(start)` after a failed one, and `_truncate_recurrent(n)` from `truncate`.

    Attributes:
        checkpoint_ms, restore_ms: running means of saving a checkpoint and of restoring it plus replaying the kept
            tokens, in ms.
        n_snapshot_rollbacks, n_checkpoint_rollbacks, n_cleared: how often each way was taken.
    """

    # What the host class provides (see above), declared for the type checker only: nothing here shadows the host's.
    rollback: str
    n_rs_seq: int
    tokens: Any  # int32 [n]
    if TYPE_CHECKING:

        def decode(self, tokens: Any, n_logits: int = ...) -> Any: ...
        def _seq_rm(self, n: int) -> bool: ...
        def _seq_clear(self) -> None: ...
        def _state_save(self) -> object | None: ...
        def _state_load(self, state: Any, at: int) -> bool: ...

    checkpoint_ms = 0.0
    restore_ms = 0.0
    n_snapshot_rollbacks = 0
    n_checkpoint_rollbacks = 0
    n_cleared = 0

    def _guard_reset(self) -> None:
        self._last_start: int | None = None  # first position of the last llama_decode call on this sequence
        self._rolled = False  # that call was already rolled back by a snapshot
        self._ckpt: tuple[int, Any] | None = None  # (position, recurrent state) saved before the last pass

    @property
    def rollback_ms(self) -> float:
        """What a verify pass rolled back by checkpoint costs on top of the pass, in ms: saving the checkpoint and
        restoring it plus replaying the kept tokens (running means; 0 before the first and for rollback by KV cache
        or snapshots, whose cost the pass's own time includes)."""
        return self.checkpoint_ms + self.restore_ms

    def _before_pass(self, start: int, m: int, n_logits: int) -> None:
        """Before a pass of `m` tokens at `start`: save a checkpoint when a rollback of it may exceed the snapshots."""
        self._ckpt = None
        if not needs_checkpoint(self.rollback, m, n_logits, self.n_rs_seq):
            return
        t0 = time.perf_counter()
        state = self._state_save() if start else None  # at 0 the state before the pass is empty
        if start and state is None:  # llama.cpp copied nothing: no rollback for this model from now on
            self.rollback = NO_ROLLBACK if self.rollback == CHECKPOINT else self.rollback
            return
        self._ckpt = (start, state)
        self.checkpoint_ms = _mean(self.checkpoint_ms, (time.perf_counter() - t0) * 1e3)

    def _after_call(self, start: int) -> None:
        """A llama_decode call from position `start` succeeded: its tokens are the ones a snapshot can drop."""
        self._last_start, self._rolled = start, False

    def _restore_checkpoint(self) -> bool:
        ck, self._ckpt = self._ckpt, None
        if ck is None:
            return False
        at, state = ck
        if state is None:
            self._seq_clear()
        elif not self._state_load(state, at):
            return False
        self._last_start, self._rolled = None, False
        return True

    def _clear(self) -> None:
        self._seq_clear()
        self._guard_reset()
        self.n_cleared += 1

    def _truncate_recurrent(self, n: int) -> None:
        """Keep n < len(tokens) tokens: by a snapshot when every dropped token is the last call's own (at least one of
        its tokens kept, at most n_rs_seq dropped, once); else by the checkpoint saved before that pass, the kept
        tokens then evaluated again; else the sequence is cleared (`tokens` empty)."""
        held = len(self.tokens)
        if (
            self.rollback == SNAPSHOTS
            and not self._rolled
            and self._last_start is not None
            and self._last_start < n
            and held - n <= self.n_rs_seq
        ):
            if self._seq_rm(n):
                self._rolled = True
                self._ckpt = None  # the state moved: the pass's checkpoint no longer leads to it by a replay alone
                self.n_snapshot_rollbacks += 1
                return
        ck = self._ckpt
        if ck is not None and ck[0] <= n:
            t0 = time.perf_counter()
            replay = [int(t) for t in self.tokens[ck[0] : n]]
            if self._restore_checkpoint():
                if replay:
                    self.decode(replay, n_logits=0)
                self.restore_ms = _mean(self.restore_ms, (time.perf_counter() - t0) * 1e3)
                self.n_checkpoint_rollbacks += 1
                return
        self._clear()

    def _undo_pass(self, start: int) -> None:
        """After a failed or interrupted pass from `start`: the recurrent state (updated in place) is restored from
        the checkpoint saved at `start`, else the sequence is cleared; it is never trimmed partially."""
        ck = self._ckpt
        if not (ck is not None and ck[0] == start and self._restore_checkpoint()):
            self._clear()
