"""What the engine asks of the KV states kept outside the KV cache, as protocols, so `core/` names no store above it:
the prompt cache on disk (`stores.prompt_cache.PromptCache` implements `StateCache`) and the server's states parked in
memory (`stores.kv_parking.KvParking` implements `StateParking`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np


class StateCache(Protocol):
    """KV states saved across runs. `backend` is the engine's target: a store needs more of it than `Backend`
    states (its KV state as bytes: `stores.prompt_cache.StatefulBackend`)."""

    def restore(self, backend: Any, tokens: Sequence[int] | np.ndarray) -> tuple[int, float]:
        """Replace the backend's KV cache by the saved state of the longest prefix of `tokens`, when that beats what
        it holds: (tokens restored, ms it took)."""
        ...

    def save(self, backend: Any) -> int:
        """Save the backend's KV state; the bytes written (0: nothing written)."""
        ...


class StateParking(Protocol):
    """KV states kept in memory while a request with other tokens uses the KV cache."""

    def prepare(self, backend: Any, context: np.ndarray) -> int:
        """Before `context` is evaluated: park what it would cut, or swap a parked state back in; the tokens
        restored. `backend` is the engine's target: a parking needs more of it than `Backend` states (its KV state
        as a snapshot in memory: `stores.kv_parking.ParkableBackend`)."""
        ...
