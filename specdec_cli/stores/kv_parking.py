"""Parked KV states: a long conversation's KV cache kept in memory while a short side request uses the context.

The target has one KV cache (sequence 0), and a request that starts with other tokens truncates it to the common
prefix: a coding agent's title or quota request between two turns of its 20k-token conversation would make the next
turn evaluate the whole conversation again (minutes on a CPU). The prompt cache (`prompt_cache.PromptCache`) could
bring it back from disk, but that reads, checksums and loads the whole state, and only when the previous turn was
saved. Parking copies the state into memory (llama.cpp's `llama_state_seq_get_data`) just before it would be cut,
and copies it back (`llama_state_seq_set_data`) when a later prompt shares more with it than with the KV cache:

    parking.prepare(backend, context)   # before the prefill: park what would be lost, or swap a parked state in
    sync(backend, context)              # evaluates only what neither held

A state is parked only when at least `min_tokens` of it would be lost and the new context does not keep 7/8 of it
or more (then it edits it, as an editor's completions do: each would park a whole state never wanted again), and
entries are kept most recently used first within `max_bytes` (one 20k-token Qwen2.5-Coder-1.5B state is ~560 MB).
A copy costs about a memcpy of the state, far less than evaluating it again. Like llama-server's per-slot caches and
its `--cache-ram` prompt cache, whose idea this is (the server's `server_prompt_cache` keeps states in host memory). A
recurrent or hybrid model's state (`Backend.rollback` not "kv") cannot be cut: a parked state, or the held one, counts
only when it is a whole prefix of the context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specdec_cli.errors import CacheTrimError, StateError
from specdec_cli.models.backend import common_prefix

DEFAULT_MAX_BYTES = 2 * 1024**3  # 2 GiB: ~75k tokens of Qwen2.5-Coder-1.5B's KV (28 KB per token)
DEFAULT_MIN_TOKENS = 256  # losing fewer is cheaper to evaluate again than to copy
EDITED = 7 / 8  # a context keeping this share of the held state or more edits it: the tail it cuts is not parked


class ParkableBackend(Protocol):
    """What parking needs from a backend (`LlamaBackend` implements it; tests use `fakes.FakeBackend`)."""

    @property
    def tokens(self) -> np.ndarray:
        """int32 [n]: the tokens held in the KV cache."""
        ...

    def truncate(self, n: int) -> None: ...

    def snapshot(self) -> Any:
        """A copy in memory of the KV state of sequence 0 (its cells, not its token list); its len() is its bytes."""
        ...

    def restore_snapshot(self, data: Any, tokens: np.ndarray) -> None:
        """Replace the KV cache by `data` (from `snapshot`), which holds `tokens`. Raises StateError (cache left
        empty)."""
        ...


@dataclass
class _Parked:
    tokens: np.ndarray  # int32 [n]
    data: Any
    n_bytes: int
    used: float


@dataclass
class KvParking:
    """Parked KV states of one backend, in memory.

    Attributes:
        max_bytes: the most bytes all parked states may take (least recently used dropped first).
        min_tokens: park only when at least this many tokens of the KV cache would be lost.
        n_parked / n_restored: how many states were parked / swapped back in (for tests and logs).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    min_tokens: int = DEFAULT_MIN_TOKENS
    n_parked: int = 0
    n_restored: int = 0
    _entries: list[_Parked] = field(default_factory=list)

    def parked_tokens(self) -> list[np.ndarray]:
        """The tokens of each parked state (int32 [n] each)."""
        return [e.tokens for e in self._entries]

    def prepare(self, backend: ParkableBackend, context: np.ndarray) -> int:
        """Before `context` (int [n]) is evaluated: swap in the parked state that shares the most with it, when it
        shares at least `min_tokens` more than the KV cache does; and park the KV cache first when at least
        `min_tokens` of it would otherwise be lost, unless `context` keeps `EDITED` of it (an editor's next completion
        re-reads the few hundred tokens after its cursor: the state with the old ones is not wanted again).

        Returns the tokens restored from a parked state (0: the KV cache was kept as it is). Never raises: a state
        llama.cpp refuses is dropped and the cache is evaluated instead.
        """
        context = np.asarray(context, dtype=np.int32)
        held = backend.tokens
        kept = common_prefix(held, context)
        whole = getattr(backend, "rollback", "kv") != "kv"  # a recurrent state is used whole or not at all
        if whole and kept < len(held):
            kept = 0
        best, shared = None, kept
        for entry in self._entries:
            n = min(common_prefix(entry.tokens, context), len(context))
            if whole and n < len(entry.tokens):
                n = 0
            if n > shared:
                best, shared = entry, n
        if best is not None and shared - kept < self.min_tokens:
            best = None  # not worth a swap
        if len(held) - kept >= self.min_tokens and kept < EDITED * len(held):
            self._park(backend, held)
        if best is None:
            return 0
        self._entries.remove(best)
        try:
            backend.restore_snapshot(best.data, best.tokens)
            backend.truncate(shared)
        except (StateError, CacheTrimError):
            backend.truncate(0)
            return 0
        best.used = time.monotonic()
        self._entries.append(best)  # still parked: a later request may want it whole again
        self.n_restored += 1
        return shared

    def _park(self, backend: ParkableBackend, held: np.ndarray) -> None:
        for entry in self._entries:  # already parked (or a longer state holding it): just touch it
            if len(entry.tokens) >= len(held) and np.array_equal(entry.tokens[: len(held)], held):
                entry.used = time.monotonic()
                return
        data = backend.snapshot()
        entry = _Parked(held.copy(), data, len(data), time.monotonic())
        # states that are a prefix of the new one are covered by it
        self._entries = [
            e
            for e in self._entries
            if not (len(e.tokens) <= len(held) and np.array_equal(held[: len(e.tokens)], e.tokens))
        ]
        self._entries.append(entry)
        self.n_parked += 1
        self._entries.sort(key=lambda e: e.used)
        while sum(e.n_bytes for e in self._entries) > self.max_bytes and self._entries:
            self._entries.pop(0)

    @property
    def n_bytes(self) -> int:
        """Bytes the parked states take."""
        return sum(e.n_bytes for e in self._entries)

    def clear(self) -> None:
        self._entries.clear()
